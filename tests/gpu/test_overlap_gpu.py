"""The CUDA (symmetric-memory) overlap kernels against the sequential NCCL mode, on 2 GPUs.

Run on a machine with at least 2 GPUs:  python -m pytest tests/gpu/test_overlap_gpu.py
(the test spawns its own 2 NCCL ranks; it skips without CUDA or with fewer than 2 GPUs).
Integer-valued bf16 data keeps every GEMM exact in fp32 and every partial exact in bf16, so the
fused and sequential results must be equal bit for bit, except through the GELU epilogue. Every
``Tuning`` the benchmark tries is checked, on fresh data each time (a race shows as a mismatch).
The kernels are also captured as CUDA graphs (one per mailbox phase) and replayed on fresh inputs.
"""

from __future__ import annotations

import socket
import traceback

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                reason="needs 2 CUDA GPUs")


def _ints(gen, *shape, device) -> torch.Tensor:
    return torch.randint(-1, 2, shape, generator=gen, device=device).to(torch.bfloat16)


def _tunings():
    from tp_fusion.runtime.overlap import Tuning

    return [Tuning(), Tuning(ag_streams=2, rs_reduce="ring", rs_subchunks=2),
            Tuning(ag_streams=2, rs_remote_store=True),
            Tuning(rs_streams=2, rs_subchunks=2, ar_subchunks=1), Tuning(rs_reduce="ring"),
            Tuning(rs_reduce="ring", rs_subchunks=2, rs_remote_store=True),
            Tuning(ag_gemm="async_input", rs_subchunks=2, ar_subchunks=1), Tuning(ar_subchunks=4),
            Tuning(ag_split_rows=32, rs_split_rows=96),  # 256 rows per rank in the allgathers, 512 in the rest
            Tuning(ag_split_rows=200, rs_split_rows=300, ag_streams=2, rs_streams=2)]


def _checks(rank: int, n: int) -> None:
    from tp_fusion.runtime import dist, overlap

    device = torch.device("cuda", rank)
    gen = torch.Generator(device).manual_seed(0)
    for tuning in _tunings():
        for _ in range(3):
            # 128 rows per rank: the async-input GEMM needs chunks of whole 128-row tiles.
            x_full, w, b = _ints(gen, 2, 128 * n, 128, device=device), _ints(gen, 96, 128, device=device), \
                _ints(gen, 96, device=device)
            for dim in (0, 1):
                x_local = x_full.chunk(n, dim=dim)[rank].contiguous()
                for bias in (None, b):
                    got = overlap.allgather_linear(x_local, w, bias, gather_dim=dim, pg=None, mode="fused",
                                                   tuning=tuning)
                    assert torch.equal(got, F.linear(x_full, w, bias)), f"allgather_linear dim={dim} {tuning}"
                got = overlap.allgather_linear(x_local, w, b, gather_dim=dim, pg=None, epilogue=overlap.gelu_tanh,
                                               mode="fused", tuning=tuning)
                torch.testing.assert_close(got, overlap.gelu_tanh(F.linear(x_full, w, b)))
            # Partials over K=64 values in {-1, 0, 1}: |sum over ranks| <= 128 (+1 bias), exact in bf16.
            xs = [_ints(gen, 16 * n, 32, 64, device=device) for _ in range(n)]
            ws = [_ints(gen, 48, 64, device=device) for _ in range(n)]
            b2 = _ints(gen, 48, device=device)
            total = sum(F.linear(x, wr) for x, wr in zip(xs, ws, strict=True))
            for mode in overlap.MODES:
                for dim in (0, 1):
                    got = overlap.linear_reduce_scatter(xs[rank], ws[rank], scatter_dim=dim, pg=None, mode=mode,
                                                        tuning=tuning)
                    assert torch.equal(got, total.chunk(n, dim=dim)[rank]), f"reduce_scatter dim={dim} {mode} {tuning}"
                got = overlap.linear_reduce_scatter(xs[rank], ws[rank], b2, scatter_dim=0, pg=None, mode=mode,
                                                    tuning=tuning)
                assert torch.equal(got, (total + b2).chunk(n)[rank]), f"reduce_scatter bias {mode} {tuning}"
                got = overlap.linear_allreduce(xs[rank], ws[rank], b2, pg=None, mode=mode, tuning=tuning)
                assert torch.equal(got, total + b2), f"allreduce {mode} {tuning}"
                res = _ints(gen, 16 * n, 32, 48, device=device)  # the same on every rank (same generator seed)
                got = overlap.linear_reduce_scatter(xs[rank], ws[rank], b2, residual=res.chunk(n)[rank], scatter_dim=0,
                                                    pg=None, mode=mode, tuning=tuning)
                assert torch.equal(got, (total + b2 + res).chunk(n)[rank]), f"reduce_scatter residual {mode} {tuning}"
                got = overlap.linear_allreduce(xs[rank], ws[rank], b2, residual=res, pg=None, mode=mode, tuning=tuning)
                assert torch.equal(got, total + b2 + res), f"allreduce residual {mode} {tuning}"
    assert dist.backend() == "nccl"


def _graph_checks(rank: int, n: int) -> None:
    """The fused kernels captured as CUDA graphs (``graphs.GraphedRun``: one graph per mailbox phase, on
    mailboxes of its own) replay right call after call, on fresh inputs each time, with the same
    kernels run eagerly in between on the shared mailboxes (equal to the replay bit for bit)."""
    from tp_fusion.runtime.overlap import Tuning

    gen = torch.Generator(torch.device("cuda", rank)).manual_seed(1)  # the same data on every rank
    for tuning in (Tuning(), Tuning(ag_streams=2, rs_reduce="ring", rs_subchunks=2),
                   Tuning(rs_streams=2, rs_remote_store=True, ar_subchunks=1),
                   Tuning(ag_split_rows=8, rs_split_rows=12)):  # of 32 rows per rank
        _graph_check(tuning, rank, n, gen)
    _graph_memory_check(rank)


def _graph_memory_check(rank: int) -> None:
    """The graphs of one plan share their memory pool: capturing all of them reserves about what one
    eager run allocates at its peak (the 32 MB intermediate, the partials), not once per graph (four
    graphs here). On 2x H200 the four graphs reserved 54 MiB against an eager peak of 72 MiB (0.75x);
    with a pool per graph (before round 15) they reserved 210 MiB (2.92x)."""
    from tp_fusion.runtime import graphs, overlap

    device = torch.device("cuda", rank)
    x_local = torch.randn(2048, 1024, dtype=torch.bfloat16, device=device)
    w1 = torch.randn(4096, 1024, dtype=torch.bfloat16, device=device)
    w2 = torch.randn(1024, 4096, dtype=torch.bfloat16, device=device)

    def mlp(xs):
        h = overlap.allgather_linear(xs[0], w1, None, gather_dim=0, pg=None, mode="fused")
        return [overlap.linear_reduce_scatter(h, w2, None, scatter_dim=0, pg=None, mode="fused")]

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    mlp([x_local])
    eager_peak = torch.cuda.max_memory_allocated() - before
    graphed = graphs.GraphedRun(mlp, [x_local])
    assert len(graphed._graphs) == 4
    graphed.release()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    reserved = torch.cuda.memory_reserved()
    graphed._capture([x_local])  # as a replay on moved inputs does
    captured = torch.cuda.memory_reserved() - reserved
    assert len(graphed._graphs) == 4 and captured < 1.5 * eager_peak, (
        f"4 graphs reserve {captured / 2**20:.0f} MiB, one eager run peaks at {eager_peak / 2**20:.0f} MiB")
    graphed.release()


def _graph_check(tuning, rank: int, n: int, gen: torch.Generator) -> None:
    from tp_fusion.runtime import graphs, overlap

    device = gen.device
    w1, b1 = _ints(gen, 64, 32, device=device), _ints(gen, 64, device=device)
    w2, b2 = _ints(gen, 32, 64, device=device), _ints(gen, 32, device=device)

    def mlp(xs):
        h = overlap.allgather_linear(xs[0], w1, b1, gather_dim=0, pg=None, mode="fused", tuning=tuning)
        out = overlap.linear_reduce_scatter(h, w2, b2, scatter_dim=0, pg=None, mode="fused", tuning=tuning)
        return [out, overlap.linear_allreduce(h, w2, b2, pg=None, mode="fused", tuning=tuning)]

    def inputs():
        """This rank's rows of fresh x, and what ``mlp`` returns for them: every rank holds all of h and
        the same w2, so the reductions sum n equal partials."""
        x_full = _ints(gen, 32 * n, 32, device=device)
        total = n * F.linear(F.linear(x_full, w1, b1), w2).float() + b2.float()
        return x_full.chunk(n)[rank].contiguous(), [total.chunk(n)[rank], total]

    graphed = graphs.GraphedRun(mlp, [inputs()[0]])
    assert len(graphed._graphs) == 4, f"{len(graphed._graphs)} graphs for a cycle of 4 phases"
    for call in range(9):
        x_local, expected = inputs()
        got = graphed.replay([x_local])  # fresh activations: copied into the graphs' input buffer
        for g, e in zip(got, expected, strict=True):
            torch.testing.assert_close(g.float(), e, rtol=2e-2, atol=1.0, msg=f"replay {call} {tuning}")
        if call % 3 == 1:  # moves the shared mailboxes' phases, not the graphs' own
            for g, e in zip(got, mlp([x_local]), strict=True):
                assert torch.equal(g, e), f"eager call after replay {call} {tuning}"
    graphed.release()


def _worker(rank: int, n: int, port: int, errors, checks) -> None:
    from tp_fusion.runtime import dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank, n, f"tcp://127.0.0.1:{port}", 120)
    try:
        checks(rank, n)
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("checks", [_checks, _graph_checks], ids=["eager", "cuda_graphs"])
def test_fused_matches_sequential_on_two_gpus(checks):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    procs = [ctx.Process(target=_worker, args=(r, 2, port, errors, checks)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    assert not failures and all(p.exitcode == 0 for p in procs), failures or [p.exitcode for p in procs]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_addmm_into_reads_c_and_writes_a_separate_output(dtype):
    from tp_fusion.runtime import cublaslt

    gen = torch.Generator("cuda").manual_seed(0)
    x, w = _ints(gen, 192, 64, device="cuda").to(dtype), _ints(gen, 96, 64, device="cuda").to(dtype)
    c = _ints(gen, 192, 96, device="cuda").to(dtype)
    c_before = c.clone()
    out = torch.full((192, 96), float("nan"), dtype=dtype, device="cuda")
    assert cublaslt.addmm_into(c, x, w, out) is out
    assert torch.equal(out, c_before + x @ w.t()) and torch.equal(c, c_before)
    assert cublaslt._library() is not None and cublaslt._gemms, "cuBLASLt was not used"
    # Row views with a leading dim wider than the row (a piece of a wider buffer) and C = D.
    wide = torch.zeros(192, 128, dtype=dtype, device="cuda")
    wide[:, :96] = c_before
    cublaslt.addmm_into(wide[:, :96], x, w, wide[:, :96])
    assert torch.equal(wide[:, :96], c_before + x @ w.t()) and not wide[:, 96:].any()
    # A view 16 bytes into its rows: the heuristic is told its alignment (it assumes 256 bytes otherwise).
    offset = 16 // c.element_size()
    view = torch.zeros(192, 128, dtype=dtype, device="cuda")[:, offset:offset + 96]
    view.copy_(c_before)
    assert view.data_ptr() % 256 == 16
    cublaslt.addmm_into(view, x, w, view)
    assert torch.equal(view, c_before + x @ w.t())
