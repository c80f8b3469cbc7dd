"""Sequence-parallel TP MLP forward (allgather -> linear+bias -> tanh-GELU -> linear -> reduce_scatter), bf16.

Run on one node:  torchrun --nproc_per_node=N benchmarks/tp_mlp.py [--shapes T,H,F ...] [--iters 20]
                  [--warmup 5] [--rounds 3] [--out benchmarks/results] [--figure docs/tp_mlp_h200xN.png]

Times, per shape and in one process, the max over ranks of CUDA-event time per iteration (20 after 5
warm-ups; the median of 3 interleaved rounds, as clocks drift) of: compute_only (the same GEMMs and
GELU on already gathered rows, no communication), comm_only (the allgather and the reduce_scatter
alone), nccl_sequential, async_tp (torch.ops.symm_mem fused ops), classic_tp (replicated input, one
allreduce), tp_fusion (a FusionDefinition through the public API) and tp_fusion_kernels
(tp_fusion.runtime.overlap called directly). Each rank holds the local shards (w1: [ffn/N, hidden],
b1: [ffn/N], w2: [hidden, ffn/N]); every variant is checked against nccl_sequential before it is
timed. Writes {out}/h200x{N}.json and the bar chart {figure}.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from tp_fusion.launch import init_from_env  # noqa: E402
from tp_fusion.runtime import dist, overlap  # noqa: E402

SHAPES = ((8192, 8192, 28672), (8192, 4096, 16384), (2048, 8192, 28672), (256, 1024, 4096))
VARIANTS = ("compute_only", "comm_only", "nccl_sequential", "async_tp", "classic_tp", "tp_fusion",
            "tp_fusion_kernels")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=[",".join(map(str, s)) for s in SHAPES],
                   help="tokens,hidden,ffn triples")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3,
                   help="time every variant this many times, interleaved; report the median")
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results"), help="JSON directory")
    p.add_argument("--figure", default=None, help="PNG path (default docs/tp_mlp_h200x{N}.png)")
    args = p.parse_args(argv)
    args.shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes]
    return args


def make_inputs(tokens, hidden, ffn, n, r, device):
    """Seeded full tensors (identical on every rank), then this rank's shards and gathered rows."""
    gen = torch.Generator(device).manual_seed(0)

    def rand(*shape, scale=1.0):
        return (torch.randn(shape, device=device, generator=gen) * scale).to(torch.bfloat16)

    x = rand(tokens, hidden)
    w1, b1 = rand(ffn, hidden, scale=hidden**-0.5), rand(ffn, scale=0.1)
    w2 = rand(hidden, ffn, scale=ffn**-0.5)
    return {
        "x_full": x,
        "x_local": x.chunk(n)[r].contiguous(),
        "w1": w1.chunk(n)[r].contiguous(),
        "b1": b1.chunk(n)[r].contiguous(),
        "w2": w2.chunk(n, dim=1)[r].contiguous(),
    }


def mlp_local(x, w1, b1, w2):
    """This rank's partial of the MLP on rows ``x`` (its ffn shard)."""
    return F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2)


def tp_fusion_runner(tokens, hidden, ffn, n, inp):
    """``fd.execute`` of the sequence-parallel MLP through the public API, or the reason it can't run."""
    try:
        from tp_fusion import DataType, DeviceMesh, FusionDefinition, ParallelType

        mesh = DeviceMesh(range(n))
        with FusionDefinition() as fd:
            x = fd.define_tensor([tokens, hidden], dtype=DataType.BFloat16)
            w1 = fd.define_tensor([ffn, hidden], dtype=DataType.BFloat16)
            b1 = fd.define_tensor([ffn], dtype=DataType.BFloat16)
            w2 = fd.define_tensor([hidden, ffn], dtype=DataType.BFloat16)
            y = fd.ops.gelu(fd.ops.linear(x, w1, b1), approximate="tanh")
            z = fd.ops.linear(y, w2)
            fd.add_output(z)
            for tv in (x, w1, b1, w2, z):
                tv.set_device_mesh(mesh)
            for tv, axis in ((x, 0), (w1, 0), (b1, 0), (w2, 1), (z, 0)):
                tv.outer_split(axis, n)
                tv.axis(axis).parallelize(ParallelType.mesh_x)
    except (ImportError, AttributeError, NotImplementedError, TypeError) as e:
        return f"tp_fusion's public API is not usable here ({type(e).__name__}: {e})"
    args = [inp["x_local"], inp["w1"], inp["b1"], inp["w2"]]
    return lambda: fd.execute(args)[0]


def variants(tokens, hidden, ffn, n, inp):
    """name -> zero-argument callable returning this rank's output (or a skip reason string)."""
    x_local, x_full, w1, b1, w2 = inp["x_local"], inp["x_full"], inp["w1"], inp["b1"], inp["w2"]
    gathered = torch.empty_like(x_full)
    z_partial = torch.empty(tokens, hidden, device=x_full.device, dtype=x_full.dtype)
    z_local = torch.empty(tokens // n, hidden, device=x_full.device, dtype=x_full.dtype)

    def comm_only():
        dist.all_gather(gathered, x_local, None)
        dist.reduce_scatter(z_local, z_partial, None)
        return z_local

    def nccl_sequential():
        dist.all_gather(gathered, x_local, None)
        out = torch.empty_like(z_local)
        dist.reduce_scatter(out, mlp_local(gathered, w1, b1, w2), None)
        return out

    def async_tp():
        h = dist.async_tp_all_gather_matmul(x_local, w1.t(), 0, None)
        y = F.gelu(h.add_(b1), approximate="tanh")
        return dist.async_tp_matmul_reduce_scatter(y, w2.t(), 0, None)

    def classic_tp():
        out = mlp_local(x_full, w1, b1, w2)
        dist.all_reduce(out, None)
        return out.chunk(n)[dist.rank()]

    def kernels():
        y = overlap.allgather_linear(x_local, w1, b1, gather_dim=0, pg=None, epilogue=overlap.gelu_tanh)
        return overlap.linear_reduce_scatter(y, w2, scatter_dim=0, pg=None)

    return {
        "compute_only": lambda: mlp_local(x_full, w1, b1, w2),
        "comm_only": comm_only,
        "nccl_sequential": nccl_sequential,
        "async_tp": async_tp,
        "classic_tp": classic_tp,
        "tp_fusion": tp_fusion_runner(tokens, hidden, ffn, n, inp),
        "tp_fusion_kernels": kernels,
    }


def time_ms(fn, iters, warmup) -> float:
    """CUDA-event time per iteration, max over ranks."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    t = torch.tensor([start.elapsed_time(end) / iters], device="cuda")
    dist.all_reduce(t, None, op="max")
    return t.item()


def max_rel_err(got, want) -> float:
    err = torch.linalg.vector_norm(got.float() - want.float()) / torch.linalg.vector_norm(want.float())
    t = err.reshape(1)
    dist.all_reduce(t, None, op="max")
    return t.item()


def run_shape(tokens, hidden, ffn, args):
    n, r = dist.world_size(), dist.rank()
    inp = make_inputs(tokens, hidden, ffn, n, r, torch.device("cuda", torch.cuda.current_device()))
    fns = variants(tokens, hidden, ffn, n, inp)
    ref = fns["nccl_sequential"]()
    row = {"tokens": tokens, "hidden": hidden, "ffn": ffn, "ms": {}, "ms_rounds": {}, "rel_err": {},
           "skipped": {}}
    for name in VARIANTS:
        fn = fns[name]
        if name == "tp_fusion" and not isinstance(fn, str):
            try:  # the frontend is young: a plan it cannot run yet is reported, not fatal
                fn()
            except Exception as e:  # every rank raises the same
                fn = fns[name] = f"fd.execute failed: {type(e).__name__}: {e}"
        if isinstance(fn, str):
            row["ms"][name], row["skipped"][name] = None, fn
        elif name in ("async_tp", "classic_tp", "tp_fusion", "tp_fusion_kernels"):
            row["rel_err"][name] = max_rel_err(fn(), ref)
    timed = [name for name in VARIANTS if not isinstance(fns[name], str)]
    for _ in range(args.rounds):  # interleaved, so that drifting clocks hit every variant alike
        for name in timed:
            row["ms_rounds"].setdefault(name, []).append(time_ms(fns[name], args.iters, args.warmup))
    for name in timed:
        row["ms"][name] = statistics.median(row["ms_rounds"][name])
    ms = row["ms"]
    for name in ("tp_fusion", "tp_fusion_kernels"):
        if ms[name] is not None:
            row[f"{name}/compute_only"] = ms[name] / ms["compute_only"]
            row[f"{name}/async_tp"] = ms[name] / ms["async_tp"]
    return row


def print_table(rows, n):
    cols = VARIANTS
    head = f"{'tokens,hidden,ffn':>20} " + " ".join(f"{c:>17}" for c in cols)
    print(f"\nTP MLP forward, bf16, {n} GPUs, ms per iteration (max over ranks, median of rounds)\n{head}")
    for row in rows:
        cells = " ".join(f"{row['ms'][c]:17.3f}" if row["ms"][c] is not None else f"{'skipped':>17}"
                         for c in cols)
        print(f"{row['tokens']:>6},{row['hidden']:>6},{row['ffn']:>6} {cells}")
    print()
    for row in rows:
        shape = f"{row['tokens']},{row['hidden']},{row['ffn']}"
        for name in ("tp_fusion", "tp_fusion_kernels"):
            if f"{name}/compute_only" in row:
                print(f"{shape:>20} {name:>17}: /compute_only {row[f'{name}/compute_only']:.3f}  "
                      f"/async_tp {row[f'{name}/async_tp']:.3f}")
        errs = "  ".join(f"{k} {v:.1e}" for k, v in row["rel_err"].items())
        print(f"{'':>20} rel. error vs nccl_sequential: {errs}")
        for name, why in row["skipped"].items():
            print(f"{'':>20} {name} skipped: {why}")


def draw(rows, machine, path):
    """Grouped bars per shape: time / compute_only on a log axis, labelled in ms."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [c for c in VARIANTS if c != "comm_only"]
    fig, ax = plt.subplots(figsize=(12, 4.5))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        vals = [(row["ms"][name] or math.nan) / row["ms"]["compute_only"] for row in rows]
        bars = ax.bar([j + i * width for j in range(len(rows))], vals, width, label=name)
        for bar, row in zip(bars, rows, strict=True):
            if row["ms"][name] is not None:
                ax.annotate(f"{row['ms'][name]:.2f}", (bar.get_x() + width / 2, bar.get_height()),
                            ha="center", va="bottom", fontsize=6, rotation=90)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))])
    ax.set_xticklabels([f"{r['tokens']}x{r['hidden']}x{r['ffn']}" for r in rows])
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_yscale("log")
    ax.set_ylabel("time / compute only, log scale (labels: ms)")
    ax.set_title(f"Sequence-parallel TP MLP forward, bf16, {machine}")
    ax.legend(fontsize=7, ncol=4)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=130)


def main(argv=None):
    args = parse_args(argv)
    init_from_env()
    n = dist.world_size()
    rows = []
    for tokens, hidden, ffn in args.shapes:
        rows.append(run_shape(tokens, hidden, ffn, args))
        torch.cuda.empty_cache()
    if dist.rank() == 0:
        print_table(rows, n)
        result = {"machine": f"{n}x {torch.cuda.get_device_name()}", "torch": torch.__version__,
                  "nccl": ".".join(map(str, torch.cuda.nccl.version())), "iters": args.iters,
                  "warmup": args.warmup, "rounds": args.rounds, "shapes": rows}
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"h200x{n}.json"), "w") as f:
            json.dump(result, f, indent=1)
        draw(rows, result["machine"], args.figure or os.path.join(REPO, "docs", f"tp_mlp_h200x{n}.png"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
