"""A GPT-style transformer layer, bf16, forward and forward+backward: tp_fusion against the baselines.

Run on one node with GPUs:  torchrun --nproc_per_node=N benchmarks/transformer_layer.py [--shapes T,H ...]
        [--modes tp sp] [--passes fwd fwd_bwd] [--variants ...] [--compile-shapes T,H ...] [--seq 4096]
        [--head-dim 128] [--iters 10] [--warmup 3] [--min-ms 100] [--settle-ms 3000] [--rounds 3] [--power]
        [--out benchmarks/results]
Check the variants on CPU ranks (gloo, tiny shapes, nothing timed or written):
        python benchmarks/transformer_layer.py --check

The layer is examples/transformer_layer.py's (layer_norm, QKV linear column-parallel with heads
sharded, causal flash attention, out-projection row-parallel, residual, layer_norm, linear, tanh-GELU,
linear, residual; ``tokens`` rows = tokens/seq sequences of ``--seq``, heads = hidden/head_dim, MLP
4x hidden). Modes: ``tp`` (replicated activations, allreduce after the out-projection and after the
MLP) and ``sp`` (activations sharded on tokens: allgather before QKV and the MLP, reduce_scatter
after the out-projection and the MLP). Passes: ``fwd`` and ``fwd_bwd`` (forward, then backward of a
given output gradient).

Variants, all on the same seeded weights (each rank holds its shards):
- compute_eager, compute_epilogue (fwd: fc1's bias and GELU in the GEMM's epilogue),
  compute_compiled (torch.compile): one rank's local work with no communication (every GEMM on all
  tokens with the rank's heads / MLP columns; in sp the layer norms and residuals on its rows, and its
  rows repeated where the allgathers would give all rows);
  ``best_compute`` is the smallest, the yardstick;
- nccl_sequential: the same local work with the NCCL collectives in between (Megatron-style autograd);
- pytorch_tp: ``parallelize_module`` with ColwiseParallel / RowwiseParallel (and SequenceParallel
  layer norms in sp), eager; pytorch_tp_compiled: the same under torch.compile, with async-TP
  (inductor's micro-pipeline TP on symmetric memory) enabled in sp;
- tp_fusion: the example's inference forward fusion (``define_forward(training=False)``: only the
  output, like the others under no_grad) through ``fd.execute`` (fwd), and its
  ``tp_fusion.autograd`` Function, forward then backward (fwd_bwd).
torch.compile costs tens of seconds per shape, mode and pass, so the compiled variants run only on
``--compile-shapes`` (default 8192,8192), and compute_compiled only when ``--variants`` names it.
Every variant is checked against nccl_sequential (output; for fwd_bwd also the gradients of the
input, the QKV weight shard and the fc2 weight shard) before it is timed; one that disagrees, or
that fails (e.g. torch.compile where it cannot run), is reported and not timed.

Timing: tp_fusion's timer (CUDA events around ``--iters`` calls after ``--warmup``, each at least
``--min-ms`` long), max over ranks, median of ``--rounds`` rounds, each in its own random order,
after ``--settle-ms`` of every variant untimed (``benchmarks.tp_mlp.time_rounds``).
Results go to ``{out}/transformer_layer_{gpu}x{N}.json``, named after the machine the run is on,
after every row (a run cut short keeps what it measured); rows of an earlier run on the same machine
are kept unless this run measured the same row again.
Without a CUDA GPU (and without --check) it says so and exits 0.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from examples.cli import add_timing_options, parser  # noqa: E402

SHAPES = ((4096, 4096), (8192, 4096), (16384, 4096), (4096, 8192), (8192, 8192), (16384, 8192))
VARIANTS = ("compute_eager", "compute_epilogue", "compute_compiled", "nccl_sequential", "pytorch_tp",
            "pytorch_tp_compiled", "tp_fusion")
# torch.compile takes tens of seconds per shape, mode and pass: by default only pytorch_tp_compiled, on
# one shape, so that the default run stays within ten minutes on 2 GPUs.
DEFAULT_VARIANTS = tuple(v for v in VARIANTS if v != "compute_compiled")
COMPILE_SHAPES = ((8192, 8192),)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv=None) -> argparse.Namespace:
    p = parser(__doc__)
    shape = lambda s: tuple(int(v) for v in s.split(","))  # noqa: E731
    p.add_argument("--shapes", nargs="*", type=shape, default=list(SHAPES), help="tokens,hidden pairs")
    p.add_argument("--modes", nargs="*", choices=("tp", "sp"), default=["sp", "tp"], help="parallel modes")
    p.add_argument("--passes", nargs="*", choices=("fwd", "fwd_bwd"), default=["fwd", "fwd_bwd"],
                   help="forward only, forward+backward")
    p.add_argument("--variants", nargs="*", choices=VARIANTS, default=list(DEFAULT_VARIANTS), help="what to time")
    p.add_argument("--compile-shapes", nargs="*", type=shape, default=list(COMPILE_SHAPES),
                   help="tokens,hidden pairs on which the torch.compile variants run (slow to compile)")
    p.add_argument("--seq", type=int, default=4096, help="sequence length (tokens = batch x seq)")
    p.add_argument("--head-dim", type=int, default=128, help="attention head dim (heads = hidden / head_dim)")
    add_timing_options(p, iters=10, warmup=3, rounds=3)
    p.add_argument("--power", action="store_true",
                   help="also sample the GPUs' SM clock and power (nvidia-smi) while each variant is timed")
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results"), help="results folder")
    p.add_argument("--profile", metavar="DIR",
                   help="also trace tp_fusion, the compute variants and NCCL sequential of every row (steady "
                        "state); reports, kernel tables and timelines in DIR")
    p.add_argument("--check", action="store_true",
                   help="check every variant but the compiled ones on 2 spawned CPU ranks at tiny shapes, float32")
    return p.parse_args(argv)


if __name__ == "__main__":
    ARGS = parse_args()  # before torch is imported: --help answers at once

import datetime  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks import gpu_monitor  # noqa: E402
from benchmarks.tp_mlp import any_rank, machine_slug, max_rel_err, plan_segments, profile, time_rounds  # noqa: E402
from examples.transformer_layer import EPS, INPUTS, Config, define_forward, transformer_layer_function  # noqa: E402
from tp_fusion import DataType  # noqa: E402
from tp_fusion.runtime import dist  # noqa: E402

REFERENCE = "nccl_sequential"
TOLERANCE = 3e-2  # relative error (norm) against the reference, bf16
CHECKED_GRADS = ("x", "qkv_w", "fc2_w")  # gradients compared in fwd_bwd (local shards)
COLUMN = ("qkv_w", "qkv_b", "fc1_w", "fc1_b")  # sharded on dim 0; out_w, fc2_w on dim 1; the rest replicated
ROW = ("out_w", "fc2_w")


@dataclass(frozen=True)
class Shape:
    mode: str
    tokens: int
    hidden: int
    seq: int
    head_dim: int
    n: int  # ranks

    @property
    def heads(self) -> int:
        return self.hidden // self.head_dim


# --------------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------------

def make_tensors(s: Shape, dtype, device) -> tuple[dict, dict]:
    """Seeded full tensors (identical on every rank), and this rank's shards of them."""
    cfg = Config(s.tokens, s.seq, s.hidden, s.heads, s.n, s.mode, DataType.from_torch(dtype))
    gen = torch.Generator(device).manual_seed(0)
    scale = {"qkv_w": s.hidden ** -0.5, "out_w": s.hidden ** -0.5, "fc1_w": s.hidden ** -0.5,
             "fc2_w": (4 * s.hidden) ** -0.5, "x": 1.0}
    full = {}
    for name in (*INPUTS, "grad_out"):
        shape = cfg.shape("x" if name == "grad_out" else name)
        r = torch.randn(shape, device=device, generator=gen)
        full[name] = (1.0 + 0.1 * r if name in ("ln0_w", "ln1_w") else r * scale.get(name, 0.1)).to(dtype)
    r = dist.rank()
    local = {}
    for name, t in full.items():
        if name in COLUMN:
            t = t.chunk(s.n)[r]
        elif name in ROW:
            t = t.chunk(s.n, dim=1)[r]
        elif name in ("x", "grad_out") and s.mode == "sp":
            t = t.chunk(s.n)[r]
        local[name] = t.contiguous()
    return full, local


def params(local: dict, names=INPUTS) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(local[n].clone()) for n in names]


# --------------------------------------------------------------------------------------------------
# The local work, with or without collectives (compute_*, nccl_sequential)
# --------------------------------------------------------------------------------------------------

class _Comm(torch.autograd.Function):
    """``forward(x)`` in the forward pass, ``backward(grad)`` in the backward pass."""

    @staticmethod
    def forward(ctx, x, forward, backward):
        ctx.backward_fn = backward
        return forward(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.backward_fn(grad.contiguous()), None, None


def _allgather(x):
    out = x.new_empty((x.shape[0] * dist.world_size(), *x.shape[1:]))
    dist.all_gather(out, x.contiguous(), None)
    return out


def _reduce_scatter(x):
    out = x.new_empty((x.shape[0] // dist.world_size(), *x.shape[1:]))
    dist.reduce_scatter(out, x.contiguous(), None)
    return out


def _allreduce(x):
    dist.all_reduce(x, None)
    return x


def _rows(x):
    """This rank's rows of ``x`` (what reduce_scatter leaves, without the reduction)."""
    return x.chunk(dist.world_size())[dist.rank()]


def _repeated_rows(x):
    """``x`` repeated to the row count an allgather gives, without communicating: the compute variants'
    stand-in for the gathered rows (and for the gradient of ``_rows``). Its rows hold data, not zeros: a
    GEMM on rows half of zeros draws less power and runs faster: the sp forward's yardstick of rounds
    4-6, which padded with zeros, took 9.95 ms at 8192x8192 where tp's, the same GEMMs on data, took 11.33."""
    return x.repeat(dist.world_size(), *[1] * (x.dim() - 1))


def _identity(x):
    return x


# (enter, leave): the (forward, backward) collectives before QKV / fc1 and after the out-projection /
# fc2. compute_*: the same shapes without communication (None: nothing to do).
COMMS = {
    ("sequential", "tp"): ((_identity, _allreduce), (_allreduce, _identity)),
    ("sequential", "sp"): ((_allgather, _reduce_scatter), (_reduce_scatter, _allgather)),
    ("compute", "tp"): (None, None),
    ("compute", "sp"): ((_repeated_rows, _rows), (_rows, _repeated_rows)),
}


def _comm(pair):
    return _identity if pair is None else (lambda t: _Comm.apply(t, *pair))


def local_layer(x, w: dict, s: Shape, comm: str, epilogue: bool = False):
    """The layer on this rank's shards ``w``; ``x`` is replicated (tp) or this rank's rows (sp)."""
    enter, leave = map(_comm, COMMS[comm, s.mode])
    t, e, dh = s.tokens, s.hidden, s.head_dim
    ln0 = enter(F.layer_norm(x, (e,), w["ln0_w"], w["ln0_b"], EPS))
    qkv = F.linear(ln0, w["qkv_w"], w["qkv_b"]).view(t // s.seq, s.seq, -1, 3 * dh).transpose(1, 2)
    q, k, v = qkv.chunk(3, dim=-1)
    attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(t, -1)
    res1 = x + leave(F.linear(attn, w["out_w"])) + w["out_b"]
    ln1 = enter(F.layer_norm(res1, (e,), w["ln1_w"], w["ln1_b"], EPS))
    if epilogue:
        hidden = torch._addmm_activation(w["fc1_b"], ln1, w["fc1_w"].t(), use_gelu=True)
    else:
        hidden = F.gelu(F.linear(ln1, w["fc1_w"], w["fc1_b"]), approximate="tanh")
    return res1 + leave(F.linear(hidden, w["fc2_w"])) + w["fc2_b"]


# --------------------------------------------------------------------------------------------------
# PyTorch tensor parallelism
# --------------------------------------------------------------------------------------------------

class TorchLayer(torch.nn.Module):
    """The layer as torch modules, for ``parallelize_module`` (heads per rank read off the QKV output)."""

    def __init__(self, full: dict, s: Shape):
        super().__init__()
        e, like = s.hidden, {"device": full["x"].device, "dtype": full["x"].dtype}
        self.s = s
        self.ln0, self.ln1 = torch.nn.LayerNorm(e, eps=EPS, **like), torch.nn.LayerNorm(e, eps=EPS, **like)
        self.qkv, self.out = torch.nn.Linear(e, 3 * e, **like), torch.nn.Linear(e, e, **like)
        self.fc1, self.fc2 = torch.nn.Linear(e, 4 * e, **like), torch.nn.Linear(4 * e, e, **like)
        with torch.no_grad():
            for module, prefix in ((self.ln0, "ln0"), (self.qkv, "qkv"), (self.out, "out"), (self.ln1, "ln1"),
                                   (self.fc1, "fc1"), (self.fc2, "fc2")):
                module.weight.copy_(full[f"{prefix}_w"])
                module.bias.copy_(full[f"{prefix}_b"])

    def forward(self, x):
        s = self.s
        t = s.tokens
        qkv = self.qkv(self.ln0(x))
        qkv = qkv.view(t // s.seq, s.seq, -1, 3 * s.head_dim).transpose(1, 2)
        q, k, v = qkv.chunk(3, dim=-1)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(t, -1)
        res1 = x + self.out(attn)
        return res1 + self.fc2(F.gelu(self.fc1(self.ln1(res1)), approximate="tanh"))


@functools.cache
def _torch_mesh(device_type: str, n: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (n,))


def pytorch_tp_layer(full: dict, s: Shape, device):
    """``TorchLayer`` parallelized with torch's TP styles (SequenceParallel layer norms in sp)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    mesh = _torch_mesh(device.type, s.n)
    if s.mode == "tp":
        plan = {"qkv": ColwiseParallel(), "out": RowwiseParallel(), "fc1": ColwiseParallel(),
                "fc2": RowwiseParallel()}
    else:
        rows = Shard(0)
        plan = {"ln0": SequenceParallel(sequence_dim=0, use_local_output=False),
                "qkv": ColwiseParallel(input_layouts=rows), "out": RowwiseParallel(output_layouts=rows),
                "ln1": SequenceParallel(sequence_dim=0, use_local_output=False),
                "fc1": ColwiseParallel(input_layouts=rows), "fc2": RowwiseParallel(output_layouts=rows)}
    return parallelize_module(TorchLayer(full, s), mesh, plan)


def enable_async_tp() -> str:
    """Turn on inductor's micro-pipeline TP (PyTorch async-TP) for what torch.compile compiles next, and
    symmetric memory for the default group. It rewrites only allgather+matmul and matmul+reduce_scatter,
    so the other compiled variants (no collectives; tp's allreduce) are unaffected. Returns what was
    enabled, for the results."""
    import torch._inductor.config as inductor_config
    import torch.distributed as tdist

    inductor_config._micro_pipeline_tp = True
    try:  # needed up to torch 2.11 or so; later versions enable symmetric memory on their own
        from torch.distributed._symmetric_memory import enable_symm_mem_for_group

        enable_symm_mem_for_group(tdist.group.WORLD.group_name)
    except (ImportError, AttributeError) as e:
        return f"micro_pipeline_tp (enable_symm_mem_for_group unavailable: {e})"
    return "micro_pipeline_tp + enable_symm_mem_for_group"


# --------------------------------------------------------------------------------------------------
# Variants
# --------------------------------------------------------------------------------------------------

def _module_grads(module, names) -> dict:
    """Local gradients of the named TorchLayer weights (``qkv_w`` -> module.qkv.weight)."""
    out = {}
    for n in names:
        g = getattr(module, n.split("_")[0]).weight.grad
        out[n] = g.to_local() if hasattr(g, "to_local") else g
    return out


def variants(s: Shape, full: dict, local: dict, pass_: str, names, device, fusions: dict) -> dict:
    """name -> a maker: a zero-argument function that builds the variant and returns its run, a
    zero-argument callable returning {"out": this rank's output, and in fwd_bwd the checked gradients}.
    The tp_fusion maker leaves its forward and backward fusions in ``fusions``."""
    x_in, grad_out = local["x"], local["grad_out"]

    def backward_run(fn, x, weights: dict, grads_of):
        def run():
            x.grad = None
            for p in weights.values():
                p.grad = None
            out = fn(x)
            out.backward(grad_out)
            return {"out": out.detach(), "x": x.grad, **grads_of()}
        return run

    def forward_run(fn):
        def run():
            with torch.no_grad():
                return {"out": fn(x_in)}
        return run

    def plain(comm, epilogue=False, compiled=False):
        ws = dict(zip(INPUTS[1:], params(local, INPUTS[1:])))
        fn = lambda x: local_layer(x, ws, s, comm, epilogue)  # noqa: E731
        fn = torch.compile(fn) if compiled else fn
        if pass_ == "fwd":
            return forward_run(fn)
        grads = lambda: {n: ws[n].grad for n in CHECKED_GRADS[1:]}  # noqa: E731
        return backward_run(fn, torch.nn.Parameter(x_in.clone()), ws, grads)

    def torch_tp(compiled=False):
        module = pytorch_tp_layer(full, s, device)
        fn = torch.compile(module) if compiled else module
        if pass_ == "fwd":
            return forward_run(fn)
        weights = dict(module.named_parameters())
        return backward_run(fn, torch.nn.Parameter(x_in.clone()), weights,
                            lambda: _module_grads(module, CHECKED_GRADS[1:]))

    def fusion():
        cfg = Config(s.tokens, s.seq, s.hidden, s.heads, s.n, s.mode, DataType.from_torch(x_in.dtype))
        if pass_ == "fwd":  # an inference forward, as the others' under no_grad: it keeps nothing
            inference = fusions["forward"] = define_forward(cfg, training=False)
            inputs = [local[n] for n in INPUTS]
            return lambda: {"out": inference.execute(inputs)[0]}
        layer, forward, backward = transformer_layer_function(cfg)
        fusions.update(forward=forward, backward=backward)
        x, *ps = params(local)
        weights = dict(zip(INPUTS[1:], ps))
        return backward_run(lambda x: layer.apply(x, *ps), x, weights,
                            lambda: {n: weights[n].grad for n in CHECKED_GRADS[1:]})

    makers = {"compute_eager": lambda: plain("compute"),
              "compute_epilogue": lambda: plain("compute", epilogue=True),
              "compute_compiled": lambda: plain("compute", compiled=True),
              "nccl_sequential": lambda: plain("sequential"),
              "pytorch_tp": lambda: torch_tp(),
              "pytorch_tp_compiled": lambda: torch_tp(compiled=True),
              "tp_fusion": fusion}
    # torch._addmm_activation has no backward: compute_epilogue is forward only.
    return {n: makers[n] for n in names if not (n == "compute_epilogue" and pass_ == "fwd_bwd")}


# --------------------------------------------------------------------------------------------------
# Measuring
# --------------------------------------------------------------------------------------------------

def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:300] if text else ''}"


def run_row(s: Shape, pass_: str, args, device, dtype, timed_run: bool) -> dict:
    """Build, check and (``timed_run``) time every variant of one shape, mode and pass."""
    full, local = make_tensors(s, dtype, device)
    compiles = (s.tokens, s.hidden) in args.compile_shapes
    names = [REFERENCE, *[v for v in args.variants if v != REFERENCE and (compiles or "compiled" not in v)]]
    fusions = {}
    makers = variants(s, full, local, pass_, names, device, fusions)
    row = {"mode": s.mode, "pass": pass_, "tokens": s.tokens, "hidden": s.hidden, "seq": s.seq,
           "heads": s.heads, "ms": {}, "ms_rounds": {}, "rel_err": {}, "failed": {}}
    fns, ref = {}, None
    for name, make in makers.items():
        try:
            fn = make()
            out = fn()
            error = None
        except Exception as e:  # every rank fails alike where a variant cannot run (e.g. torch.compile)
            out, error = None, _first_line(e)
        if any_rank(error is not None, device):
            row["failed"][name] = error or "failed on another rank"
            continue
        if name == REFERENCE:
            ref = out
        elif ref is None and not name.startswith("compute"):
            row["failed"][name] = f"not checked: {REFERENCE} failed"
            continue
        elif not name.startswith("compute"):
            errs = {k: max_rel_err(out[k], ref[k]) for k in ref}
            row["rel_err"][name] = errs
            worst = max(errs, key=errs.get)
            if errs[worst] > TOLERANCE:
                row["failed"][name] = f"{worst}: relative error {errs[worst]:.2e} against {REFERENCE}"
                continue
        fns[name] = fn
    row["plan"] = {what: plan_segments(fd) for what, fd in fusions.items() if fd.plan is not None}
    if timed_run:
        time_rounds(row, fns, args)
        ms = row["ms"]
        computes = [v for k, v in ms.items() if k.startswith("compute")]
        if computes:
            ms["best_compute"] = min(computes)
        row["ratios"] = {f"tp_fusion/{b}": ms["tp_fusion"] / ms[b] for b in
                         ("best_compute", "nccl_sequential", "pytorch_tp", "pytorch_tp_compiled")
                         if "tp_fusion" in ms and b in ms}
    if timed_run and args.profile:
        profile(fns, ("tp_fusion", "compute_epilogue", "compute_eager", REFERENCE), args.profile,
                f"{s.mode}_{pass_}_{s.tokens}x{s.hidden}", f"{s.mode} {pass_} layer {s.tokens}x{s.hidden}")
    return row


def goals(rows) -> list[str]:
    """The issue's goals: forward within 1.05x of the best compute, faster than PyTorch TP (both modes)."""
    out = []
    for row in rows:
        ms, shape = row["ms"], f"{row['mode']} {row['pass']} {row['tokens']},{row['hidden']}"
        if "tp_fusion" not in ms:
            out.append(f"FAIL {shape}: tp_fusion did not run")
            continue
        checks = [(f"/{b}", ms["tp_fusion"] / ms[b], 1.0) for b in ("pytorch_tp", "pytorch_tp_compiled") if b in ms]
        if row["pass"] == "fwd" and "best_compute" in ms:
            checks.insert(0, ("/best_compute", ms["tp_fusion"] / ms["best_compute"], 1.05))
        for what, ratio, limit in checks:
            out.append(f"{'ok  ' if ratio <= limit else 'MISS'} {shape} tp_fusion{what} {ratio:.3f} (goal <= {limit})")
    return out


def print_table(rows, n):
    for mode in ("sp", "tp"):
        for pass_ in ("fwd", "fwd_bwd"):
            mine = [row for row in rows if row["mode"] == mode and row["pass"] == pass_]
            if not mine:
                continue
            cols = ["best_compute", *[v for v in VARIANTS if any(v in row["ms"] for row in mine)]]
            print(f"\n{mode} {pass_}: transformer layer, bf16, {n} GPUs, ms per iteration (max over ranks, "
                  "median of rounds)")
            widths = [max(9, len(c)) for c in cols]
            print(f"{'tokens,hidden':>14} " + " ".join(f"{c:>{w}}" for c, w in zip(cols, widths)))
            for row in mine:
                cells = " ".join(f"{row['ms'][c]:{w}.3f}" if c in row["ms"] else f"{'-':>{w}}"
                                 for c, w in zip(cols, widths))
                print(f"{row['tokens']:>7},{row['hidden']:>6} {cells}")
            for row in mine:
                shape = f"{row['tokens']},{row['hidden']}"
                print(f"{shape:>14} " + "  ".join(f"{k} {v:.3f}" for k, v in row.get("ratios", {}).items()))
                for name, why in row["failed"].items():
                    print(f"{'':>14} {name} FAILED: {why}")
                for name, p in row.get("power", {}).items():
                    print(f"{'':>14} {gpu_monitor.power_line(name, p)}")
                for what, lines in row["plan"].items():
                    for line in lines:
                        print(f"{'':>14} {what} plan: {line}")


def save(rows, args, n) -> str:
    """Write (merge into) ``{out}/transformer_layer_{machine}.json``, with the goals checked on every row
    it then holds; returns its path."""
    path = os.path.join(args.out, f"transformer_layer_{machine_slug(n)}.json")
    key = lambda row: (row["mode"], row["pass"], row["tokens"], row["hidden"], row["seq"])  # noqa: E731
    old = []
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f).get("shapes", [])
    measured = {key(row) for row in rows}
    merged = [row for row in old if key(row) not in measured] + rows
    result = {"machine": f"{n}x {torch.cuda.get_device_name()}", "torch": torch.__version__,
              "nccl": ".".join(map(str, torch.cuda.nccl.version())), "cuda": torch.version.cuda,
              "date": datetime.date.today().isoformat(), "iters": args.iters, "warmup": args.warmup,
              "min_ms": args.min_ms, "settle_ms": args.settle_ms, "rounds": args.rounds, "goals": goals(merged),
              "shapes": merged}
    os.makedirs(args.out, exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    return path


def shapes_of(args, n: int) -> list[Shape]:
    out = []
    for mode in args.modes:
        for tokens, hidden in args.shapes:
            s = Shape(mode, tokens, hidden, min(args.seq, tokens), args.head_dim, n)
            if tokens % s.seq or hidden % args.head_dim or s.heads % n or tokens % n:
                raise SystemExit(f"shape {tokens},{hidden}: tokens must be a multiple of --seq {s.seq} and of {n} "
                                 f"ranks, hidden of --head-dim {args.head_dim}, and the heads of {n}")
            out.append(s)
    return out


def check_on_rank(rank: int, world: int, args) -> None:
    """--check: every variant but the compiled ones, at tiny shapes in float32 on CPU, against the reference."""
    args.shapes, args.seq, args.head_dim = [(16, 32)], 8, 8
    args.variants = [v for v in args.variants if "compiled" not in v]
    rows = [run_row(s, p, args, torch.device("cpu"), torch.float32, timed_run=False)
            for s in shapes_of(args, world) for p in args.passes]
    if rank == 0:
        for row in rows:
            print(f"{row['mode']} {row['pass']}: checked against {REFERENCE}: "
                  + ", ".join(f"{name} {max(e.values()):.1e}" for name, e in row["rel_err"].items()))
    failed = {f"{row['mode']} {row['pass']} {name}": why for row in rows for name, why in row["failed"].items()}
    if failed:
        raise SystemExit(f"rank {rank}: variants failed: {failed}")
    if rank == 0:
        print("OK: every variant agrees with nccl_sequential")


def main(args) -> int:
    if args.check:
        from tp_fusion.launch import run_on_ranks

        run_on_ranks(check_on_rank, 2, args)
        return 0
    if not torch.cuda.is_available():
        print("benchmarks/transformer_layer.py: this machine has no CUDA GPU, so there is nothing to measure; "
              "no results were written. Run it under torchrun on a machine with GPUs (or --check on CPUs).")
        return 0
    from tp_fusion.launch import init_from_env

    device = init_from_env()
    n = dist.world_size()
    async_tp = enable_async_tp() if "pytorch_tp_compiled" in args.variants and "sp" in args.modes else "off"
    rows, path = [], None
    for s in shapes_of(args, n):
        for pass_ in args.passes:
            row = run_row(s, pass_, args, device, torch.bfloat16, timed_run=True)
            row["async_tp"] = async_tp  # per row: a file merges the rows of several runs
            rows.append(row)
            torch._dynamo.reset()  # else later shapes exceed dynamo's recompile limit and silently run eager
            torch.cuda.empty_cache()
            if dist.rank() == 0:  # saved row by row: a run cut short keeps what it measured
                path = save(rows, args, n)
                print(f"{s.mode} {pass_} {s.tokens},{s.hidden}: "
                      + ", ".join(f"{k} {v:.3f}" for k, v in row["ms"].items()), flush=True)
    if dist.rank() == 0:
        print_table(rows, n)
        print("\ngoals:\n" + "\n".join(goals(rows)))
        print(f"\nwrote {path}")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
