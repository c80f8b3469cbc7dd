"""The CUDA (symmetric-memory) overlap kernels against the sequential NCCL mode, on 2 GPUs.

Run on a machine with at least 2 GPUs:  python -m pytest tests/gpu/test_overlap_gpu.py
(the test spawns its own 2 NCCL ranks; it skips without CUDA or with fewer than 2 GPUs).
Integer-valued bf16 data keeps every GEMM exact in fp32 and every partial exact in bf16, so the
fused and sequential results must be equal bit for bit, except through the GELU epilogue. Every
``Tuning`` the benchmark tries is checked, on fresh data each time (a race shows as a mismatch).
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
            Tuning(ag_gemm="async_input", rs_subchunks=2, ar_subchunks=1), Tuning(ar_subchunks=4)]


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


def _worker(rank: int, n: int, port: int, errors) -> None:
    from tp_fusion.runtime import dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank, n, f"tcp://127.0.0.1:{port}", 120)
    try:
        _checks(rank, n)
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise
    finally:
        dist.destroy_process_group()


def test_fused_matches_sequential_on_two_gpus():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    procs = [ctx.Process(target=_worker, args=(r, 2, port, errors)) for r in range(2)]
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
