"""The one module of tp_fusion that talks to torch.distributed.

Everything else calls these wrappers. They hide the differences between torch versions
(2.11 has only ``all_gather_into_tensor``/``reduce_scatter_tensor``; 2.13 adds ``*_single``
and deprecates the old names) and between backends (gloo has no native reduce_scatter).
"""

from __future__ import annotations

import datetime
import functools

import torch
import torch.distributed as _dist

ReduceOp = _dist.ReduceOp
ProcessGroup = _dist.ProcessGroup

_all_gather_base = getattr(_dist, "all_gather_single", None) or _dist.all_gather_into_tensor
_reduce_scatter_base = getattr(_dist, "reduce_scatter_single", None) or _dist.reduce_scatter_tensor


def is_initialized() -> bool:
    return _dist.is_available() and _dist.is_initialized()


def world_size() -> int:
    return _dist.get_world_size() if is_initialized() else 1


def rank() -> int:
    return _dist.get_rank() if is_initialized() else 0


def backend() -> str:
    return str(_dist.get_backend()) if is_initialized() else "none"


def init_process_group(backend: str, rank: int, world_size: int, init_method: str, timeout_s: float) -> None:
    _dist.init_process_group(
        backend, rank=rank, world_size=world_size, init_method=init_method,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


_before_destroy: list = []


def before_destroy(callback) -> None:
    """Have ``destroy_process_group`` call ``callback()`` first (e.g. to release CUDA graphs)."""
    _before_destroy.append(callback)


def destroy_process_group() -> None:
    if is_initialized():
        for callback in _before_destroy:
            callback()
        _dist.destroy_process_group()


@functools.cache
def group(ranks: tuple[int, ...]) -> ProcessGroup | None:
    """The process group over ``ranks`` (created once, then reused).

    Every rank of the world must call this for every group in the same order (torch requires it
    for ``new_group``); callers create all groups of a plan up front. None is the world group.
    """
    if list(ranks) == list(range(world_size())):
        return None
    return _dist.new_group(list(ranks))


def group_name(pg: ProcessGroup | None) -> str:
    return (pg or _dist.group.WORLD).group_name


def group_rank(pg: ProcessGroup | None) -> int:
    return _dist.get_rank(pg)


def all_gather(out: torch.Tensor, inp: torch.Tensor, pg: ProcessGroup | None) -> None:
    """``out`` = the group's ``inp``s concatenated along dim 0 (in group rank order)."""
    _all_gather_base(out, inp, group=pg)


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, pg: ProcessGroup | None, op: str = "sum") -> None:
    """``out`` = this rank's dim-0 chunk of the element-wise reduction of the group's ``inp``s.

    Native on NCCL and, from torch 2.11, on gloo. Both run on flat views: gloo checks that dim 0 of
    ``inp`` is the group size times dim 0 of ``out``, which other shapes of the same sizes fail."""
    red = _reduce_op(op)
    if out.is_contiguous():
        _reduce_scatter_base(out.view(-1), inp.reshape(-1), op=red, group=pg)
        return
    flat = out.new_empty(out.numel())
    _reduce_scatter_base(flat, inp.reshape(-1), op=red, group=pg)
    out.copy_(flat.view(out.shape))


def all_reduce(t: torch.Tensor, pg: ProcessGroup | None, op: str = "sum") -> None:
    _dist.all_reduce(t, op=_reduce_op(op), group=pg)


def all_to_all(out: torch.Tensor, inp: torch.Tensor, pg: ProcessGroup | None) -> None:
    """Dim-0 chunk i of ``inp`` goes to group rank i; ``out`` stacks what each rank sent us."""
    _dist.all_to_all_single(out, inp, group=pg)


def broadcast(t: torch.Tensor, src: int, pg: ProcessGroup | None) -> None:
    """``src`` is a global rank."""
    _dist.broadcast(t, src=src, group=pg)


def send(t: torch.Tensor, dst: int) -> None:
    _dist.send(t, dst=dst)


def recv(t: torch.Tensor, src: int) -> None:
    _dist.recv(t, src=src)


def isend(t: torch.Tensor, dst: int):
    return _dist.isend(t, dst=dst)


def irecv(t: torch.Tensor, src: int):
    return _dist.irecv(t, src=src)


def barrier(pg: ProcessGroup | None = None) -> None:
    _dist.barrier(group=pg)


def _reduce_op(op: str):
    return {"sum": ReduceOp.SUM, "max": ReduceOp.MAX, "min": ReduceOp.MIN}[op]


# --- group geometry (used by overlap.py and symm.py) ---


def group_size(pg: ProcessGroup | None) -> int:
    return _dist.get_world_size(pg)


def global_rank(pg: ProcessGroup | None, group_rank: int) -> int:
    """The world rank of ``group_rank`` in ``pg`` (send/recv address world ranks)."""
    return group_rank if pg is None else _dist.get_global_rank(pg, group_rank)


# --- host-side agreement (used by the executor) ---


HOST_TIMEOUT_S = 120.0  # how long a host-side exchange waits for a peer under NCCL


@functools.cache
def _cpu_group() -> ProcessGroup | None:
    """A gloo group over the world for small host-side exchanges (the world itself under gloo)."""
    if backend() == "gloo":
        return None
    return _dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=HOST_TIMEOUT_S))


def any_rank_flagged(flag: bool) -> bool:
    """True on every rank if any rank passes True (one tiny host-side all_reduce)."""
    t = torch.tensor([int(flag)], dtype=torch.int32)
    _dist.all_reduce(t, op=ReduceOp.MAX, group=_cpu_group())
    return bool(t.item())


def gather_from_all(obj) -> list:
    """Every rank's ``obj``, in rank order, on every rank (host-side)."""
    out = [None] * world_size()
    _dist.all_gather_object(out, obj, group=_cpu_group())
    return out


# --- DTensor interop (used by tp_fusion/dtensor.py) ---
# torch's DTensor, its placements and its DeviceMesh, imported on first use: the rest of tp_fusion
# never needs them, and some builds ship torch.distributed.tensor with optional parts missing.


@functools.cache
def dtensor_api():
    """A namespace with torch's ``DTensor``, ``Shard``, ``Replicate``, ``Partial`` and ``DeviceMesh``."""
    from types import SimpleNamespace

    from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    return SimpleNamespace(DTensor=DTensor, Shard=Shard, Replicate=Replicate, Partial=Partial,
                           DeviceMesh=TorchDeviceMesh)


def torch_device_mesh(device_type: str, ranks: torch.Tensor):
    """A torch DeviceMesh over ``ranks`` (an n-D tensor of world ranks); collective over the world."""
    return dtensor_api().DeviceMesh(device_type, ranks)


# --- agreement and failure propagation (used by executor.py and plan.py) ---
# Before a plan runs, the ranks agree in one tiny host-side all_reduce that no rank rejected its
# inputs and that all compiled the same fusion for the same global shapes. When a rank fails INSIDE
# a plan, it publishes "rank r failed in segment k: ..." to the process group's store and aborts its
# process groups: peers blocked in a collective with it error out at once (gloo closes the pairs),
# abort theirs in turn (so the failure cascades to every rank), and read the store to name the
# rank that failed first. A peer that exits without a word is named as the one that stopped
# responding. NCCL: the abort uses ``_abort_process_group`` where torch has it; peers blocked in a
# NCCL kernel are released by NCCL's own watchdog (the process group's timeout).

_FAULT_KEY = "tp_fusion/fault/"


def warm_up_before_init() -> None:
    """Run one op on a meta tensor, which imports torch's lazily loaded dispatch machinery (dynamo).

    Imported AFTER init_process_group, some of those modules keep references to the default group
    (default arguments), so destroying it no longer closes gloo's connections and peers blocked
    in a collective are not released. tp_fusion infers shapes on meta tensors, so this import
    happens anyway; doing it before init keeps ``abort_process_groups`` effective. Called at
    import of this module and by ``tp_fusion.launch`` before it joins a process group.
    """
    torch.empty(1, device="meta").relu()


warm_up_before_init()
_FP_BITS = 62
_fault_store = None  # kept alive after an abort: rank 0 may host the TCPStore server


def agree(failed: bool, fingerprint: int) -> tuple[bool, bool]:
    """(some rank failed, the ranks' fingerprints differ), the same on every rank.

    One host-side all_reduce(MAX) of ``[failed, fp, -fp]``; a failed rank's fingerprint is neutral.
    """
    low = -(1 << _FP_BITS)
    fp = fingerprint & ((1 << _FP_BITS) - 1)
    t = torch.tensor([int(failed), low if failed else fp, low if failed else -fp], dtype=torch.int64)
    _dist.all_reduce(t, op=ReduceOp.MAX, group=_cpu_group())
    any_failed, hi, neg_lo = (int(v) for v in t.tolist())
    return bool(any_failed), not any_failed and hi != -neg_lo


def _default_store():
    try:
        from torch.distributed import distributed_c10d as c10d

        return c10d._get_default_store()
    except Exception:  # no process group, or a torch without the helper
        return None


def abort_process_groups(exc: BaseException | None = None) -> None:
    """Tear down every process group of this rank now, so peers blocked on it error out promptly.

    gloo closes its connections only when the group object dies: the frames of ``exc`` (the error
    being handled, whose torch frames hold the group) are cleared first.
    """
    import gc
    import traceback

    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__
    if not is_initialized():
        return
    try:
        from torch.distributed import distributed_c10d as c10d

        if backend() == "nccl" and hasattr(c10d, "_abort_process_group"):
            c10d._abort_process_group()  # ncclCommAbort: never waits on pending kernels
        else:
            _dist.destroy_process_group()
    except Exception:
        pass
    finally:
        group.cache_clear()
        _cpu_group.cache_clear()
        gc.collect()


def _store_records(store, world: int) -> dict[int, str]:
    keys = [f"{_FAULT_KEY}{r}" for r in range(world)]
    out = {}
    for r, k in enumerate(keys):
        if store.check([k]):
            out[r] = store.get(k).decode()
    return out


def report_failure(rank: int, where: str, error: str, primary: bool, exc: BaseException | None = None,
                   grace_s: float | None = None) -> str:
    """Publish this rank's failure, abort its process groups, and describe the failure that came first.

    ``primary``: the error arose on this rank (not a collective that broke because a peer left);
    ``exc``: the exception being handled (its frames are cleared, see ``abort_process_groups``).
    A peer's failure is waited for at most ``grace_s`` seconds (env ``TP_FUSION_FAULT_GRACE_S``,
    default 3); ranks that published nothing by then are named as having stopped responding.
    Returns the text for this rank's ExecutionError.
    """
    import os
    import time

    global _fault_store
    if grace_s is None:
        grace_s = float(os.environ.get("TP_FUSION_FAULT_GRACE_S", "3"))
    world = world_size()
    own = f"rank {rank} failed in {where}: {error}"
    store = _fault_store = _default_store() if is_initialized() else _fault_store
    if store is None or world <= 1:
        abort_process_groups(exc)
        return own
    unreachable = (f"{own} (the process group's store is unreachable: rank 0, which hosts it, most likely "
                   "exited or failed first)")
    try:
        store.set_timeout(datetime.timedelta(seconds=max(grace_s, 1.0)))
        seq = store.add(f"{_FAULT_KEY}seq", 1)
        store.set(f"{_FAULT_KEY}{rank}", f"{seq}|{int(primary)}|{own}")
    except Exception:
        store = None
    abort_process_groups(exc)
    if store is None:
        return unreachable
    deadline = time.monotonic() + grace_s
    records: dict[int, str] = {}
    while True:
        try:
            records = _store_records(store, world)
        except Exception:  # the store's host (rank 0) is gone
            if not records:
                return unreachable
            break
        firsts = [r for r, v in records.items() if v.split("|", 2)[1] == "1"]
        if primary:  # stay until the peers have read the store (this process may host it)
            done = all(store.check([f"{_FAULT_KEY}read/{r}"]) for r in range(world) if r != rank)
        else:
            done = bool(firsts) or len(records) == world
        if done or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    if not primary:
        try:
            store.set(f"{_FAULT_KEY}read/{rank}", "1")
        except Exception:
            pass
    parsed = {r: v.split("|", 2) for r, v in records.items()}
    firsts = sorted((int(seq), r) for r, (seq, p, _) in parsed.items() if p == "1")
    if firsts and firsts[0][1] != rank:
        return f"{parsed[firsts[0][1]][2]} (seen from rank {rank}, which then {own.split(' ', 2)[2]})"
    if firsts:
        return own
    missing = [r for r in range(world) if r not in parsed and r != rank]
    if missing:
        who = ", ".join(map(str, missing))
        return (f"rank(s) {who} stopped responding (process exited or hung; no failure report) while "
                f"rank {rank} was in {where}: {error}")
    return own
