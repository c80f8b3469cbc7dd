"""Agreement before a plan runs, and failure reporting while it runs.

Agreement: before a plan runs (every call under gloo, at compile under NCCL), the ranks agree in
one tiny host-side all_reduce that no rank rejected its inputs and that all compiled the same
fusion, for the same global shapes, at the same point of their sequence of executes. When something
differs, a gather tells every rank what, and every rank raises the same error.

Failure reporting: a rank that fails INSIDE a plan publishes a ``FaultRecord`` to the process
group's store and aborts its process groups; peers blocked in a collective with it error out,
publish theirs and abort in turn, so the failure cascades to every rank. Records are numbered by
the store in the order they arrive: since a rank publishes before it aborts, whoever failed first
has the lowest number among the records that are not a peer's disconnect. Every rank reads the
records and names that rank and its error; a rank that exits without a record is named as the
one that stopped responding. Rank 0 hosts the store, so it stays until its peers have read
(bounded). The store's timeout is restored afterwards.

Under NCCL two more guards run per call, neither waiting for the peers: ``LaggedAgreement`` checks
in batches that the ranks executed the same fusions, and ``ProgressGuard`` bounds how long a rank
waits on the GPU for a peer that died.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import json
import os
import time
import traceback

import torch

from tp_fusion.errors import DefinitionError, ExecutionError
from tp_fusion.runtime import dist

_FAULT_KEY = "tp_fusion/fault/"
_store = None  # kept alive past an abort: rank 0 hosts the TCPStore server its peers still read
_FP_BITS = 62


def agree(failed: bool, fingerprint: int, building: bool = False) -> tuple[bool, bool, bool]:
    """(some rank failed, the ranks' fingerprints differ, some rank is building its plan), the same on
    every rank.

    One host-side all_reduce(MAX) of ``[failed, fp, -fp, building]``; a failed rank's fingerprint is
    neutral.
    """
    low = -(1 << _FP_BITS)
    fp = fingerprint & ((1 << _FP_BITS) - 1)
    t = torch.tensor([int(failed), low if failed else fp, low if failed else -fp, int(building)], dtype=torch.int64)
    dist.host_all_reduce_max(t)
    any_failed, hi, neg_lo, any_building = (int(v) for v in t.tolist())
    return bool(any_failed), not any_failed and hi != -neg_lo, bool(any_building)


class LaggedAgreement:
    """Per-call agreement without waiting for the peers (used under NCCL, where plans agree at compile).

    Every call folds its fingerprint into a running digest; every ``batch`` calls the digest goes
    out in an asynchronous host-side all_reduce(MAX) of ``[d, -d]`` on the gloo host group (gloo's
    thread runs it; the GPU is not involved), and the end of the next batch reads the result, long
    since there, raising on every rank if the digests differed. All ranks read the same values at
    the same call, so they raise together. One all_reduce per batch because a gloo all_reduce takes
    about 0.26 ms (2x H200 hosts): one per call would bound the call rate. The calls that
    mismatched have already run: this turns a silent mix-up into an error up to ``2 * batch`` calls
    later.
    """

    def __init__(self, batch: int = 32):
        self.batch = batch
        self._world = None
        self._pending: tuple[int, torch.Tensor, object] | None = None  # (first call, values, work)
        self._calls, self._digest = 0, 0

    def check_and_launch(self, world, fingerprint: int) -> None:
        """Fold this call's ``fingerprint`` in; ``world`` is ``dist.world_token()`` (a new one starts over)."""
        if self._world != world:
            self._world, self._pending, self._calls, self._digest = world, None, 0, 0
        self._calls += 1
        self._digest = hash((self._digest, fingerprint)) & ((1 << _FP_BITS) - 1)
        if self._calls % self.batch:
            return
        if self._pending is not None:
            first, values, work = self._pending
            work.wait()
            hi, neg_lo = (int(v) for v in values.tolist())
            if hi != -neg_lo:
                self._pending = None
                raise DefinitionError(
                    f"execute: the ranks executed different fusions (or one fusion for different global shapes) "
                    f"at one of their calls {first}-{first + self.batch - 1} of sharded fusions under this process "
                    f"group (up to {self._calls - first} calls ago, whose outputs are therefore wrong); every "
                    "rank must create its FusionDefinitions in the same order and execute them in the same order")
        values = torch.tensor([self._digest, -self._digest], dtype=torch.int64)
        self._pending = (self._calls - self.batch + 1, values, dist.host_all_reduce_max(values, async_op=True))
        self._digest = 0


class ProgressGuard:
    """Bounds how long a rank waits for its peers on the GPU (plans on CUDA tensors, several ranks).

    A peer that dies leaves this rank's GPU blocked for good: a flag wait of a fused segment has no
    time limit, and NCCL's own watchdog ends the process (SIGABRT) without any Python exception.
    So every call records an event at its end, and the call ``LAG`` calls later first waits for it,
    polling from the host, for at most the process group's timeout less a margin (so it acts
    before NCCL's watchdog). On timeout this rank releases its GPU waits, reports the failure
    (``report_failure`` names the peer that left no record) and raises ``ExecutionError``. The host
    may run ``LAG`` calls ahead of the GPU, so the GPU does not idle between calls, and a wait
    spins before it sleeps (a sleep overshoots by about 0.1 ms, longer than a small plan).
    """

    LAG = 4

    def __init__(self):
        self._world = None
        self._pending: list[tuple[int, torch.cuda.Event]] = []
        self._done: list[torch.cuda.Event] = []  # passed events, recorded again (host time: no new event per call)
        self._calls, self._bound_s = 0, 0.0

    def before_call(self, world, rank: int, release_waits) -> None:
        """Wait for the call ``LAG`` calls back; ``world`` is ``dist.world_token()`` (a new one starts
        over); ``release_waits()`` unblocks the GPU on timeout."""
        if self._world != world:
            self._world, self._pending, self._done, self._calls = world, [], [], 0
            self._bound_s = _gpu_wait_bound_s()
        self._calls += 1
        while len(self._pending) >= self.LAG:
            call, event = self._pending.pop(0)
            bound = self._bound_s
            waited = _wait(event, bound)
            if waited is not True:
                self._pending.clear()
                release_waits()
                why = ("a peer reported a failure" if waited == "peer failed" else
                       f"no progress for {bound:.0f} s: a peer timed out (it never sent what this rank waits for)")
                raise ExecutionError(report_failure(rank, f"call {call} of a plan on the GPU", why, local=False))
            self._done.append(event)

    def after_call(self) -> None:
        event = self._done.pop() if self._done else torch.cuda.Event()
        event.record()
        self._pending.append((self._calls, event))


def _gpu_wait_bound_s() -> float:
    """The process group's timeout, less a margin so this rank acts before NCCL's watchdog
    (``TP_FUSION_GPU_WAIT_S`` overrides it)."""
    if "TP_FUSION_GPU_WAIT_S" in os.environ:
        return float(os.environ["TP_FUSION_GPU_WAIT_S"])
    timeout = dist.timeout_s()
    return max(0.8 * timeout, timeout - 10.0)


def _wait(event: torch.cuda.Event, bound_s: float) -> bool | str:
    """True once ``event`` completed; False after ``bound_s`` seconds; "peer failed" as soon as a peer
    has published a failure to the store (polled every half second while waiting). Host-side
    polling, never blocking inside CUDA: it spins for the first 2 ms, then sleeps in growing steps."""
    start = time.monotonic()
    spin_until, pause, next_look = start + 0.002, 1e-3, start + 0.5
    while not event.query():
        now = time.monotonic()
        if now < spin_until:
            continue
        if now > start + bound_s:
            return False
        if now > next_look:
            next_look = now + 0.5
            if _a_peer_failed():
                return "peer failed"
        time.sleep(pause)
        pause = min(2 * pause, 0.01)
    return True


def _a_peer_failed() -> bool:
    try:
        return dist.default_store().check([f"{_FAULT_KEY}seq"])
    except Exception:  # the store's host is gone: a peer failed for sure
        return True


@dataclasses.dataclass(frozen=True)
class FaultRecord:
    """One rank's failure, as published to the store."""

    rank: int
    seq: int  # the store's count when it arrived: lower is earlier
    local: bool  # the error arose on this rank (not a collective broken by a peer that left)
    where: str
    error: str

    def describe(self) -> str:
        return f"rank {self.rank} failed in {self.where}: {self.error}"

    def encode(self) -> bytes:
        return json.dumps(dataclasses.asdict(self)).encode()

    @staticmethod
    def decode(data: bytes) -> FaultRecord:
        return FaultRecord(**json.loads(data))


def _clear_frames(exc: BaseException | None) -> None:
    """gloo closes its connections only when the group object dies: the frames of ``exc`` (the
    error being handled, whose torch frames hold the group) are cleared first."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__


def abort_process_groups(exc: BaseException | None = None) -> None:
    """Tear down every process group of this rank now, so peers blocked on it error out promptly."""
    _clear_frames(exc)
    dist.abort()
    gc.collect()


def _records(store, world: int) -> dict[int, FaultRecord]:
    out = {}
    for r in range(world):
        key = f"{_FAULT_KEY}{r}"
        if store.check([key]):
            out[r] = FaultRecord.decode(store.get(key))
    return out


def _first(records: dict[int, FaultRecord]) -> FaultRecord | None:
    """The failure that came first: the earliest local one, else the earliest of all."""
    local = [r for r in records.values() if r.local]
    pool = local or list(records.values())
    return min(pool, key=lambda r: r.seq) if pool else None


_PEER_SIGNS = ("peer", "remote", "connection", "broken pipe", "socket", "eof", "timed out", "timeout", "abort",
               "nccl", "not been initialized", "not registered")


def _peer_failure(error: str) -> bool:
    """Whether an error raised by a collective may be the work of a peer that left (a closed
    connection, a timeout, an aborted communicator); any other error (a failed allocation, a
    bad argument) arose on this rank, which is then named as the one that failed."""
    text = error.lower()
    return any(sign in text for sign in _PEER_SIGNS)


_GROUP_DESTROYED = ("; this rank's process group is destroyed (a failed plan tears it down, so that no peer waits on "
                   "it): initialize it again (torch.distributed.init_process_group) before the next execute")


def report_failure(rank: int, where: str, error: str, local: bool, exc: BaseException | None = None,
                   grace_s: float | None = None) -> str:
    """Publish this rank's failure, abort its process groups, and describe the failure that came first.

    ``local``: the error arose on this rank for sure (a compute step, not a collective that may
    have broken because a peer left). A peer's record is waited for at most ``grace_s`` seconds (env
    ``TP_FUSION_FAULT_GRACE_S``, default 3). Returns the text for this rank's ExecutionError, which
    ends saying that the process group is gone (``_GROUP_DESTROYED``).
    """
    return _first_failure(rank, where, error, local, exc, grace_s) + _GROUP_DESTROYED


def _first_failure(rank: int, where: str, error: str, local: bool, exc: BaseException | None,
                   grace_s: float | None) -> str:
    """``report_failure`` but for the note that the process group is destroyed."""
    if grace_s is None:
        grace_s = float(os.environ.get("TP_FUSION_FAULT_GRACE_S", "3"))
    if not local and not _peer_failure(error):
        local = True  # raised in a collective, but not because a peer left: this rank's own failure
    world = dist.world_size()
    own_text = f"rank {rank} failed in {where}: {error}"
    global _store
    store = _store = dist.default_store() if dist.is_initialized() else _store
    if store is None or world <= 1:
        abort_process_groups(exc)
        return own_text
    unreachable = (f"{own_text} (the process group's store is unreachable: rank 0, which hosts it, most likely "
                   "exited or failed first)")
    old_timeout = store.timeout
    try:
        store.set_timeout(datetime.timedelta(seconds=max(grace_s, 1.0)))
        seq = store.add(f"{_FAULT_KEY}seq", 1)
        store.set(f"{_FAULT_KEY}{rank}", FaultRecord(rank, seq, local, where, error).encode())
    except Exception:
        _restore_timeout(store, old_timeout)
        store = None
    abort_process_groups(exc)
    if store is None:
        return unreachable
    records: dict[int, FaultRecord] = {}
    deadline = time.monotonic() + grace_s
    try:
        while True:
            records = _records(store, world)
            first = _first(records)
            if rank == 0:  # the store's host stays until every peer has read
                done = all(store.check([f"{_FAULT_KEY}read/{r}"]) for r in range(1, world))
            else:
                done = (first is not None and first.local) or len(records) == world
            if done or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        if rank != 0:
            store.set(f"{_FAULT_KEY}read/{rank}", "1")
    except Exception:  # the store's host (rank 0) is gone
        if not records:
            return unreachable
    finally:
        _restore_timeout(store, old_timeout)
    first = _first(records)
    if first is not None and (first.local or len(records) == world):
        if first.rank == rank:
            return own_text
        return f"{first.describe()} (seen from rank {rank}, which then {own_text.split(' ', 2)[2]})"
    missing = [r for r in range(world) if r not in records and r != rank]
    who = ", ".join(map(str, missing))
    return (f"rank(s) {who} stopped responding (process exited or hung; no failure report) while "
            f"rank {rank} was in {where}: {error}")


def _restore_timeout(store, timeout) -> None:
    """Give the user's store back its timeout (a local setting: it needs no reachable host)."""
    try:
        store.set_timeout(timeout)
    except Exception:
        pass
