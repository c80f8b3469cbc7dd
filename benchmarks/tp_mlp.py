"""Tensor-parallel MLP forward, bf16, against the best single-GPU compute of the same local work.

Run on one node with GPUs:  torchrun --nproc_per_node=N benchmarks/tp_mlp.py [--sp T,H,F ...] [--tp T,H,F ...]
        [--designs] [--profile DIR] [--power] [--iters 20] [--warmup 5] [--min-ms 100] [--settle-ms 3000] [--rounds 7]
        [--out benchmarks/results]

Two modes, each rank holding its shards (w1: [ffn/N, hidden], b1: [ffn/N], w2: [hidden, ffn/N]):
- sp (sequence parallel): x sharded on tokens -> allgather -> linear+bias -> tanh-GELU -> linear
  -> reduce_scatter; baselines NCCL sequential and PyTorch async-TP (torch.ops.symm_mem fused ops).
- tp (plain TP): x replicated -> linear+bias -> tanh-GELU -> linear -> allreduce; baseline classic
  TP (the same, one NCCL allreduce).

Per shape, in one process, each variant's CUDA-event time per iteration (``--iters`` after
``--warmup``, each at least ``--min-ms`` long), max over ranks, median of ``--rounds`` interleaved
rounds, each round in its own random order (clocks and power drift, and a GPU at its power limit
carries one variant's clocks into the next), after ``--settle-ms`` of the variants untimed (the
power controller's transient after idle time, ``tuning.settle``):
compute_unfused (linear, GELU, linear on the gathered rows) and compute_fused_epilogue
(``torch._addmm_activation`` with bias and GELU, then linear): ``best_compute`` is the smaller, the
yardstick; comm_only; the baselines; tp_fusion (a FusionDefinition through ``fd.execute``) and
tp_fusion_kernels (``tp_fusion.runtime.overlap`` with mode="fused"). ``--designs`` adds the kernel
designs tried (``overlap.Tuning`` variants). Every variant is checked against NCCL sequential
(classic TP) before it is timed; one that disagrees is reported and not timed.

Results go to ``{out}/{gpu}x{N}.json`` (e.g. h200x2.json), named after the machine the run is on,
and a chart to ``{out}/tp_mlp_{gpu}x{N}.png``. ``--profile DIR`` also traces tp_fusion, the kernels,
the fused-epilogue compute and the sequential baseline on the first shape of each mode (or
``--profile-shapes``) in the steady state of the timed loops, prints where the time goes per rank
and by kernel (``tp_fusion.profiling``) and draws the timelines. ``--power`` samples the GPUs' SM
clock and power while each variant is timed (``benchmarks/gpu_monitor.py``) and records them per
variant (``power`` in the results): a slower GPU told apart from a slower schedule. Without a CUDA
GPU it says so and exits 0.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from examples.cli import add_timing_options, parser  # noqa: E402

SP_SHAPES = ((256, 1024, 4096), (1024, 4096, 16384), (2048, 8192, 28672), (3072, 12288, 49152),
             (4096, 5120, 13824), (8192, 4096, 16384), (8192, 8192, 28672), (8192, 12288, 49152),
             (16384, 8192, 28672))
TP_SHAPES = ((256, 1024, 4096), (2048, 8192, 28672), (3072, 12288, 49152), (8192, 8192, 28672))
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv=None) -> argparse.Namespace:
    p = parser(__doc__)
    shapes = lambda s: tuple(int(v) for v in s.split(","))  # noqa: E731
    p.add_argument("--sp", nargs="*", type=shapes, default=list(SP_SHAPES), help="tokens,hidden,ffn triples")
    p.add_argument("--tp", nargs="*", type=shapes, default=list(TP_SHAPES), help="tokens,hidden,ffn triples")
    p.add_argument("--designs", nargs="*", metavar="NAME",
                   help="also time the kernel designs tried (these, or with no name all of them)")
    p.add_argument("--profile", metavar="DIR", help="trace the profiled shapes; reports and timelines in DIR")
    p.add_argument("--profile-shapes", nargs="*", type=shapes, default=None,
                   help="tokens,hidden,ffn triples to profile (default: the first shape of each mode)")
    p.add_argument("--power", action="store_true",
                   help="also sample the GPUs' SM clock and power (nvidia-smi) while each variant is timed")
    add_timing_options(p, iters=20, warmup=5, rounds=7)
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results"), help="results folder")
    return p.parse_args(argv)


if __name__ == "__main__":
    ARGS = parse_args()  # before torch is imported: --help answers at once

import dataclasses  # noqa: E402
import datetime  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import random  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks import gpu_monitor  # noqa: E402
from tp_fusion.runtime import dist, overlap, tuning  # noqa: E402

SP_VARIANTS = ("compute_unfused", "compute_fused_epilogue", "comm_only", "nccl_sequential", "async_tp",
               "tp_fusion", "tp_fusion_kernels")
TP_VARIANTS = ("compute_unfused", "compute_fused_epilogue", "comm_only", "classic_tp", "tp_fusion",
               "tp_fusion_kernels")
# The kernel designs tried (docs/performance.md says what each measured); the defaults are tp_fusion_kernels.
SP_DESIGNS = {
    "ag_two_streams": overlap.Tuning(ag_streams=2),
    "rs_two_streams": overlap.Tuning(rs_streams=2),
    "ag_async_input_mm": overlap.Tuning(ag_gemm="async_input"),
    "rs_remote_store": overlap.Tuning(rs_remote_store=True),
    "rs_ring_1_piece": overlap.Tuning(rs_reduce="ring"),
    "rs_ring_2_pieces": overlap.Tuning(rs_reduce="ring", rs_subchunks=2),
    "rs_ring_4_pieces": overlap.Tuning(rs_reduce="ring", rs_subchunks=4),
    # The ring's partial GEMMs write into the next rank's slot (no copy engine, no staging); the last
    # GEMM reads the received partial as its C operand: no push, no add pass, no copy out
    "rs_ring_remote_store": overlap.Tuning(rs_reduce="ring", rs_remote_store=True),
    "rs_ring_remote_store_2_pieces": overlap.Tuning(rs_reduce="ring", rs_subchunks=2, rs_remote_store=True),
    "rs_sum_2_pieces": overlap.Tuning(rs_subchunks=2),
    # Chunk boundaries off the middle (round 18's compute-only probe: GEMM 1 best 256 rows early, GEMM 2
    # 512-768 rows late, on 8192 and 16384 tokens)
    "ag_split_256": overlap.Tuning(ag_split_rows=256),
    "rs_split_512": overlap.Tuning(rs_split_rows=512),
    "rs_split_768": overlap.Tuning(rs_split_rows=768),
    "split_256_768": overlap.Tuning(ag_split_rows=256, rs_split_rows=768),
}
TP_DESIGNS = {"ar_two_streams": overlap.Tuning(rs_streams=2), "ar_1_piece": overlap.Tuning(ar_subchunks=1),
              "ar_4_pieces": overlap.Tuning(ar_subchunks=4)}
REFERENCE = {"sp": "nccl_sequential", "tp": "classic_tp"}
TOLERANCE = 3e-2  # relative error (norm) against the reference; bf16 GEMM chains land near 5e-3
SPREAD_FLAG = 1.05  # a variant whose slowest round took this much longer than its fastest is flagged: on
#                     2x H200 whole rounds ran 10-20% slow when the power controller pulled the clocks down
#                     (docs/performance.md, rounds 11 and 12), and a median with many such rounds is one


def machine_slug(n: int) -> str:
    """``h200x2`` for 2 'NVIDIA H200' GPUs: the results file's name."""
    words = [w for w in torch.cuda.get_device_name().lower().split() if w not in ("nvidia", "tesla")]
    return f"{re.sub(r'[^a-z0-9]', '', words[0] if words else 'gpu')}x{n}"


# --------------------------------------------------------------------------------------------------
# Inputs and variants
# --------------------------------------------------------------------------------------------------

def make_inputs(tokens, hidden, ffn, n, r, device):
    """Seeded full tensors (identical on every rank), then this rank's shards."""
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
    """This rank's partial of the MLP on rows ``x`` (its ffn shard), unfused: linear, GELU, linear."""
    return F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2)


def mlp_local_fused(x, w1, b1, w2):
    """The same with bias and GELU in the first GEMM's epilogue (cuBLASLt GELU_BIAS)."""
    return F.linear(torch._addmm_activation(b1, x, w1.t(), use_gelu=True), w2)


def define_mlp(tokens, hidden, ffn, n, mode):
    """The MLP as a FusionDefinition over ``n`` ranks: ``sp`` shards x and the output on tokens."""
    from tp_fusion import DataType, DeviceMesh, FusionDefinition, ParallelType

    mesh = DeviceMesh(range(n))
    with FusionDefinition() as fd:
        x = fd.define_tensor([tokens, hidden], dtype=DataType.BFloat16)
        w1 = fd.define_tensor([ffn, hidden], dtype=DataType.BFloat16)
        b1 = fd.define_tensor([ffn], dtype=DataType.BFloat16)
        w2 = fd.define_tensor([hidden, ffn], dtype=DataType.BFloat16)
        z = fd.ops.linear(fd.ops.gelu(fd.ops.linear(x, w1, b1), approximate="tanh"), w2)
        fd.add_output(z)
        for tv in (x, w1, b1, w2, z):
            tv.set_device_mesh(mesh)
        sharded = ((w1, 0), (b1, 0), (w2, 1)) + (((x, 0), (z, 0)) if mode == "sp" else ())
        for tv, axis in sharded:
            tv.outer_split(axis, n)
            tv.axis(axis).parallelize(ParallelType.mesh_x)
    return fd


def tp_fusion_runner(tokens, hidden, ffn, n, inp, mode="sp"):
    """``fd.execute`` of the MLP through the public API (returns (callable, fd))."""
    fd = define_mlp(tokens, hidden, ffn, n, mode)
    args = [inp["x_local" if mode == "sp" else "x_full"], inp["w1"], inp["b1"], inp["w2"]]
    return (lambda: fd.execute(args)[0]), fd


def async_tp_all_gather_matmul(a_shard, b, gather_dim: int, pg):
    """PyTorch async-TP's ``all_gather(a_shard, gather_dim) @ b``."""
    import torch.distributed._symmetric_memory  # noqa: F401  (registers torch.ops.symm_mem)

    _, (out,) = torch.ops.symm_mem.fused_all_gather_matmul(a_shard, [b], gather_dim, dist.group_name(pg),
                                                           return_A=False)
    return out


def async_tp_matmul_reduce_scatter(a, b, scatter_dim: int, pg):
    """PyTorch async-TP's ``reduce_scatter(a @ b, scatter_dim)``."""
    import torch.distributed._symmetric_memory  # noqa: F401

    return torch.ops.symm_mem.fused_matmul_reduce_scatter(a, b, "sum", scatter_dim, dist.group_name(pg))


def sp_variants(tokens, hidden, ffn, n, inp, designs):
    """(name -> zero-argument callable returning this rank's output shard [tokens/n, hidden], the fd)."""
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
        dist.reduce_scatter(out, mlp_local_fused(gathered, w1, b1, w2), None)
        return out

    def async_tp():
        h = async_tp_all_gather_matmul(x_local, w1.t(), 0, None)
        return async_tp_matmul_reduce_scatter(F.gelu(h.add_(b1), approximate="tanh"), w2.t(), 0, None)

    def kernels(tuning):
        def run():
            y = overlap.allgather_linear(x_local, w1, b1, gather_dim=0, pg=None, epilogue=overlap.gelu_tanh,
                                         mode="fused", tuning=tuning)
            return overlap.linear_reduce_scatter(y, w2, scatter_dim=0, pg=None, mode="fused", tuning=tuning)
        return run

    tp_fusion, fd = tp_fusion_runner(tokens, hidden, ffn, n, inp, "sp")
    fns = {"compute_unfused": lambda: mlp_local(x_full, w1, b1, w2),
           "compute_fused_epilogue": lambda: mlp_local_fused(x_full, w1, b1, w2),
           "comm_only": comm_only, "nccl_sequential": nccl_sequential, "async_tp": async_tp,
           "tp_fusion": tp_fusion,
           "tp_fusion_kernels": kernels(overlap.DEFAULT_TUNING)}
    if designs is not None:
        fns.update({f"design:{name}": kernels(t) for name, t in SP_DESIGNS.items() if not designs or name in designs})
    return fns, fd


def tp_variants(tokens, hidden, ffn, n, inp, designs):
    """(name -> zero-argument callable returning this rank's replicated output [tokens, hidden], the fd)."""
    x_full, w1, b1, w2 = inp["x_full"], inp["w1"], inp["b1"], inp["w2"]
    z = torch.empty(tokens, hidden, device=x_full.device, dtype=x_full.dtype)

    def classic_tp():
        out = mlp_local_fused(x_full, w1, b1, w2)
        dist.all_reduce(out, None)
        return out

    def kernels(tuning):
        def run():
            y = torch._addmm_activation(b1, x_full, w1.t(), use_gelu=True)
            return overlap.linear_allreduce(y, w2, pg=None, mode="fused", tuning=tuning)
        return run

    tp_fusion, fd = tp_fusion_runner(tokens, hidden, ffn, n, inp, "tp")
    fns = {"compute_unfused": lambda: mlp_local(x_full, w1, b1, w2),
           "compute_fused_epilogue": lambda: mlp_local_fused(x_full, w1, b1, w2),
           "comm_only": lambda: dist.all_reduce(z, None) or z, "classic_tp": classic_tp,
           "tp_fusion": tp_fusion,
           "tp_fusion_kernels": kernels(overlap.DEFAULT_TUNING)}
    if designs is not None:
        fns.update({f"design:{name}": kernels(t) for name, t in TP_DESIGNS.items() if not designs or name in designs})
    return fns, fd


# --------------------------------------------------------------------------------------------------
# Measuring
# --------------------------------------------------------------------------------------------------

def time_ms(fn, iters, warmup, min_ms: float = 0.0, calls: int | None = None) -> float:
    """tp_fusion's own timer (``tuning.steady_ms``): CUDA-event time per iteration, max over ranks, the
    ranks starting the timed iterations together; with ``min_ms`` the warmup and the timed iterations
    each span at least that long (``calls`` of ``fn``, if counted already)."""
    return tuning.steady_ms(fn, iters, warmup, min_ms, None, "cuda", calls)


_TIME_ROUNDS_CALLS = itertools.count()  # numbers time_rounds' calls alike on every rank (they make the same calls)


def time_rounds(row: dict, fns: dict, args) -> None:
    """Time each of ``fns`` in ``args.rounds`` interleaved rounds after running them untimed for
    ``args.settle_ms`` in all (``tuning.settle``: from idle (compiling, checking) to full load, the
    GPUs' power controller boosts above the 700 W cap and then pulls the clocks down for a second or
    two, 1245-1350 MHz against a steady 1450-1530 on 2x H200, and timings there run up to 18% slow;
    docs/performance.md, round 12), each round in its own random order (seeded by this call and the
    round, so alike on every rank and different from shape to shape: clocks and power drift, and no
    variant keeps a neighbour or a place in the run); fill ``row``'s ``ms_rounds``, ``ms`` (the
    medians), ``spread`` and, with ``args.power``, ``power`` (the GPUs' clock and power per variant,
    sampled on rank 0)."""
    names, call = list(fns), next(_TIME_ROUNDS_CALLS)
    power = {} if getattr(args, "power", False) and dist.rank() == 0 else None  # rank 0 sees every GPU
    tuning.settle(fns.values(), args.settle_ms, None, "cuda")
    calls = {name: tuning.calls_spanning(fn, args.min_ms, None, "cuda") for name, fn in fns.items()}  # once
    for k in range(args.rounds):
        for name in random.Random(f"{call}/{k}").sample(names, len(names)):
            ms = gpu_monitor.sampled(
                lambda name=name: time_ms(fns[name], args.iters, args.warmup, args.min_ms, calls[name]), power, name)
            row["ms_rounds"].setdefault(name, []).append(ms)
    row["ms"] = {name: statistics.median(row["ms_rounds"][name]) for name in names}
    row["spread"] = {name: max(r) / min(r) for name, r in row["ms_rounds"].items()}
    if power:
        row["power"] = {name: means for name, summaries in power.items()
                        if (means := gpu_monitor.power_means(summaries)) is not None}


def max_rel_err(got, want) -> float:
    err = torch.linalg.vector_norm(got.float() - want.float()) / torch.linalg.vector_norm(want.float())
    t = err.reshape(1)
    dist.all_reduce(t, None, op="max")
    return t.item()


def any_rank(flag: bool, device) -> bool:
    t = torch.tensor([float(flag)], device=device)
    dist.all_reduce(t, None, op="max")
    return bool(t.item())


def plan_segments(fd) -> list[str]:
    """The segment and CUDA-graph lines of ``str(fd.plan)`` (with tuning's measured choices)."""
    return [line.strip() for line in str(getattr(fd, "plan", "")).splitlines()
            if "segment" in line or "cuda graph" in line.lower()]


def run_shape(mode, tokens, hidden, ffn, args, device):
    n, r = dist.world_size(), dist.rank()
    if tokens % n or ffn % n:
        raise SystemExit(f"shape {tokens},{hidden},{ffn}: tokens and ffn must divide by {n} ranks")
    inp = make_inputs(tokens, hidden, ffn, n, r, device)
    fns, fd = (sp_variants if mode == "sp" else tp_variants)(tokens, hidden, ffn, n, inp, args.designs)
    names = list(fns)
    ref = fns[REFERENCE[mode]]()
    row = {"mode": mode, "tokens": tokens, "hidden": hidden, "ffn": ffn, "ms": {}, "ms_rounds": {},
           "rel_err": {}, "failed": {}}
    timed = []
    for name in names:
        if name.startswith("compute") or name == "comm_only":
            timed.append(name)  # other work: nothing to compare
            continue
        try:
            out = fns[name]()
            error = None
        except Exception as e:  # every rank raises alike for a shape a design cannot run
            out, error = None, f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
        if any_rank(error is not None, device):
            row["failed"][name] = error or "failed on another rank"
            continue
        row["rel_err"][name] = max_rel_err(out, ref)
        if row["rel_err"][name] > TOLERANCE:
            row["failed"][name] = f"relative error {row['rel_err'][name]:.2e} against {REFERENCE[mode]}"
            continue
        timed.append(name)
    row["plan"] = plan_segments(fd)
    time_rounds(row, {name: fns[name] for name in timed}, args)
    ms = row["ms"]
    ms["best_compute"] = min(ms["compute_unfused"], ms["compute_fused_epilogue"])
    base = ("best_compute", "nccl_sequential", "async_tp") if mode == "sp" else ("best_compute", "classic_tp")
    row["ratios"] = {f"{name}/{b}": ms[name] / ms[b] for name in timed if name.startswith(("tp_fusion", "design"))
                     for b in base if b in ms}
    return row, fns


def goals(rows) -> list[str]:
    """The issue's goals, checked on the sp rows (and 'never slower than sequential' on tp)."""
    out = []
    for row in rows:
        ms, shape = row["ms"], f"{row['mode']} {row['tokens']},{row['hidden']},{row['ffn']}"
        if "tp_fusion" not in ms:
            out.append(f"FAIL {shape}: tp_fusion did not run")
            continue
        seq = ms.get("nccl_sequential", ms.get("classic_tp"))
        checks = []
        if row["mode"] == "sp" and row["tokens"] >= 2048:
            checks += [("/best_compute", ms["tp_fusion"] / ms["best_compute"], 1.02)]
            if "async_tp" in ms:
                checks += [("/async_tp", ms["tp_fusion"] / ms["async_tp"], 0.97)]
        checks += [("/sequential", ms["tp_fusion"] / seq, 1.0 if row["tokens"] >= 2048 else 1.10)]
        spread = row["spread"]["tp_fusion"]
        note = f"; tp_fusion's rounds spread {spread:.2f}x, the fastest {min(row['ms_rounds']['tp_fusion']):.3f} ms" \
            if spread > SPREAD_FLAG else ""
        for what, ratio, limit in checks:
            out.append(f"{'ok  ' if ratio <= limit else 'MISS'} {shape} tp_fusion{what} {ratio:.3f} "
                       f"(goal <= {limit}{note if ratio > limit else ''})")
    return out


def print_table(rows, n):
    for mode in ("sp", "tp"):
        mine = [row for row in rows if row["mode"] == mode]
        if not mine:
            continue
        cols = ["best_compute"] + [c for c in mine[0]["ms"] if c != "best_compute"]
        print(f"\n{mode}: TP MLP forward, bf16, {n} GPUs, ms per iteration (max over ranks, median of rounds)")
        widths = [max(9, len(c)) for c in cols]
        print(f"{'tokens,hidden,ffn':>20} " + " ".join(f"{c:>{w}}" for c, w in zip(cols, widths)))
        for row in mine:
            cells = " ".join(f"{row['ms'][c]:{w}.3f}" if c in row["ms"] else f"{'-':>{w}}"
                             for c, w in zip(cols, widths))
            print(f"{row['tokens']:>6},{row['hidden']:>6},{row['ffn']:>6} {cells}")
        for row in mine:
            shape = f"{row['tokens']},{row['hidden']},{row['ffn']}"
            ratios = "  ".join(f"{k} {v:.3f}" for k, v in row["ratios"].items() if k.startswith("tp_fusion"))
            print(f"{shape:>20} {ratios}")
            for name, why in row["failed"].items():
                print(f"{'':>20} {name} FAILED: {why}")
            spread = {name: s for name, s in row.get("spread", {}).items() if s > SPREAD_FLAG}
            if spread:
                print(f"{'':>20} rounds spread (slowest / fastest) over {SPREAD_FLAG}: "
                      + ", ".join(f"{name} {s:.2f}" for name, s in spread.items()))
            for name, p in row.get("power", {}).items():
                print(f"{'':>20} {gpu_monitor.power_line(name, p)}")
            for line in row["plan"]:
                print(f"{'':>20} plan: {line}")


def draw(rows, machine, path):
    """Per mode: time / best_compute per variant and shape (labels: ms)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m for m in ("sp", "tp") if any(row["mode"] == m for row in rows)]
    fig, axes = plt.subplots(len(modes), 1, figsize=(14, 4.2 * len(modes)), squeeze=False)
    for ax, mode in zip(axes[:, 0], modes):
        mine = [row for row in rows if row["mode"] == mode]
        names = [c for c in (SP_VARIANTS if mode == "sp" else TP_VARIANTS)
                 if c not in ("comm_only", "compute_unfused", "compute_fused_epilogue")]
        names = ["best_compute", *names]
        width = 0.8 / len(names)
        for i, name in enumerate(names):
            vals = [row["ms"].get(name, math.nan) / row["ms"]["best_compute"] for row in mine]
            bars = ax.bar([j + i * width for j in range(len(mine))], vals, width, label=name)
            for bar, row in zip(bars, mine):
                if name in row["ms"]:
                    ax.annotate(f"{row['ms'][name]:.2f}", (bar.get_x() + width / 2, bar.get_height()),
                                ha="center", va="bottom", fontsize=6, rotation=90)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(mine))])
        ax.set_xticklabels([f"{r['tokens']}x{r['hidden']}x{r['ffn']}" for r in mine], fontsize=8)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_yscale("log")
        ax.set_ylabel("time / best compute (log; labels ms)")
        ax.set_title(f"{'sequence-parallel' if mode == 'sp' else 'plain TP'} MLP forward, bf16, {machine}", loc="left")
        ax.legend(fontsize=7, ncol=4)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)


PROFILE_WARMUP = 10  # back-to-back iterations before the traced ones: the clocks settle as in the timed loops


def profile(fns: dict, names, out_dir: str, tag: str, title: str) -> None:
    """Trace ``names`` of ``fns`` in the steady state the timed loops run in (``PROFILE_WARMUP``
    iterations back to back, then three traced ones, no barrier between); rank 0 prints where the time
    goes per rank and rank 0's kernels (appending to ``report.txt``) and draws the timelines."""
    from tp_fusion import profiling

    n, r = dist.world_size(), dist.rank()
    lines = []
    for name in [m for m in names if m in fns]:
        trace = os.path.join(out_dir, f"{tag}_{name}_rank{{}}.json")
        dist.barrier()
        profiling.profile_iterations(fns[name], trace.format(r), warmup=PROFILE_WARMUP)
        dist.barrier()
        if r == 0:
            traces = [trace.format(q) for q in range(n)]
            lines += [f"\n{name}, {tag}:", profiling.describe(traces)]
            try:
                profiling.plot_timeline(traces, os.path.join(out_dir, f"timeline_{tag}_{name}.png"),
                                        title=f"{name}: {title}, one iteration on {n} GPUs")
            except ImportError as e:
                lines.append(f"(no timeline: {e})")
    if r == 0:
        text = "\n".join(lines)
        print(text)
        with open(os.path.join(out_dir, "report.txt"), "a") as f:
            f.write(text + "\n")


def main(args: argparse.Namespace) -> int:
    unknown = sorted(set(args.designs or ()) - set(SP_DESIGNS) - set(TP_DESIGNS))
    if unknown:  # a design renamed or misspelt would otherwise time nothing, silently
        raise SystemExit(f"benchmarks/tp_mlp.py: --designs: no design named {', '.join(unknown)}; the designs are "
                         f"{', '.join(sorted({**SP_DESIGNS, **TP_DESIGNS}))}")
    if not torch.cuda.is_available():
        print("benchmarks/tp_mlp.py: this machine has no CUDA GPU, so there is nothing to measure; "
              "no results were written. Run it under torchrun on a machine with GPUs.")
        return 0
    from tp_fusion.launch import init_from_env

    device = init_from_env()
    n = dist.world_size()
    rows = []
    for mode, shapes in (("sp", args.sp), ("tp", args.tp)):
        profiled = args.profile_shapes if args.profile_shapes is not None else shapes[:1]
        for shape in shapes:
            row, fns = run_shape(mode, *shape, args, device)
            rows.append(row)
            if args.profile and shape in profiled:
                profile(fns, ("tp_fusion", "tp_fusion_kernels", "compute_fused_epilogue", REFERENCE[mode]),
                        args.profile, f"{mode}_{'x'.join(map(str, shape))}", f"{mode} MLP {shape}")
            del fns
            torch.cuda.empty_cache()
    if dist.rank() == 0:
        print_table(rows, n)
        checks = goals(rows)
        print("\ngoals:\n" + "\n".join(checks))
        slug = machine_slug(n)
        result = {"machine": f"{n}x {torch.cuda.get_device_name()}", "torch": torch.__version__,
                  "nccl": ".".join(map(str, torch.cuda.nccl.version())), "cuda": torch.version.cuda,
                  "date": datetime.date.today().isoformat(), "iters": args.iters, "warmup": args.warmup,
                  "min_ms": args.min_ms, "settle_ms": args.settle_ms, "rounds": args.rounds,
                  "tuning": dataclasses.asdict(overlap.DEFAULT_TUNING),
                  "designs": {k: dataclasses.asdict(v) for k, v in {**SP_DESIGNS, **TP_DESIGNS}.items()}
                  if args.designs is not None else {}, "goals": checks, "shapes": rows}
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"{slug}.json"), "w") as f:
            json.dump(result, f, indent=1)
        try:
            draw(rows, result["machine"], os.path.join(args.out, f"tp_mlp_{slug}.png"))
        except ImportError:
            print("no chart: matplotlib is not installed")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
