"""Matmul+collective kernels whose communication overlaps the GEMMs (the executor's fused segments).

Every function computes exactly what a collective followed (or preceded) by ``F.linear`` computes,
split into one GEMM per group rank's chunk so that moving one chunk overlaps computing another:

- CUDA: pushes through torch's symmetric memory. A rank copies its chunk straight into each peer's
  receive slot (a copy-engine write over NVLink, no SMs taken from the GEMMs) and flags it ready; the
  peer waits for the flag, GEMMs the slot and flags it free again. Flags are written and waited on
  with CUDA stream memory operations (``cuStreamWriteValue32``/``cuStreamWaitValue32``), so no
  spinning barrier kernel competes with the GEMMs and the host never synchronizes. Each call bumps
  an epoch that all ranks agree on (they make the same calls in the same order), so flags never need
  resetting. Every rank starts with its local chunk and issues the same kernels in the same order.
- CPU (gloo): the same chunk order as a ring of send/recv (exact, for CI).
- Anything else, or a shape where ``decide`` measured the fused plan slower: one NCCL collective
  and one GEMM ("sequential").
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
import torch.nn.functional as F

from tp_fusion.runtime import dist, timing


def gelu_tanh(t: torch.Tensor) -> torch.Tensor:
    """tanh-approximated GELU. As ``allgather_linear``'s epilogue (with a bias) the CUDA path fuses it
    into each chunk's GEMM (cuBLASLt's GELU_BIAS epilogue, which is this tanh form: measured within
    6e-6 in fp32), so it costs no extra pass over the output and overlaps the transfers too."""
    return F.gelu(t, approximate="tanh")


@dataclasses.dataclass
class Tuning:
    """Knobs of the CUDA pipeline. Defaults from 2x H200 (benchmarks/tp_mlp.py): the alternatives
    (a second GEMM stream, GEMM stores straight into the peer's slot) measured within noise there;
    they stay for larger groups, where compute/compute overlap matters more."""

    ag_streams: int = 1          # 2: peers' chunks on a second compute stream (compute/compute overlap)
    rs_max_subchunks: int = 2    # GEMM+RS: split each destination's rows into up to this many pieces,
    rs_min_subchunk_rows: int = 1024  # each of at least this many rows
    rs_remote_store: bool = False  # GEMM+RS: the GEMM writes the peer's slot directly (no copy engine)


TUNING = Tuning()


# --------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------

def allgather_linear(x_local, weight, bias=None, *, gather_dim: int, pg, epilogue=None) -> torch.Tensor:
    """``epilogue(F.linear(cat(all group ranks' x_local, dim=gather_dim), weight, bias))``.

    ``gather_dim`` must not be the last dim of ``x_local``; ``epilogue`` is pointwise or None.
    """
    dim = _non_last_dim(gather_dim, x_local, "gather_dim")
    n = dist.group_size(pg) if dist.is_initialized() else 1
    x_rows = x_local.movedim(dim, 0)
    lead = x_rows.shape[:-1]
    x2 = x_rows.reshape(-1, x_rows.shape[-1]).contiguous()
    if n == 1:
        out = _linear(x2, weight, bias, epilogue)
    elif not x2.is_cuda:
        out = _ring_allgather_linear(x2, weight, bias, epilogue, pg)
    elif decide("allgather_linear", tuple(x2.shape), tuple(weight.shape), x2.dtype, pg) == "fused":
        out = _symm_allgather_linear(x2, weight, bias, epilogue, pg)
    else:
        gathered = x2.new_empty((n * x2.shape[0], x2.shape[1]))
        dist.all_gather(gathered, x2, pg)
        out = _linear(gathered, weight, bias, epilogue)
    return out.view(n * lead[0], *lead[1:], -1).movedim(0, dim).contiguous()


def linear_reduce_scatter(x, weight, *, scatter_dim: int, pg) -> torch.Tensor:
    """This rank's chunk along ``scatter_dim`` (not the last dim) of ``sum over ranks of F.linear(x, w)``."""
    dim = _non_last_dim(scatter_dim, x, "scatter_dim")
    n = dist.group_size(pg) if dist.is_initialized() else 1
    if x.shape[dim] % n:
        raise ValueError(f"linear_reduce_scatter: dim {dim} of x (size {x.shape[dim]}) does not divide "
                         f"into {n} ranks; pad it to a multiple of {n}")
    x_rows = x.movedim(dim, 0)
    lead = (x_rows.shape[0] // n, *x_rows.shape[1:-1])
    x3 = x_rows.reshape(n, -1, x_rows.shape[-1]).contiguous()  # [destination rank, rows, in]
    out = _linear_reduce_scatter_rows(x3, weight, pg)
    return out.view(*lead, -1).movedim(0, dim).contiguous()


def linear_allreduce(x, weight, *, pg) -> torch.Tensor:
    """``sum over group ranks of F.linear(x, weight)``: a fused GEMM+reduce_scatter over rows, then an
    allgather of the reduced rows (sequential GEMM + allreduce where the rows do not split evenly)."""
    n = dist.group_size(pg) if dist.is_initialized() else 1
    x2 = x.reshape(-1, x.shape[-1])
    rows = x2.shape[0]
    if n == 1:
        return F.linear(x, weight)
    if rows % n or (x.is_cuda and decide("linear_allreduce", tuple(x2.shape), tuple(weight.shape),
                                         x.dtype, pg) == "sequential"):
        out = F.linear(x, weight)
        dist.all_reduce(out, pg)
        return out
    mine = _linear_reduce_scatter_rows(x2.reshape(n, rows // n, -1).contiguous(), weight, pg)
    out = mine.new_empty((rows, mine.shape[-1]))
    dist.all_gather(out, mine, pg)
    return out.view(*x.shape[:-1], -1)


def decide(kind: str, x_shape, w_shape, dtype, pg) -> str:
    """"fused" or "sequential" for ``kind`` with an ``x`` of ``x_shape`` and a ``weight`` of ``w_shape``.

    ``kind`` is ``allgather_linear`` (``x`` = this rank's shard), ``linear_reduce_scatter`` or
    ``linear_allreduce`` (``x`` = the whole operand). On CUDA the first call for a signature times both
    plans on random data (gathered/scattered dim 0) and takes the max over the group's ranks, so that
    every rank chooses the same plan; it is collective: every rank of the group must make the same
    calls, as it does for the functions above. On the CPU it is always "fused", so CI exercises the
    decomposition.
    """
    if not torch.cuda.is_available() or dist.backend() != "nccl":
        return "fused"
    rows = (math.prod(x_shape[:-1]), x_shape[-1])
    return _decide_cuda(kind, rows, tuple(w_shape), dtype, dist.group_name(pg), pg)


# --------------------------------------------------------------------------------------------------
# Shared helpers
# --------------------------------------------------------------------------------------------------

def _non_last_dim(dim: int, t: torch.Tensor, name: str) -> int:
    if not -t.dim() <= dim < t.dim():
        raise ValueError(f"{name}={dim} is out of range for a {t.dim()}-D tensor of shape {tuple(t.shape)}")
    dim %= t.dim()
    if dim == t.dim() - 1:
        raise ValueError(f"{name}={dim} is the last (contracted) dim of shape {tuple(t.shape)}; "
                         "gather or scatter a leading dim instead")
    return dim


def _linear(x2, weight, bias, epilogue, out=None) -> torch.Tensor:
    """``epilogue(F.linear(x2, weight, bias))`` for a 2-D ``x2``, written into ``out`` if given."""
    wt = weight.t()
    if out is None:
        out = x2.new_empty((x2.shape[0], weight.shape[0]))
    if epilogue is gelu_tanh and bias is not None and x2.is_cuda and out.is_contiguous():
        torch._addmm_activation(bias, x2, wt, use_gelu=True, out=out)
        return out
    if bias is None:
        torch.mm(x2, wt, out=out)
    else:
        torch.addmm(bias, x2, wt, out=out)
    if epilogue is not None:
        out.copy_(epilogue(out))
    return out


def _linear_reduce_scatter_rows(x3, weight, pg) -> torch.Tensor:
    """Reduce-scatter of ``F.linear`` over the leading (destination rank) dim of ``x3``."""
    n = x3.shape[0]
    if n == 1:
        return F.linear(x3[0], weight)
    if not x3.is_cuda:
        return _ring_linear_reduce_scatter(x3, weight, pg)
    shape2 = (x3.shape[0] * x3.shape[1], x3.shape[2])
    if decide("linear_reduce_scatter", shape2, tuple(weight.shape), x3.dtype, pg) == "fused":
        return _symm_linear_reduce_scatter(x3, weight, pg)
    out = x3.new_empty((x3.shape[1], weight.shape[0]))
    dist.reduce_scatter(out, F.linear(x3.view(shape2), weight), pg)
    return out


# --------------------------------------------------------------------------------------------------
# CPU: rings of send/recv (gloo)
# --------------------------------------------------------------------------------------------------

def _ring_allgather_linear(x2, weight, bias, epilogue, pg) -> torch.Tensor:
    """Step s GEMMs the chunk of rank r-s (step 0: the local one) while passing it on to r+1."""
    n, r = dist.group_size(pg), dist.group_rank(pg)
    right, left = dist.global_rank(pg, (r + 1) % n), dist.global_rank(pg, (r - 1) % n)
    out = x2.new_empty((n, x2.shape[0], weight.shape[0]))
    chunk = x2
    for step in range(n):
        if step < n - 1:
            nxt = torch.empty_like(chunk)
            reqs = [dist.isend(chunk, right), dist.irecv(nxt, left)]
        _linear(chunk, weight, bias, epilogue, out=out[(r - step) % n])
        if step < n - 1:
            for req in reqs:
                req.wait()
            chunk = nxt
    return out.view(-1, weight.shape[0])


def _ring_linear_reduce_scatter(x3, weight, pg) -> torch.Tensor:
    """The partial sum for chunk j starts at rank j+1 and travels the ring, each rank adding its own
    partial (computed while the previous transfer is in flight), until it reaches rank j."""
    n, r = dist.group_size(pg), dist.group_rank(pg)
    right, left = dist.global_rank(pg, (r + 1) % n), dist.global_rank(pg, (r - 1) % n)
    sends, recv, recv_req = [], None, None
    for step in range(n - 1):
        partial = F.linear(x3[(r - step - 1) % n], weight)
        if recv_req is not None:
            recv_req.wait()
            partial += recv
        sends.append(dist.isend(partial, right))
        recv = torch.empty_like(partial)
        recv_req = dist.irecv(recv, left)
    mine = F.linear(x3[r], weight)
    recv_req.wait()
    mine += recv
    for req in sends:
        req.wait()
    return mine


# --------------------------------------------------------------------------------------------------
# CUDA: pushes into peers' symmetric-memory slots, flagged with stream memory operations
# --------------------------------------------------------------------------------------------------

_READY, _FREE = 0, 1


class _StreamFlags:
    """Waits and writes of 32-bit flags enqueued on a stream (``cuStream{Wait,Write}Value32``): the
    GPU's front end handles them, no kernel runs. A write is preceded by a memory fence, so whatever
    the stream wrote before (a GEMM's output, a copy) is visible to whoever sees the flag."""

    def __init__(self):
        try:
            from cuda.bindings import driver
        except ImportError:  # cuda-python < 12.6 names the module cuda.cuda
            from cuda import cuda as driver
        self._driver = driver
        self._geq = int(driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ)

    def _check(self, result, what):
        err = result[0]
        if int(err) != 0:
            raise RuntimeError(f"{what} failed: {err}")

    def wait(self, stream: torch.cuda.Stream, addr: int, value: int) -> None:
        """Work enqueued after this on ``stream`` waits until the flag at ``addr`` >= ``value``."""
        self._check(self._driver.cuStreamWaitValue32(stream.cuda_stream, addr, value & 0xFFFFFFFF,
                                                     self._geq), "cuStreamWaitValue32")

    def write(self, stream: torch.cuda.Stream, addr: int, value: int) -> None:
        """Once the work before it on ``stream`` is done, set the flag at ``addr`` (maybe a peer's)."""
        self._check(self._driver.cuStreamWriteValue32(stream.cuda_stream, addr, value & 0xFFFFFFFF, 0),
                    "cuStreamWriteValue32")


@functools.cache
def _flags() -> _StreamFlags | None:
    try:
        return _StreamFlags()
    except ImportError:
        return None


@functools.cache
def _comm_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream that issues the copy-engine pushes (high priority: they are tiny to launch)."""
    return torch.cuda.Stream(device, priority=-1)


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """A second compute stream, for compute/compute overlap."""
    return torch.cuda.Stream(device)


class _Mailbox:
    """Receive slots for one (kind, slot shape, dtype, group): ``slots[src, sub]`` in symmetric memory
    holds what group rank ``src`` pushed here; ``flags[READY, src, sub]`` is the epoch of src's last
    push into it, ``flags[FREE, dst, sub]`` the epoch up to which rank ``dst`` is done with the slot
    that this rank pushes into there. Both are written by the peers, through their mappings."""

    def __init__(self, slot_shape, dtype, subchunks: int, pg, device):
        n = dist.group_size(pg)
        self.rank, self.n, self.epoch = dist.group_rank(pg), n, 0
        self.slots = dist.symm_empty((n, *slot_shape), dtype, device)
        flags = dist.symm_empty((2, n, subchunks), torch.int32, device)
        flags.zero_()
        slots_handle = dist.symm_rendezvous(self.slots, pg)
        flags_handle = dist.symm_rendezvous(flags, pg)
        self.flags = flags
        # What this rank pushes to peer p lands in p's slots[rank]; what it flags, in p's flags.
        self.peer_slots = [dist.symm_peer_tensor(slots_handle, p, self.slots)[self.rank] for p in range(n)]
        self.peer_flags = [dist.symm_peer_tensor(flags_handle, p, flags) for p in range(n)]
        torch.cuda.synchronize(device)
        dist.barrier(pg)  # every rank's flags are zero before anyone writes them

    @staticmethod
    def addr(t: torch.Tensor) -> int:
        return t.data_ptr()

    def start_call(self) -> int:
        self.epoch += 1
        return self.epoch


_mailboxes: dict[tuple, _Mailbox] = {}


def _mailbox(kind: str, slot_shape, dtype, subchunks: int, pg, device) -> _Mailbox:
    key = (kind, tuple(slot_shape), dtype, subchunks, dist.group_name(pg), device)
    if key not in _mailboxes:
        _mailboxes[key] = _Mailbox(slot_shape, dtype, subchunks, pg, device)
    return _mailboxes[key]


def _symm_allgather_linear(x2, weight, bias, epilogue, pg) -> torch.Tensor:
    """Rank r pushes its rows to r-1, r-2, ... on the comm stream while it GEMMs its own rows, then
    GEMMs the rows of r+1, r+2, ... in that order, each as soon as its ready flag is set."""
    flags, device = _flags(), x2.device
    box = _mailbox("allgather_linear", x2.shape, x2.dtype, 1, pg, device)
    n, r, epoch = box.n, box.rank, box.start_call()
    main, comm = torch.cuda.current_stream(device), _comm_stream(device)
    out = x2.new_empty((n, x2.shape[0], weight.shape[0]))
    comm.wait_stream(main)
    with torch.cuda.stream(comm):
        for step in range(1, n):
            dst = (r - step) % n
            flags.wait(comm, box.addr(box.flags[_FREE, dst, 0]), epoch - 1)
            box.peer_slots[dst].copy_(x2)
            flags.write(comm, box.addr(box.peer_flags[dst][_READY, r, 0]), epoch)
    side = _side_stream(device) if TUNING.ag_streams == 2 else main
    if side is not main:
        side.wait_stream(main)
    _linear(x2, weight, bias, epilogue, out=out[r])
    for step in range(1, n):
        src = (r + step) % n
        stream = side if step % 2 else main
        with torch.cuda.stream(stream):
            flags.wait(stream, box.addr(box.flags[_READY, src, 0]), epoch)
            _linear(box.slots[src], weight, bias, epilogue, out=out[src])
            flags.write(stream, box.addr(box.peer_flags[src][_FREE, r, 0]), epoch)
    main.wait_stream(comm)
    if side is not main:
        main.wait_stream(side)
    return out.view(-1, weight.shape[0])


def _subchunks(rows: int) -> int:
    """Pieces per destination: pushing piece k overlaps the GEMM of piece k+1 (and the last push the
    first local GEMM), at the price of smaller GEMMs."""
    fits = [c for c in range(1, TUNING.rs_max_subchunks + 1)
            if rows % c == 0 and rows // c >= TUNING.rs_min_subchunk_rows]
    return max(fits, default=1)


def _symm_linear_reduce_scatter(x3, weight, pg) -> torch.Tensor:
    """Rank r GEMMs the partial for r+1, r+2, ... (rows split in ``c`` sub-chunks) and pushes each
    into that rank's slot; then, per sub-chunk, waits for the partials pushed to it and adds them in
    the epilogue of its own GEMM (``addmm`` with the received partial as C; a sum for > 2 ranks)."""
    flags, device = _flags(), x3.device
    n_dst, rows, _ = x3.shape
    out_cols = weight.shape[0]
    c = _subchunks(rows)
    sub = rows // c
    box = _mailbox("linear_reduce_scatter", (c, sub, out_cols), x3.dtype, c, pg, device)
    n, r, epoch = box.n, box.rank, box.start_call()
    main, comm = torch.cuda.current_stream(device), _comm_stream(device)
    wt = weight.t()
    xs = x3.view(n, c, sub, -1)
    remote = TUNING.rs_remote_store
    staging = None if remote else x3.new_empty((max(n - 1, 1), c, sub, out_cols))
    for step in range(1, n):
        dst = (r + step) % n
        for k in range(c):
            free = box.addr(box.flags[_FREE, dst, k])
            ready = box.addr(box.peer_flags[dst][_READY, r, k])
            if remote:
                flags.wait(main, free, epoch - 1)
                torch.mm(xs[dst, k], wt, out=box.peer_slots[dst][k])
                flags.write(main, ready, epoch)
                continue
            torch.mm(xs[dst, k], wt, out=staging[step - 1, k])
            comm.wait_stream(main)
            with torch.cuda.stream(comm):
                flags.wait(comm, free, epoch - 1)
                box.peer_slots[dst][k].copy_(staging[step - 1, k])
                flags.write(comm, ready, epoch)
    out = x3.new_empty((c, sub, out_cols))
    for k in range(c):
        for step in range(1, n):
            flags.wait(main, box.addr(box.flags[_READY, (r - step) % n, k]), epoch)
        if n == 2:
            torch.addmm(box.slots[(r - 1) % n, k], xs[r, k], wt, out=out[k])
        else:
            torch.mm(xs[r, k], wt, out=box.slots[r, k])  # own slot: never pushed into
            torch.sum(box.slots[:, k], dim=0, out=out[k])
        for step in range(1, n):
            src = (r - step) % n
            flags.write(main, box.addr(box.peer_flags[src][_FREE, r, k]), epoch)
    main.wait_stream(comm)
    return out.view(rows, out_cols)


# --------------------------------------------------------------------------------------------------
# Choosing fused vs sequential from measured times
# --------------------------------------------------------------------------------------------------

_decisions: dict[tuple, str] = {}


def _decide_cuda(kind, x_shape, w_shape, dtype, name, pg) -> str:
    key = (kind, x_shape, w_shape, dtype, name)
    if key in _decisions:
        return _decisions[key]
    if _flags() is None:
        _decisions[key] = "sequential"
        return "sequential"
    n = dist.group_size(pg)
    if kind != "allgather_linear" and x_shape[0] % n:
        return "sequential"  # the rows do not split over the ranks: nothing to pipeline
    device = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device).manual_seed(0)
    x = torch.randn(x_shape, dtype=dtype, device=device, generator=gen)
    w = torch.randn(w_shape, dtype=dtype, device=device, generator=gen) / math.sqrt(w_shape[-1])
    rows = x_shape[0]
    if kind == "allgather_linear":
        gathered = x.new_empty((n * rows, x_shape[1]))

        def fused():
            _symm_allgather_linear(x, w, None, None, pg)

        def sequential():
            dist.all_gather(gathered, x, pg)
            F.linear(gathered, w)
    elif kind == "linear_reduce_scatter":
        out = x.new_empty((rows // n, w_shape[0]))

        def fused():
            _symm_linear_reduce_scatter(x.view(n, rows // n, -1), w, pg)

        def sequential():
            dist.reduce_scatter(out, F.linear(x, w), pg)
    elif kind == "linear_allreduce":
        full = x.new_empty((rows, w_shape[0]))

        def fused():
            dist.all_gather(full, _symm_linear_reduce_scatter(x.view(n, rows // n, -1), w, pg), pg)

        def sequential():
            dist.all_reduce(F.linear(x, w), pg)
    else:
        raise ValueError(f"decide: unknown kind {kind!r}; expected allgather_linear, "
                         "linear_reduce_scatter or linear_allreduce")
    fused_ms, sequential_ms = timing.slowest([timing.time_ms(fused, 5, 2), timing.time_ms(sequential, 5, 2)],
                                             pg, device)
    _decisions[key] = "fused" if fused_ms <= sequential_ms else "sequential"
    return _decisions[key]
