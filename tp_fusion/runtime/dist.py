"""The one module of tp_fusion that talks to torch.distributed: thin wrappers, nothing else.

They hide the differences between torch versions (2.11 has only ``all_gather_into_tensor``/
``reduce_scatter_tensor``; 2.13 adds ``*_single`` and deprecates the old names) and between
backends. Nothing runs at import time.
"""

from __future__ import annotations

import datetime
import weakref

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
    global _aborted
    _aborted = False
    _dist.init_process_group(
        backend, rank=rank, world_size=world_size, init_method=init_method,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


_before_destroy: list = []


def before_destroy(callback) -> None:
    """Have ``destroy_process_group`` call ``callback()`` first (e.g. to release CUDA graphs)."""
    if callback not in _before_destroy:
        _before_destroy.append(callback)


def destroy_process_group() -> None:
    """Destroy the default process group and every group made under it (a group object left alive
    past interpreter exit aborts the process: gloo's threads are torn down unjoined)."""
    global _aborted
    _aborted = False
    if is_initialized():
        for callback in _before_destroy:
            callback()
        _groups.clear()
        _host.clear()
        _dist.destroy_process_group()


def timeout_s() -> float:
    """The default process group's timeout in seconds (what its collectives wait for at most)."""
    device = torch.device("cuda" if backend() == "nccl" else "cpu")
    return _dist.GroupMember.WORLD._get_backend(device).options._timeout.total_seconds()


def world_token() -> weakref.ref | None:
    """A weak reference to the default process group (None without one). Equal tokens mean the same,
    live group: after a destroy and a new init the old token compares unequal. Weak, so that nothing
    built under a group keeps it alive past its destruction (a gloo group destroyed at interpreter
    exit aborts the process: "terminate called without an active exception")."""
    return weakref.ref(_dist.GroupMember.WORLD) if is_initialized() else None


_groups: dict[tuple[int, ...], ProcessGroup | None] = {}
_groups_world = None  # the token of the world group the cached groups belong to


def group(ranks: tuple[int, ...]) -> ProcessGroup | None:
    """The process group over ``ranks`` (created once per default process group, then reused).

    Every rank of the world must call this for every group in the same order (torch requires it
    for ``new_group``); callers create all groups of a plan up front. None is the world group.
    """
    global _groups_world
    if _groups_world != world_token():  # a new default group: the old subgroups are gone
        _groups.clear()
        _groups_world = world_token()
    if ranks not in _groups:
        _groups[ranks] = None if list(ranks) == list(range(world_size())) else _dist.new_group(list(ranks))
    return _groups[ranks]


def group_name(pg: ProcessGroup | None) -> str:
    return (pg or _dist.group.WORLD).group_name


def group_rank(pg: ProcessGroup | None) -> int:
    return _dist.get_rank(pg)


def _wire(t: torch.Tensor | None, op: str = "sum") -> torch.Tensor | None:
    """``t`` as the collectives carry it: a complex tensor as its real view (``torch.view_as_real``: a trailing dim
    of 2, the same memory, so a result written into it is written into ``t``), as torch does itself for some
    collectives only (gloo has no complex gather). A sum of the real views is the complex sum; a max, min or
    prod of them would not be the complex one (``sharding.rules.reduction`` plans none): refused."""
    if t is None or not t.is_complex():
        return t
    if op != "sum":
        raise ValueError(f"a {op} of complex tensors across devices is not supported (only sums are: a complex "
                         f"{op} is not the {op} of the real and imaginary parts)")
    return torch.view_as_real(t)


# Every tensor given to torch.distributed below passes ``_wire`` (complex tensors travel as real views).
# With ``async_op`` the collectives below return the work: ``work.wait()`` makes the current stream (on
# the CPU: the host) wait for the result, which the caller must not read before.

def all_gather(out: torch.Tensor, inp: torch.Tensor, pg: ProcessGroup | None, async_op: bool = False):
    """``out`` = the group's ``inp``s concatenated along dim 0 (in group rank order)."""
    return _all_gather_base(_wire(out), _wire(inp), group=pg, async_op=async_op)


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, pg: ProcessGroup | None, op: str = "sum",
                   async_op: bool = False):
    """``out`` = this rank's dim-0 chunk of the element-wise reduction of the group's ``inp``s.

    Native on NCCL and, from torch 2.11, on gloo. Both run on flat views: gloo checks that dim 0 of
    ``inp`` is the group size times dim 0 of ``out``, which other shapes of the same sizes fail.
    ``async_op`` needs a contiguous ``out``."""
    red = _reduce_op(op)
    if out.is_contiguous():
        return _reduce_scatter_base(_wire(out.view(-1), op).view(-1), _wire(inp.reshape(-1), op).reshape(-1), op=red,
                                    group=pg, async_op=async_op)
    if async_op:
        raise ValueError("reduce_scatter(async_op=True) needs a contiguous output")
    flat = out.new_empty(out.numel())
    _reduce_scatter_base(_wire(flat, op).view(-1), _wire(inp.reshape(-1), op).reshape(-1), op=red, group=pg)
    out.copy_(flat.view(out.shape))


def all_reduce(t: torch.Tensor, pg: ProcessGroup | None, op: str = "sum", async_op: bool = False):
    return _dist.all_reduce(_wire(t, op), op=_reduce_op(op), group=pg, async_op=async_op)


def all_to_all(out: torch.Tensor, inp: torch.Tensor, pg: ProcessGroup | None) -> None:
    """Dim-0 chunk i of ``inp`` goes to group rank i; ``out`` stacks what each rank sent us."""
    _dist.all_to_all_single(_wire(out), _wire(inp), group=pg)


def broadcast(t: torch.Tensor, src: int, pg: ProcessGroup | None) -> None:
    """``src`` is a global rank."""
    _dist.broadcast(_wire(t), src=src, group=pg)


def gather(t: torch.Tensor, pieces: list[torch.Tensor] | None, dst: int, pg: ProcessGroup | None) -> None:
    """World rank ``dst`` receives every group rank's ``t`` into ``pieces`` (group rank order); the
    others pass None."""
    _dist.gather(_wire(t), pieces and [_wire(p) for p in pieces], dst=dst, group=pg)


def reduce(t: torch.Tensor, dst: int, pg: ProcessGroup | None, op: str = "sum") -> None:
    """World rank ``dst``'s ``t`` becomes the ``op``-reduction (sum, max, min, prod) of the group's ``t``s."""
    _dist.reduce(_wire(t, op), dst=dst, op=_reduce_op(op), group=pg)


def scatter(out: torch.Tensor, pieces: list[torch.Tensor] | None, src: int, pg: ProcessGroup | None) -> None:
    """Group rank i's ``out`` = world rank ``src``'s ``pieces[i]``; the others pass None."""
    _dist.scatter(_wire(out), pieces and [_wire(p) for p in pieces], src=src, group=pg)


def isend(t: torch.Tensor, dst: int, tag: int = 0, pg: ProcessGroup | None = None):
    """To world rank ``dst``, over ``pg`` (None: the world)."""
    return _dist.isend(_wire(t), dst=dst, group=pg, tag=tag)


def irecv(t: torch.Tensor, src: int | None, tag: int = 0, pg: ProcessGroup | None = None):
    """From world rank ``src``, or (``src=None``) from whichever rank of ``pg`` sends with ``tag``."""
    return _dist.irecv(_wire(t), src=src, group=pg, tag=tag)


def barrier(pg: ProcessGroup | None = None) -> None:
    _dist.barrier(group=pg)


def _reduce_op(op: str):
    return {"sum": ReduceOp.SUM, "max": ReduceOp.MAX, "min": ReduceOp.MIN, "prod": ReduceOp.PRODUCT}[op]


# --- group geometry (used by overlap.py and symm.py) ---


def group_size(pg: ProcessGroup | None) -> int:
    return _dist.get_world_size(pg)


def global_rank(pg: ProcessGroup | None, group_rank: int) -> int:
    """The world rank of ``group_rank`` in ``pg`` (send/recv address world ranks)."""
    return group_rank if pg is None else _dist.get_global_rank(pg, group_rank)


# --- host-side exchanges (used by tp_fusion.runtime.faults) ---

HOST_TIMEOUT_S = 120.0  # how long a host-side exchange waits for a peer under NCCL
_host: dict[object, ProcessGroup | None] = {}


def host_group() -> ProcessGroup | None:
    """A gloo group over the world for small host-side exchanges (the world itself under gloo)."""
    if backend() == "gloo":
        return None
    token = world_token()
    if token not in _host:
        _host.clear()
        _host[token] = _dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=HOST_TIMEOUT_S))
    return _host[token]


def host_all_reduce_max(t: torch.Tensor, async_op: bool = False):
    """In place, over the world, on the host group (with ``async_op``: returns the work; gloo runs
    it on its own thread)."""
    return _dist.all_reduce(t, op=ReduceOp.MAX, group=host_group(), async_op=async_op)


def gather_from_all(obj) -> list:
    """Every rank's ``obj``, in rank order, on every rank (host-side)."""
    out = [None] * world_size()
    _dist.all_gather_object(out, obj, group=host_group())
    return out


def default_store():
    """The default process group's store (None without one)."""
    try:
        from torch.distributed import distributed_c10d as c10d

        return c10d._get_default_store()
    except Exception:  # no process group, or a torch without the helper
        return None


_aborted = False  # abort() tore the last default process group down (not its owner, nor a new init since)


def aborted() -> bool:
    """Whether there is no default process group because ``abort`` tore it down (a plan failed on this
    rank); False once ``init_process_group`` or ``destroy_process_group`` here ran after it, or while a
    group that the user initialized through torch itself is up."""
    return _aborted and not is_initialized()


def abort() -> None:
    """Tear down every process group of this rank now, never waiting on pending work (NCCL:
    ``ncclCommAbort`` where torch has it; gloo: destroying closes the connections)."""
    global _aborted
    if not is_initialized():
        return
    _aborted = True
    try:
        from torch.distributed import distributed_c10d as c10d

        if backend() == "nccl" and hasattr(c10d, "_abort_process_group"):
            c10d._abort_process_group()
        else:
            _dist.destroy_process_group()
    except Exception:
        pass
    finally:
        _groups.clear()
        _host.clear()


def warm_up_before_init() -> None:
    """Run one op on a meta tensor, which imports torch's lazily loaded dispatch machinery (dynamo).

    Imported AFTER init_process_group, some of those modules keep references to the default group
    (default arguments), so destroying it no longer closes gloo's connections and peers blocked
    in a collective are not released. ``tp_fusion.launch`` calls this before it joins a process
    group; a program that initializes torch.distributed itself may call it first too.
    """
    torch.empty(1, device="meta").relu()


def is_dtensor(x) -> bool:
    """Whether ``x`` is a torch DTensor (for a plain tensor or parameter, without importing
    torch.distributed.tensor)."""
    if type(x) in (torch.Tensor, torch.nn.Parameter):
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(x, DTensor)
