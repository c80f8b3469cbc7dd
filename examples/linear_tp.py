"""Column- and row-parallel linear layers, written with tp_fusion and validated against aten.

    python examples/linear_tp.py                     # 2 CPU ranks with gloo, both layers
    python examples/linear_tp.py --mode row --nproc 4
    torchrun --nproc_per_node=2 examples/linear_tp.py --dtype bf16 --tokens 2048 --in-features 1024

``--mode column``: the weight and bias are sharded on the out features; each rank computes its
columns of the output and no communication is needed. ``--mode row``: the input and the weight
are sharded on the in features; each rank computes a partial product, an allreduce sums them
and the bias is added once, after the sum. Under torchrun the given ranks are used (CUDA with
NCCL when there are GPUs); run plainly, it spawns CPU ranks. Every rank checks its output shard
against the unsharded ``torch.nn.functional.linear``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from examples.cli import add_run_options, check_sizes, parser, world_size  # noqa: E402

MODES = {"column": ("column",), "row": ("row",), "both": ("column", "row")}


def parse_args(argv=None) -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument("--mode", choices=tuple(MODES), default="both",
                   help="column- or row-parallel linear, or both")
    p.add_argument("--tokens", type=int, default=16, help="rows of the input")
    p.add_argument("--in-features", type=int, default=32,
                   help="input features (row mode: sharded, so a multiple of the number of ranks)")
    p.add_argument("--out-features", type=int, default=48,
                   help="output features (column mode: sharded, so a multiple of the number of ranks)")
    add_run_options(p, nproc=2)
    args = p.parse_args(argv)
    n, ranks = world_size(args.nproc)
    sharded = {"column": [("--out-features", args.out_features)], "row": [("--in-features", args.in_features)]}
    check_sizes(p, {"--tokens": args.tokens, "--in-features": args.in_features,
                    "--out-features": args.out_features, ranks: n},
                [(flag, value, ranks, n) for mode in MODES[args.mode] for flag, value in sharded[mode]])
    return args


if __name__ == "__main__":
    ARGS = parse_args()  # before torch is imported: --help answers at once

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from examples.common import DTYPES, execute_and_check  # noqa: E402
from tp_fusion import DataType, DeviceMesh, FusionDefinition, ParallelType  # noqa: E402
from tp_fusion.launch import run_program  # noqa: E402

EXPECTED_COLLECTIVES = {"column": [], "row": ["allreduce"]}


def define_linear(tokens: int, in_f: int, out_f: int, d: int, mode: str, dtype: DataType) -> FusionDefinition:
    """y = x @ w.T + b over ``d`` ranks, column- or row-parallel."""
    mesh = DeviceMesh(range(d))
    with FusionDefinition() as fd:
        x = fd.define_tensor([tokens, in_f], dtype=dtype)
        w = fd.define_tensor([out_f, in_f], dtype=dtype)
        b = fd.define_tensor([out_f], dtype=dtype)
        y = fd.ops.linear(x, w, b)
        fd.add_output(y)

        for tv in (x, w, b, y):
            tv.set_device_mesh(mesh)
        if mode == "column":  # out features sharded: y comes out sharded on its last dim
            for tv in (w, b):
                tv.outer_split(0, d)
                tv.axis(0).parallelize(ParallelType.mesh_x)
            y.outer_split(1, d)
            y.axis(1).parallelize(ParallelType.mesh_x)
        else:  # in features sharded: partial sums, y replicated
            for tv in (x, w):
                tv.outer_split(1, d)
                tv.axis(1).parallelize(ParallelType.mesh_x)
    return fd


def reference_inputs(tokens: int, in_f: int, out_f: int, dtype: torch.dtype, device) -> list[torch.Tensor]:
    """Identical full inputs on every rank (seeded)."""
    g = torch.Generator().manual_seed(4321)
    shapes = ([tokens, in_f], [out_f, in_f], [out_f])
    scales = (1.0, in_f ** -0.5, 0.1)
    return [(torch.randn(s, generator=g) * k).to(dtype).to(device) for s, k in zip(shapes, scales)]


def run_mode(rank: int, world: int, args, mode: str, device) -> float:
    torch_dtype, dtype = DTYPES[args.dtype]
    fd = define_linear(args.tokens, args.in_features, args.out_features, world, mode, dtype)
    full = reference_inputs(args.tokens, args.in_features, args.out_features, torch_dtype, device)
    reference = F.linear(*(t.double() for t in full))  # aten, unsharded, in float64
    title = (f"{mode}-parallel linear: {world} ranks, tokens {args.tokens}, "
             f"{args.in_features} -> {args.out_features}, {args.dtype}")
    return execute_and_check(rank, fd, full, reference, title, EXPECTED_COLLECTIVES[mode])[1]


def main_on_rank(rank: int, world: int, args, device=None) -> None:
    device = device or torch.device("cpu")
    for mode in MODES[args.mode]:
        run_mode(rank, world, args, mode, device)
    if rank == 0:
        layers = ("column- and row-parallel linear layers match" if args.mode == "both"
                  else f"{args.mode}-parallel linear matches")
        print(f"OK: {layers} the aten reference on every rank")


if __name__ == "__main__":
    run_program(main_on_rank, ARGS, ARGS.nproc)
