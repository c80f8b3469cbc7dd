"""How much cuBLASLt's other candidates beat torch's GEMM on the fused segments' chunk shapes (one GPU).

For each GEMM (rows, out features, contracted, epilogue) it times torch's call and every candidate
the heuristic lists (``tp_fusion.runtime.cublaslt``), prints TFLOP/s and the kernels run, and writes
JSON. The chunk shapes are the fused MLP's and transformer's on 2 ranks; the unchunked shapes beside
them show what the same work gets in one GEMM.

    python benchmarks/gemm_algos.py --out results.json
"""

from __future__ import annotations

import argparse
import json

import torch

from tp_fusion.runtime import cublaslt

# (rows, out features, contracted, epilogue): the SP MLP's AG and RS GEMMs per rank at 2 ranks, chunk
# (tokens/2 rows) and whole (tokens rows); the SP transformer's QKV, fc1, out-projection, fc2 at 8192x8192.
MLP = [(8192, 4096, 16384), (8192, 8192, 28672), (8192, 12288, 49152), (16384, 8192, 28672),
       (2048, 8192, 28672), (3072, 12288, 49152), (4096, 5120, 13824)]


def problems():
    out = []
    for tokens, hidden, ffn in MLP:
        for rows in (tokens // 2, tokens):
            out.append((rows, ffn // 2, hidden, "gelu_bias"))
            out.append((rows, hidden, ffn // 2, "none"))
    for rows in (4096, 8192):
        out += [(rows, 12288, 8192, "bias"), (rows, 16384, 8192, "gelu_bias"),
                (rows, 8192, 4096, "none"), (rows, 8192, 16384, "none")]
    return out


def kernels(fn) -> list[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sorted({e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})


def measure(m: int, n: int, k: int, epi: str, device, iters: int) -> dict:
    """torch's time and every candidate's for one GEMM; prints one line."""
    problem = cublaslt.Problem(m, n, k, torch.bfloat16, epi, k, k, n)
    tflop = 2 * m * n * k / 1e12
    torch_ms, timed = cublaslt.time_candidates(problem, device, iters=iters, warmup=5)
    gemm = cublaslt.Gemm(problem)
    x, w, bias, out = problem.scratch(device)
    best_ms, best = min(timed, key=lambda t: t[0])
    row = dict(m=m, n=n, k=k, epilogue=epi, torch_ms=torch_ms, heuristic_first_ms=timed[0][0], best_ms=best_ms,
               candidates=len(timed), best_index=[a for _, a in timed].index(best), all_ms=[t for t, _ in timed],
               torch_kernels=kernels(lambda: cublaslt.torch_linear(x, w, bias, epi == "gelu_bias", out)),
               best_kernels=kernels(lambda: gemm.run(best, x, w, bias, out)))
    print(f"{m:6d} {n:6d} {k:6d} {epi:9s} torch {torch_ms:.3f} ms {tflop / torch_ms * 1e3:5.0f} TF/s | "
          f"first {timed[0][0]:.3f} | best #{row['best_index']:2d}/{len(timed)} {best_ms:.3f} ms "
          f"{tflop / best_ms * 1e3:5.0f} TF/s ({best_ms / torch_ms:.3f}) | {row['torch_kernels'][-1][:60]} -> "
          f"{row['best_kernels'][-1][:60]}", flush=True)
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()
    device = torch.device("cuda", 0)
    rows_out = [measure(m, n, k, epi, device, args.iters) for m, n, k, epi in problems()]
    with open(args.out, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows_out), f, indent=1)


if __name__ == "__main__":
    main()
