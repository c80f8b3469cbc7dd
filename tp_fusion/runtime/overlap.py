"""Matmul+collective kernels whose communication overlaps the GEMMs (the executor's fused segments).

Each public function computes exactly what a collective followed (or preceded) by ``F.linear``
computes, in one of two modes that the caller chooses:

- ``"fused"``: split into one GEMM per group rank's chunk so that moving one chunk overlaps computing
  another. On CUDA through symmetric memory (``symm.py``): a rank copies its chunk straight into each
  peer's receive slot (a copy-engine write over NVLink, no SMs taken from the GEMMs) and flags it
  ready with a stream memory operation; the peer's stream waits on the flag and consumes the slot
  (``symm.Mailbox`` says why no "free" flag is needed, and how the flags let a plan replay as CUDA
  graphs). On the CPU (gloo) the same kernels run over send/recv (``symm.HostMailbox``), so CI
  checks the decomposition the GPUs run, every ``Tuning`` of it included.
- ``"sequential"``: one collective and one GEMM.

Every rank issues the same kernels in the same order and starts with its local chunk; nothing
assumes two ranks. Knobs of the CUDA pipelines are explicit (``Tuning``). The mode and the knobs are
the caller's: ``tp_fusion.runtime.tuning`` measures both modes and a few variants of the knobs once per
program and records the choice.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.nn.functional as F

from tp_fusion.program import FUSED, SEQUENTIAL
from tp_fusion.runtime import cublaslt, dist, symm

MODES = (FUSED, SEQUENTIAL)


def gelu_tanh(t: torch.Tensor) -> torch.Tensor:
    """tanh-approximated GELU. As ``allgather_linear``'s epilogue (with a bias) the CUDA path fuses it
    into each chunk's GEMM (cuBLASLt's GELU_BIAS epilogue, which is this tanh form: measured within
    6e-6 in fp32), so it costs no extra pass over the output and overlaps the transfers too."""
    return F.gelu(t, approximate="tanh")


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Knobs of the fused pipelines (streams are CUDA's; on the CPU the rest shape the same
    decomposition). Defaults: the best measured on 2x H200 (docs/performance.md says what each
    alternative measured); every combination computes the same result."""

    ag_streams: int = 1  # AG+GEMM: 2 puts every other peer chunk's GEMM on a second stream, so that
    #                      the tail wave of one GEMM overlaps the next: faster in short timings, within
    #                      the noise (+-3%) of one stream in the MLP's steady state (2x H200, round 11)
    ag_gemm: str = "chunks"  # "chunks": one cuBLAS GEMM per rank's chunk (bias+GELU in its epilogue);
    #                          "async_input": one CUTLASS GEMM over all chunks that waits per tile on
    #                          chunk signals (torch's _async_input_mm: bf16, rows % 128; epilogue apart)
    rs_reduce: str = "sum"  # GEMM+RS: "sum": every rank pushes its partial straight to the chunk's
    #                         owner, whose own-rows GEMM waits for nothing, then one pass adds the
    #                         received partials; "ring": each chunk's partial travels the ring, every
    #                         GEMM reading what arrived as its C operand (cuBLASLt: no pass at all;
    #                         wants rs_subchunks >= 2, else a step waits for a whole push). Either
    #                         way the bias rides in a peer's partial
    rs_subchunks: int = 1  # GEMM+RS: pieces per destination (a push of piece k overlaps GEMM k+1)
    rs_remote_store: bool = False  # GEMM+RS: the partial GEMM writes into the peer's slot (no copy engine)
    rs_streams: int = 1  # GEMM+RS and GEMM+AR ("sum"): 2 runs the GEMM of this rank's own rows on a
    #                      second stream, issued after the peers' partials, to fill their tail wave
    #                      (measured 2% slower on 2x H200: the two GEMMs contend and delay the pushes)
    ar_subchunks: int = 2  # GEMM+AR: row pieces per reducing rank (sums of piece k travel during k+1)
    gelu_in_gemm: bool = True  # bias + tanh-GELU in the cuBLASLt epilogue, or the GELU as a pass apart:
    #                            the epilogue kernel is slower on some shapes (3072x12288x49152: 2.5%),
    #                            so tuning measures both
    ag_split_rows: int = 0  # AG+GEMM ("chunks"): own rows that the first GEMM leaves to the second, which
    #                         takes them with the first peer's chunk (``_own_split``): GEMMs of other
    #                         sizes than the chunks' can waste less of their last wave of tiles
    rs_split_rows: int = 0  # GEMM+RS ("sum", one piece, staged pushes): own rows that the first GEMM (the
    #                         first peer's partial) takes along; every rank then adds the bias to its own rows

    def __post_init__(self):
        if self.ag_streams not in (1, 2) or self.rs_streams not in (1, 2) \
                or self.ag_gemm not in ("chunks", "async_input") \
                or self.rs_reduce not in ("sum", "ring") or self.rs_subchunks < 1 or self.ar_subchunks < 1 \
                or self.ag_split_rows < 0 or self.rs_split_rows < 0:
            raise ValueError(f"invalid {self}: ag_streams and rs_streams are 1 or 2, ag_gemm 'chunks' or "
                             "'async_input', rs_reduce 'sum' or 'ring', sub-chunk counts >= 1, split rows >= 0")
        if self.ag_split_rows and self.ag_gemm != "chunks":
            raise ValueError(f"invalid {self}: ag_split_rows splits the chunks of ag_gemm='chunks'")
        if self.rs_split_rows and (self.rs_reduce != "sum" or self.rs_subchunks != 1 or self.rs_remote_store):
            raise ValueError(f"invalid {self}: rs_split_rows needs rs_reduce='sum', rs_subchunks=1 and "
                             "rs_remote_store=False")


DEFAULT_TUNING = Tuning()


# --------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------

def allgather_linear(x_local, weight, bias=None, *, gather_dim: int, pg, epilogue=None, mode: str,
                     tuning: Tuning | None = None) -> torch.Tensor:
    """``epilogue(F.linear(cat(all group ranks' x_local, dim=gather_dim), weight, bias))``.

    ``gather_dim`` must not be the last dim of ``x_local``; ``epilogue`` is pointwise or None.
    """
    dim = _non_last_dim(gather_dim, x_local, "gather_dim")
    n = _group_size(pg)
    x_rows = x_local if dim == 0 else x_local.movedim(dim, 0)
    lead = x_rows.shape[:-1]
    x2 = x_rows.reshape(-1, x_rows.shape[-1]).contiguous()
    tuning = tuning or DEFAULT_TUNING
    if n == 1:
        out = _linear(x2, weight, bias, epilogue, gelu_in_gemm=tuning.gelu_in_gemm)
    else:
        mode = _resolve("allgather_linear", mode, x2, weight, bias, epilogue, pg, tuning)
        with _label(f"tp_fusion::allgather_linear[{mode}]"):
            if mode == SEQUENTIAL:
                gathered = x2.new_empty((n * x2.shape[0], x2.shape[1]))
                dist.all_gather(gathered, x2, pg)
                out = _linear(gathered, weight, bias, epilogue, gelu_in_gemm=tuning.gelu_in_gemm)
            else:
                out = _pushed_allgather_linear(x2, weight, bias, epilogue, pg, tuning)
    out = out.view(n * lead[0], *lead[1:], -1)
    return out if dim == 0 else out.movedim(0, dim).contiguous()


def linear_reduce_scatter(x, weight, bias=None, *, residual=None, scatter_dim: int, pg, mode: str,
                          tuning: Tuning | None = None) -> torch.Tensor:
    """This rank's chunk along ``scatter_dim`` (not the last dim) of ``sum over ranks of F.linear(x, w)``,
    plus ``bias`` (added once), plus ``residual`` (a tensor of the result's shape: a residual stream
    added in a GEMM, as its C operand, instead of in a pass of its own)."""
    dim = _non_last_dim(scatter_dim, x, "scatter_dim")
    n = _group_size(pg)
    if x.shape[dim] % n:
        raise ValueError(f"linear_reduce_scatter: dim {dim} of x (size {x.shape[dim]}) does not divide "
                         f"into {n} ranks; pad it to a multiple of {n}")
    x_rows = x if dim == 0 else x.movedim(dim, 0)
    lead = (x_rows.shape[0] // n, *x_rows.shape[1:-1])
    x3 = x_rows.reshape(n, -1, x_rows.shape[-1]).contiguous()  # [destination rank, rows, in]
    res = _residual_rows("linear_reduce_scatter", residual, dim,
                         (*x.shape[:dim], x.shape[dim] // n, *x.shape[dim + 1:-1], weight.shape[0]))
    tuning = tuning or DEFAULT_TUNING
    if n == 1:
        out = _linear(x3[0], weight, bias, None, residual=res)
    else:
        mode = _resolve("linear_reduce_scatter", mode, x3.view(-1, x3.shape[-1]), weight, bias, None, pg, tuning)
        with _label(f"tp_fusion::linear_reduce_scatter[{mode}]"):
            out = _linear_reduce_scatter_rows(x3, weight, bias, res, pg, mode, tuning)
    out = out.view(*lead, -1)
    return out if dim == 0 else out.movedim(0, dim).contiguous()


def linear_allreduce(x, weight, bias=None, *, residual=None, pg, mode: str,
                     tuning: Tuning | None = None) -> torch.Tensor:
    """``sum over group ranks of F.linear(x, weight)``, plus ``bias`` (added once), plus ``residual`` (as
    in ``linear_reduce_scatter``). Fused: each rank reduces its share of the rows (GEMM+reduce_scatter)
    and sends the sums on to every peer while the next rows are computed; this needs rows that split
    evenly over the ranks."""
    n = _group_size(pg)
    x2 = x.reshape(-1, x.shape[-1])
    rows = x2.shape[0]
    res = _residual_rows("linear_allreduce", residual, 0, (*x.shape[:-1], weight.shape[0]))
    tuning = tuning or DEFAULT_TUNING
    if n == 1:
        out = _linear(x2, weight, bias, None, residual=res)
        return out.view(*x.shape[:-1], -1)
    mode = _resolve("linear_allreduce", mode, x2, weight, bias, None, pg, tuning)
    if mode == FUSED and rows % n:
        raise ValueError(f"linear_allreduce(mode='fused'): the {rows} rows of x do not split evenly over "
                         f"{n} ranks; use mode='sequential' or pad the rows to a multiple of {n}")
    with _label(f"tp_fusion::linear_allreduce[{mode}]"):
        if mode == SEQUENTIAL:
            r = dist.group_rank(pg)  # the bias rides in rank 0's GEMM, the residual in the last rank's
            out = _linear(x2, weight, bias if r == 0 else None, None, residual=res if r == n - 1 else None)
            dist.all_reduce(out, pg)
        else:
            out = _pushed_linear_allreduce(x2.contiguous(), weight, bias, res, pg, tuning)
    return out.view(*x.shape[:-1], -1)


def linear(x, weight, bias=None, epilogue=None, gelu_in_gemm: bool = True) -> torch.Tensor:
    """``epilogue(F.linear(x, weight, bias))`` with no collective: one GEMM whose epilogue adds the bias
    and, on CUDA with ``gelu_in_gemm``, applies a tanh-GELU epilogue (``gelu_tanh``) too."""
    out = _linear(x.reshape(-1, x.shape[-1]), weight, bias, epilogue, gelu_in_gemm=gelu_in_gemm)
    return out.view(*x.shape[:-1], out.shape[-1])


# --------------------------------------------------------------------------------------------------
# Shared helpers
# --------------------------------------------------------------------------------------------------

def _group_size(pg) -> int:
    return dist.group_size(pg) if dist.is_initialized() else 1


def _label(name: str):
    """A ``record_function`` span for profiles (nothing when no profiler runs)."""
    return torch.profiler.record_function(name) if torch._C._autograd._profiler_enabled() \
        else contextlib.nullcontext()


def _resolve(kind, mode, x2, weight, bias, epilogue, pg, tuning) -> str:
    if mode not in MODES:
        raise ValueError(f"{kind}: mode={mode!r}; expected one of {MODES}")
    if mode == FUSED and x2.is_cuda and symm.driver() is None:
        raise RuntimeError(f"{kind}(mode='fused') on CUDA needs the CUDA driver library (libcuda.so.1) for "
                           "its stream flags; use mode='sequential'")
    return mode


def _non_last_dim(dim: int, t: torch.Tensor, name: str) -> int:
    if not -t.dim() <= dim < t.dim():
        raise ValueError(f"{name}={dim} is out of range for a {t.dim()}-D tensor of shape {tuple(t.shape)}")
    dim %= t.dim()
    if dim == t.dim() - 1:
        raise ValueError(f"{name}={dim} is the last (contracted) dim of shape {tuple(t.shape)}; "
                         "gather or scatter a leading dim instead")
    return dim


def _residual_rows(kind: str, residual, dim: int, shape: tuple) -> torch.Tensor | None:
    """``residual`` (of the result's ``shape``, its rows along ``dim``) as a contiguous 2-D [rows, out]."""
    if residual is None:
        return None
    if tuple(residual.shape) != tuple(shape):
        raise ValueError(f"{kind}: residual of shape {tuple(residual.shape)}; the result's shape is {tuple(shape)}")
    rows = residual if dim == 0 else residual.movedim(dim, 0)
    return rows.reshape(-1, shape[-1]).contiguous()


def _linear(x2, weight, bias, epilogue, out=None, gelu_in_gemm: bool = True, residual=None) -> torch.Tensor:
    """``epilogue(F.linear(x2, weight, bias))`` for a 2-D ``x2`` (plus ``residual``, when there is no
    epilogue), written into ``out`` if given. The bias runs in the GEMM's epilogue; on CUDA with
    ``gelu_in_gemm`` a tanh-GELU after it too, else the GELU is one in-place pass. The residual is the
    GEMM's C operand (beta=1); the kernels give a GEMM the bias or the residual, not both, as a bias
    then takes a pass of its own."""
    wt = weight.t()
    if out is None:
        out = x2.new_empty((x2.shape[0], weight.shape[0]))
    if residual is not None:
        torch.addmm(residual, x2, wt, out=out)
        if bias is not None:
            out.add_(bias)
        return out
    if epilogue is gelu_tanh and gelu_in_gemm and bias is not None and x2.is_cuda and out.is_contiguous():
        torch._addmm_activation(bias, x2, wt, use_gelu=True, out=out)
        return out
    if bias is None:
        torch.mm(x2, wt, out=out)
    else:
        torch.addmm(bias, x2, wt, out=out)
    if epilogue is gelu_tanh:
        torch.ops.aten.gelu_(out, approximate="tanh")
    elif epilogue is not None:
        out.copy_(epilogue(out))
    return out


def _linear_reduce_scatter_rows(x3, weight, bias, residual, pg, mode, tuning) -> torch.Tensor:
    """Reduce-scatter of ``F.linear`` over the leading (destination rank) dim of ``x3``, plus ``bias``,
    plus ``residual`` (this rank's rows)."""
    if mode == FUSED:
        kernel = _ring_linear_reduce_scatter if tuning.rs_reduce == "ring" else _pushed_linear_reduce_scatter
        return kernel(x3, weight, bias, residual, pg, tuning)
    out = x3.new_empty((x3.shape[1], weight.shape[0]))
    # The bias rides in one rank's GEMM epilogue, so the reduction adds it once.
    partial = F.linear(x3.view(-1, x3.shape[2]), weight, bias if dist.group_rank(pg) == 0 else None)
    dist.reduce_scatter(out, partial, pg)
    return out if residual is None else out.add_(residual)


# --------------------------------------------------------------------------------------------------
# Pushes into peers' slots: symmetric memory and stream flags on CUDA, send/recv on the CPU
# --------------------------------------------------------------------------------------------------

def _on(stream: torch.cuda.Stream | None, main: torch.cuda.Stream | None):
    """``torch.cuda.stream(stream)``, skipped when it is the current stream already (host time; on the
    CPU both are None)."""
    return contextlib.nullcontext() if stream is main else torch.cuda.stream(stream)


def _pushed_allgather_linear(x2, weight, bias, epilogue, pg, tuning) -> torch.Tensor:
    """Rank r GEMMs its own rows while the comm stream pushes them to r-1, r-2, ...; then it GEMMs the
    rows of r+1, r+2, ... in that order, each as soon as its ready flag is set (every other one on a
    second stream with ``ag_streams=2``, so that one GEMM's tail wave overlaps the next). With
    ``ag_split_rows``, some own rows move into the GEMM of r+1's (``_own_split``)."""
    if tuning.ag_gemm == "async_input":
        return _async_input_allgather_linear(x2, weight, bias, epilogue, pg)
    device = x2.device
    box = symm.mailbox("allgather_linear", 1, x2.shape, x2.dtype, pg, device)
    box.start_call()
    n, r = box.n, box.rank
    main, comm = symm.current_stream(device), symm.comm_stream(device)
    side = symm.side_stream(device) if tuning.ag_streams == 2 else main  # step 1's GEMM runs on side
    m = x2.shape[0]
    out = x2.new_empty((n * m, weight.shape[0]))
    gathered = box.slots_of_part(0).view(n * m, -1)  # rank src's rows at src * m: slot(src, 0)

    def gemm(rows: slice, x: torch.Tensor) -> None:
        _linear(x, weight, bias, epilogue, out=out[rows], gelu_in_gemm=tuning.gelu_in_gemm)

    symm.stream_wait(comm, main)  # x2 is written, and this rank's reads of the last call are issued
    if side is not main:
        symm.stream_wait(side, main)
    # The local GEMM is issued before the pushes, so the GPU starts computing at once.
    split = _own_split(r, n, m, tuning.ag_split_rows)
    if split is None:
        gemm(slice(r * m, (r + 1) * m), x2)
    else:  # the own rows that join the first peer's chunk are copied beside it (copy engine)
        lead, shared, joined = split
        gemm(_shift(lead, r * m), x2[lead])
        symm.copy(comm, gathered[_shift(shared, r * m)], x2[shared])
        symm.stream_wait(side, comm)
    for step in range(1, n):
        box.push(comm, (r - step) % n, 0, x2)
    for step in range(1, n):
        src = (r + step) % n
        stream = side if step % 2 else main
        box.wait_ready(stream, src, 0)
        rows = joined if step == 1 and split is not None else slice(src * m, (src + 1) * m)
        with _on(stream, main):
            gemm(rows, gathered[rows])
    symm.stream_wait(main, comm)
    box.end_call()
    if side is not main:
        symm.stream_wait(main, side)
    return out


def _async_input_allgather_linear(x2, weight, bias, epilogue, pg) -> torch.Tensor:
    """One GEMM over the gathered rows that waits per tile on each chunk's signal (torch's CUTLASS
    ``_async_input_mm``, starting at this rank's chunk), so there are no chunk boundaries. Peers push
    their rows straight into this rank's gathered buffer; the comm stream turns each peer's ready flag
    into the kernel's 0/1 signal. Bias and epilogue follow as separate passes. (The peers' copies run on
    copy engines: the spinning GEMM holds the SMs.)"""
    if not x2.is_cuda or x2.dtype != torch.bfloat16 or x2.shape[0] % 128 or weight.dtype != torch.bfloat16:
        raise ValueError(f"Tuning(ag_gemm='async_input') needs bf16 CUDA operands and a multiple of 128 rows "
                         f"per rank (got {x2.dtype} x of {tuple(x2.shape)} on {x2.device.type}); use "
                         "ag_gemm='chunks'")
    device = x2.device
    symm._symm_mem()  # registers torch.ops.symm_mem
    box = symm.mailbox("allgather_linear.async_input", 1, x2.shape, x2.dtype, pg, device)
    box.start_call()
    n, r, driver = box.n, box.rank, symm.driver()
    main, comm = symm.current_stream(device), symm.comm_stream(device)
    signals = torch.zeros(n, dtype=torch.int32, device=device)
    symm.stream_wait(comm, main)
    box.slot(r, 0).copy_(x2)  # on the compute stream, ahead of the GEMM that spins on its signal
    driver.write(main, signals.data_ptr() + 4 * r, 1)
    for step in range(1, n):
        box.push(comm, (r - step) % n, 0, x2)
    for step in range(1, n):
        src = (r + step) % n
        box.wait_ready(comm, src, 0)
        driver.write(comm, signals.data_ptr() + 4 * src, 1)
    gathered = box.slots_of_part(0).view(n * x2.shape[0], x2.shape[1])
    out = torch.ops.symm_mem._async_input_mm(gathered, weight.t(), signals.view(torch.uint32), r)
    symm.stream_wait(main, comm)
    if bias is not None:
        out.add_(bias)
    if epilogue is gelu_tanh:
        torch.ops.aten.gelu_(out, approximate="tanh")
    elif epilogue is not None:
        out.copy_(epilogue(out))
    return out


@dataclasses.dataclass(frozen=True)
class _ReduceScatterCall:
    """What both reduce_scatter pipelines set up for a call: this call's mailbox (``pieces`` pieces
    per destination rank), the input by destination and piece, the staging buffers the pushes read
    (None with ``rs_remote_store``: the GEMMs write into the peers' slots), the output and the
    residual by piece, and the compute and copy streams."""

    box: symm.Mailbox
    pieces: int
    xs: torch.Tensor  # [n, pieces, sub, in]
    staging: torch.Tensor | None  # [n - 1, pieces, sub, out]
    out: torch.Tensor  # [pieces, sub, out]
    res: torch.Tensor | None  # [pieces, sub, out]
    main: torch.cuda.Stream | None  # None on the CPU
    comm: torch.cuda.Stream | None


def _reduce_scatter_call(kind: str, x3, weight, residual, pg, tuning, staged_steps=None) -> _ReduceScatterCall:
    """``staged_steps``: how many steps push from ``staging`` (default: all n - 1)."""
    rows, out_cols = x3.shape[1], weight.shape[0]
    c = tuning.rs_subchunks if rows % tuning.rs_subchunks == 0 else 1
    sub = rows // c
    box = symm.mailbox(kind, c, (sub, out_cols), x3.dtype, pg, x3.device)
    box.start_call()
    main, comm = symm.current_stream(x3.device), symm.comm_stream(x3.device)
    symm.stream_wait(comm, main)  # forks comm from main even where no push follows (a capture joins it)
    staged = box.n - 1 if staged_steps is None else staged_steps
    return _ReduceScatterCall(
        box, c, x3.view(box.n, c, sub, -1),
        None if tuning.rs_remote_store else x3.new_empty((staged, c, sub, out_cols)),
        x3.new_empty((c, sub, out_cols)), None if residual is None else residual.view(c, sub, out_cols),
        main, comm)


def _pushed_linear_reduce_scatter(x3, weight, bias, residual, pg, tuning) -> torch.Tensor:
    """Rank r GEMMs the partial for r+1, r+2, ... (the bias in the one for r+1) and pushes each into
    that rank's slot (or stores it there from the GEMM); then it GEMMs its own rows (onto the residual,
    on a second stream with ``rs_streams=2``) without waiting, and adds the received partials in one
    pass (``rs_reduce="sum"``; "ring" is ``_ring_linear_reduce_scatter``). With ``rs_split_rows``, the
    GEMM of r+1's partial takes some own rows along (``_own_split``), and every rank adds the bias to
    its own rows instead."""
    n, r, m = dist.group_size(pg), dist.group_rank(pg), x3.shape[1]
    split = _own_split(r, n, m, tuning.rs_split_rows)
    # A split's first step pushes from the joined GEMM's own output, not from staging.
    call = _reduce_scatter_call("linear_reduce_scatter", x3, weight, residual, pg, tuning,
                                staged_steps=n - 1 - (split is not None))
    box, main, comm, staging = call.box, call.main, call.comm, call.staging
    side = symm.side_stream(x3.device) if tuning.rs_streams == 2 else main
    if side is not main:
        symm.stream_wait(side, main)  # the inputs are ready; the own-rows GEMM needs nothing else
    done = None  # (own rows, their partial) from the joined GEMM
    for step in range(1, n):
        dst = (r + step) % n
        # The bias is added once: in the partial from rank dst-1, or with split rows by dst itself.
        b = bias if step == 1 and not tuning.rs_split_rows else None
        for k in range(call.pieces):
            if staging is None:
                _linear(call.xs[dst, k], weight, b, None, out=box.peer_slot(dst, k))
                box.mark_ready(main, dst, k)
                continue
            if step == 1 and split is not None:
                _, shared, joined = split
                partial = x3.new_empty((joined.stop - joined.start, weight.shape[0]))
                _linear(x3.view(n * m, -1)[joined], weight, None, None, out=partial)
                mine = _shift(shared, r * m - joined.start)
                theirs = _shift(slice(dst * m, (dst + 1) * m), -joined.start)
                done, piece = (shared, partial[mine]), partial[theirs]
            else:
                piece = staging[step - 1 - (split is not None), k]
                _linear(call.xs[dst, k], weight, b, None, out=piece)
            symm.stream_wait(comm, main)
            box.push(comm, dst, k, piece)
    own_bias = bias if tuning.rs_split_rows else None
    for k in range(call.pieces):
        _reduce_part(box, k, call.xs[r, k], weight, None if call.res is None else call.res[k], side, main,
                     call.out[k], bias=own_bias, done=done)
    symm.stream_wait(main, comm)
    box.end_call()
    return call.out.view(-1, weight.shape[0])


def _ring_linear_reduce_scatter(x3, weight, bias, residual, pg, tuning) -> torch.Tensor:
    """The reduce_scatter as a ring: the partial for chunk j starts at rank j+1 (with the bias) and
    travels right, each rank's GEMM reading what arrived as its C operand and writing the sum it
    passes on (``cublaslt.addmm_into``: no pass adds it), until rank j's GEMM of its own rows writes
    the result (a residual is added to what arrived first). Each step runs in ``rs_subchunks``
    pieces, so that the push of piece k overlaps the GEMM of piece k+1. Rank r's slot for chunk j
    holds what its left neighbour passed on for j (``slot=j``)."""
    call = _reduce_scatter_call("linear_reduce_scatter.ring", x3, weight, residual, pg, tuning)
    box, main, comm, staging, xs = call.box, call.main, call.comm, call.staging, call.xs
    n, r = box.n, box.rank
    right = (r + 1) % n
    for step in range(n - 1):
        j = (r - step - 1) % n
        for k in range(call.pieces):
            sums = box.peer_slot(right, k, slot=j) if staging is None else staging[step, k]
            if step == 0:
                _linear(xs[j, k], weight, bias, None, out=sums)
            else:
                box.wait_ready(main, j, k)
                cublaslt.addmm_into(box.slot(j, k), xs[j, k], weight, sums)
            if staging is None:
                box.mark_ready(main, right, k, slot=j)
            else:
                symm.stream_wait(comm, main)
                box.push(comm, right, k, sums, slot=j)
    for k in range(call.pieces):
        received = box.slot(r, k)
        box.wait_ready(main, r, k)
        if call.res is not None:
            received.add_(call.res[k])
        cublaslt.addmm_into(received, xs[r, k], weight, call.out[k])
    symm.stream_wait(main, comm)
    box.end_call()
    return call.out.view(-1, weight.shape[0])


def _reduce_part(box, k: int, x_own, weight, residual, side, main, out: torch.Tensor, bias=None,
                 done: tuple[slice, torch.Tensor] | None = None) -> None:
    """``out`` = this rank's partial of part ``k`` (its own rows, plus ``bias``, onto ``residual`` if
    given, GEMMed on ``side`` into its own slot, which no peer pushes into) plus every peer's partial
    pushed into ``box``. ``done``: (own rows, their partial) that a GEMM on ``main`` computed already;
    they are finished there, and the GEMM here takes the rest (``_own_split``: a head or a tail)."""
    own, rest = box.slot(box.rank, k), slice(None)
    if done is not None:
        rows, partial = done
        if residual is None:
            own[rows].copy_(partial)
        else:
            torch.add(partial, residual[rows], out=own[rows])
        if bias is not None:
            own[rows].add_(bias)
        rest = slice(rows.stop, None) if rows.start == 0 else slice(0, rows.start)
    with _on(side, main):
        _linear(x_own[rest], weight, bias, None, out=own[rest], residual=None if residual is None else residual[rest])
    if side is not main:
        symm.stream_wait(main, side)
    for step in range(1, box.n):
        box.wait_ready(main, (box.rank - step) % box.n, k)
    _sum_slots(box.slots_of_part(k), out)


def _own_split(r: int, n: int, m: int, rows: int) -> tuple[slice, slice, slice] | None:
    """Where a kernel whose first GEMM takes rank ``r``'s own ``m`` rows (chunk ``r`` of ``n``) and
    whose second takes chunk r+1 moves ``rows`` own rows into the second: (the own rows the first
    GEMM keeps, the own rows that move, both counted from this rank's first row; the second GEMM's
    rows of all n * m). The moved rows must adjoin chunk r+1: this rank's tail, or on the last of two
    ranks (whose r+1 is chunk 0) its head. None where they cannot (the last rank of more than two) or
    where either GEMM would be left without rows."""
    if not 0 < rows < m:
        return None
    if r + 1 < n:
        return slice(0, m - rows), slice(m - rows, m), slice(r * m + m - rows, (r + 2) * m)
    if n == 2:
        return slice(rows, m), slice(0, rows), slice(0, m + rows)
    return None


def _shift(rows: slice, by: int) -> slice:
    return slice(rows.start + by, rows.stop + by)


def _sum_slots(slots: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` = the sum of ``slots`` over its leading (source rank) dim, in one pass."""
    if slots.shape[0] == 2:
        torch.add(slots[0], slots[1], out=out)
    else:
        torch.sum(slots, dim=0, out=out)


def _pushed_linear_allreduce(x2, weight, bias, residual, pg, tuning) -> torch.Tensor:
    """GEMM + reduce_scatter + allgather, pipelined over ``c`` row pieces per reducing rank: for piece
    k, rank r pushes its partials of the peers' rows (the bias in the one for r+1), GEMMs its own rows
    (onto the residual; on a second stream with ``rs_streams=2``), sums what it received, and pushes
    the sums to every peer while piece k+1 is computed; a second copy stream (``symm.comm_stream``'s
    lane 1) copies the peers' sums into the output as they arrive, so that no push waits behind a wait
    for a peer."""
    device = x2.device
    rows, out_cols = x2.shape[0], weight.shape[0]
    n = dist.group_size(pg)
    c = tuning.ar_subchunks if (rows // n) % tuning.ar_subchunks == 0 else 1
    sub = rows // (n * c)
    partials = symm.mailbox("linear_allreduce.partials", c, (sub, out_cols), x2.dtype, pg, device)
    sums = symm.mailbox("linear_allreduce.sums", c, (sub, out_cols), x2.dtype, pg, device)
    partials.start_call()
    sums.start_call()
    r = partials.rank
    main, comm, recv = symm.current_stream(device), symm.comm_stream(device), symm.comm_stream(device, 1)
    side = symm.side_stream(device) if tuning.rs_streams == 2 else main
    symm.stream_wait(recv, main)  # ``out`` is allocated; and under a capture, recv joins it
    xs = x2.view(n, c, sub, -1)
    res = None if residual is None else residual.view(n, c, sub, out_cols)[r]
    out = x2.new_empty((n, c, sub, out_cols))
    staging = x2.new_empty((n - 1, c, sub, out_cols))
    for k in range(c):
        if side is not main:
            symm.stream_wait(side, main)
        for step in range(1, n):
            dst = (r + step) % n
            _linear(xs[dst, k], weight, bias if step == 1 else None, None, out=staging[step - 1, k])
            symm.stream_wait(comm, main)
            partials.push(comm, dst, k, staging[step - 1, k])
        _reduce_part(partials, k, xs[r, k], weight, None if res is None else res[k], side, main, out[r, k])
        symm.stream_wait(comm, main)
        for step in range(1, n):
            sums.push(comm, (r + step) % n, k, out[r, k])
        for step in range(1, n):
            src = (r - step) % n
            sums.wait_ready(recv, src, k)
            symm.copy(recv, out[src, k], sums.slot(src, k))
    symm.stream_wait(main, comm)
    symm.stream_wait(main, recv)
    partials.end_call()
    sums.end_call()
    return out.view(rows, out_cols)
