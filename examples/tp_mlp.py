"""The tensor-parallel nanoGPT MLP, written with tp_fusion and validated against aten.

    python examples/tp_mlp.py                        # 2 CPU ranks with gloo, both modes
    python examples/tp_mlp.py --mode sp --nproc 4
    torchrun --nproc_per_node=2 examples/tp_mlp.py --dtype bf16 --tokens 2048 --hidden 1024

``--explain`` also prints the plan's summary (bytes per rank, FLOPs, fused segments);
``--profile DIR`` writes a torch.profiler Chrome trace per rank (``DIR/trace_rank{r}.json``) and a
timeline of one iteration (``DIR/timeline.png``, needs matplotlib) for the sp mode (or --mode).

``--mode tp``: replicated input and output, one allreduce (Megatron). ``--mode sp``: input and
output sharded on tokens (sequence parallel): allgather, then reduce_scatter. Under torchrun the
given ranks are used (CUDA with NCCL when there are GPUs); run plainly, it spawns CPU ranks.
Every rank checks its output shard against the unsharded MLP computed with aten.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from examples.cli import add_inspect_options, add_run_options, check_sizes, parser, world_size  # noqa: E402

MODES = {"tp": ("tp",), "sp": ("sp",), "both": ("tp", "sp")}


def parse_args(argv=None) -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument("--mode", choices=tuple(MODES), default="both",
                   help="tp: replicated input and output (allreduce); sp: sharded on tokens; or both")
    p.add_argument("--tokens", type=int, default=64,
                   help="tokens (rows of the input; sp mode: sharded, so a multiple of the number of ranks)")
    p.add_argument("--hidden", type=int, default=32,
                   help="hidden size; the MLP's inner size, 4x, is sharded, so a multiple of the number of ranks")
    add_run_options(p, nproc=2)
    add_inspect_options(p)
    args = p.parse_args(argv)
    n, ranks = world_size(args.nproc)
    multiples = [("the MLP's inner size (4 x --hidden)", 4 * args.hidden, ranks, n)]
    if "sp" in MODES[args.mode]:
        multiples.append(("--tokens", args.tokens, ranks, n))
    check_sizes(p, {"--tokens": args.tokens, "--hidden": args.hidden, ranks: n}, multiples)
    return args


if __name__ == "__main__":
    ARGS = parse_args()  # before torch is imported: --help answers at once

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from examples.common import DTYPES, execute_and_check, profile  # noqa: E402
from tp_fusion import DataType, DeviceMesh, FusionDefinition, ParallelType  # noqa: E402
from tp_fusion.launch import run_program  # noqa: E402

EXPECTED_COLLECTIVES = {"tp": ["allreduce"], "sp": ["allgather", "reduce_scatter"]}


def define_mlp(tokens: int, hidden: int, d: int, mode: str, dtype: DataType) -> FusionDefinition:
    """linear(h -> 4h, bias) -> GELU(tanh) -> linear(4h -> h, bias), sharded over ``d`` ranks."""
    ffn = 4 * hidden
    mesh = DeviceMesh(range(d))
    with FusionDefinition() as fd:
        x = fd.define_tensor([tokens, hidden], dtype=dtype)
        w1 = fd.define_tensor([ffn, hidden], dtype=dtype)
        b1 = fd.define_tensor([ffn], dtype=dtype)
        w2 = fd.define_tensor([hidden, ffn], dtype=dtype)
        b2 = fd.define_tensor([hidden], dtype=dtype)
        y = fd.ops.gelu(fd.ops.linear(x, w1, b1), approximate="tanh")
        z = fd.ops.linear(y, w2, b2)
        fd.add_output(z)

        for tv in (x, w1, b1, w2, b2, z):
            tv.set_device_mesh(mesh)
        for tv in (w1, b1):  # column-parallel
            tv.outer_split(0, d)
            tv.axis(0).parallelize(ParallelType.mesh_x)
        w2.outer_split(1, d)  # row-parallel
        w2.axis(1).parallelize(ParallelType.mesh_x)
        if mode == "sp":  # tokens sharded in and out
            for tv in (x, z):
                tv.outer_split(0, d)
                tv.axis(0).parallelize(ParallelType.mesh_x)
    return fd


def reference_inputs(tokens: int, hidden: int, dtype: torch.dtype, device) -> list[torch.Tensor]:
    """Identical full inputs on every rank (seeded). Small values keep bf16 errors readable."""
    g = torch.Generator().manual_seed(1234)
    shapes = ([tokens, hidden], [4 * hidden, hidden], [4 * hidden], [hidden, 4 * hidden], [hidden])
    scales = (1.0, hidden ** -0.5, 0.1, (4 * hidden) ** -0.5, 0.1)
    return [(torch.randn(s, generator=g) * k).to(dtype).to(device) for s, k in zip(shapes, scales)]


def reference_mlp(x, w1, b1, w2, b2) -> torch.Tensor:
    """The unsharded MLP in float64 (the aten reference)."""
    x, w1, b1, w2, b2 = (t.double() for t in (x, w1, b1, w2, b2))
    return F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2, b2)


def run_mode(rank: int, world: int, args, mode: str, device) -> float:
    torch_dtype, dtype = DTYPES[args.dtype]
    fd = define_mlp(args.tokens, args.hidden, world, mode, dtype)
    full = reference_inputs(args.tokens, args.hidden, torch_dtype, device)
    title = f"mode {mode}: {world} ranks, tokens {args.tokens}, hidden {args.hidden}, {args.dtype}"
    local, error = execute_and_check(rank, fd, full, reference_mlp(*full), title, EXPECTED_COLLECTIVES[mode],
                                     explain=getattr(args, "explain", False))
    if getattr(args, "profile", None) and mode == profiled_mode(args):
        profile(rank, world, lambda: fd.execute(local), Path(args.profile),
                f"tp_mlp --mode {mode}: one iteration on {world} ranks")
    return error


def profiled_mode(args) -> str:
    return "sp" if args.mode == "both" else args.mode


def main_on_rank(rank: int, world: int, args, device=None) -> None:
    device = device or torch.device("cpu")
    modes = MODES[args.mode]
    for mode in modes:
        run_mode(rank, world, args, mode, device)
    if rank == 0:
        print(f"OK: {', '.join(modes)} {'match' if len(modes) > 1 else 'matches'} the aten reference on every rank")


if __name__ == "__main__":
    run_program(main_on_rank, ARGS, ARGS.nproc)
