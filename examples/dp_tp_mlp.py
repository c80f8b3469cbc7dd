"""A data-parallel x tensor-parallel MLP on a 2-D mesh, written with tp_fusion and validated against aten.

    python examples/dp_tp_mlp.py                     # 4 CPU ranks with gloo: a 2x2 mesh
    python examples/dp_tp_mlp.py --nproc 8 --tp 4    # a 2x4 mesh
    torchrun --nproc_per_node=4 examples/dp_tp_mlp.py --dtype bf16 --batch 8 --seq 512 --hidden 1024

The ranks form a mesh of shape [world / tp, tp]. The input x [batch, seq, hidden] and the output
are sharded on the batch over mesh_y (the data-parallel axis, the mesh's rows); the weights are
sharded over mesh_x (the tensor-parallel axis, its columns): the first linear column-parallel,
the second row-parallel. The only communication is one allreduce inside each tensor-parallel
group (each row of the mesh); data-parallel replicas never talk. Under torchrun the given ranks
are used (CUDA with NCCL when there are GPUs); run plainly, it spawns CPU ranks. Every rank checks
its output shard against the unsharded MLP computed with aten.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from examples.cli import add_run_options, check_sizes, parser, world_size  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument("--batch", type=int, default=4,
                   help="batch size; sharded over mesh_y, so a multiple of its data-parallel ranks (ranks / --tp)")
    p.add_argument("--seq", type=int, default=8, help="sequence length")
    p.add_argument("--hidden", type=int, default=16,
                   help="hidden size; the MLP's inner size, 4x, is sharded over mesh_x, so a multiple of --tp")
    p.add_argument("--tp", type=int, default=2,
                   help="tensor-parallel ranks per mesh row (mesh_x); the number of ranks must be a multiple")
    add_run_options(p, nproc=4)
    args = p.parse_args(argv)
    n, ranks = world_size(args.nproc)
    positive = {"--batch": args.batch, "--seq": args.seq, "--hidden": args.hidden, "--tp": args.tp, ranks: n}
    multiples = [(ranks, n, "--tp", args.tp), ("the MLP's inner size (4 x --hidden)", 4 * args.hidden, "--tp", args.tp)]
    if args.tp >= 1 and n % args.tp == 0:  # the mesh has rows
        multiples.append(("--batch", args.batch, f"the data-parallel ranks ({ranks} / --tp)", n // args.tp))
    check_sizes(p, positive, multiples)
    return args


if __name__ == "__main__":
    ARGS = parse_args()  # before torch is imported: --help answers at once

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from examples.common import DTYPES, execute_and_check  # noqa: E402
from tp_fusion import DataType, DeviceMesh, FusionDefinition, ParallelType  # noqa: E402
from tp_fusion.launch import run_program  # noqa: E402


def define_mlp(batch: int, seq: int, hidden: int, mesh: DeviceMesh, dtype: DataType) -> FusionDefinition:
    """linear(h -> 4h, bias) -> GELU(tanh) -> linear(4h -> h, bias); batch on mesh_y, TP on mesh_x."""
    dp, tp = mesh.shape
    ffn = 4 * hidden
    with FusionDefinition() as fd:
        x = fd.define_tensor([batch, seq, hidden], dtype=dtype)
        w1 = fd.define_tensor([ffn, hidden], dtype=dtype)
        b1 = fd.define_tensor([ffn], dtype=dtype)
        w2 = fd.define_tensor([hidden, ffn], dtype=dtype)
        b2 = fd.define_tensor([hidden], dtype=dtype)
        y = fd.ops.gelu(fd.ops.linear(x, w1, b1), approximate="tanh")
        z = fd.ops.linear(y, w2, b2)
        fd.add_output(z)

        for tv in (x, w1, b1, w2, b2, z):
            tv.set_device_mesh(mesh)
        for tv in (x, z):  # data parallel: the batch over the mesh's rows
            tv.outer_split(0, dp)
            tv.axis(0).parallelize(ParallelType.mesh_y)
        for tv in (w1, b1):  # column-parallel
            tv.outer_split(0, tp)
            tv.axis(0).parallelize(ParallelType.mesh_x)
        w2.outer_split(1, tp)  # row-parallel
        w2.axis(1).parallelize(ParallelType.mesh_x)
    return fd


def reference_inputs(batch: int, seq: int, hidden: int, dtype: torch.dtype, device) -> list[torch.Tensor]:
    """Identical full inputs on every rank (seeded)."""
    g = torch.Generator().manual_seed(2024)
    shapes = ([batch, seq, hidden], [4 * hidden, hidden], [4 * hidden], [hidden, 4 * hidden], [hidden])
    scales = (1.0, hidden ** -0.5, 0.1, (4 * hidden) ** -0.5, 0.1)
    return [(torch.randn(s, generator=g) * k).to(dtype).to(device) for s, k in zip(shapes, scales)]


def reference_mlp(x, w1, b1, w2, b2) -> torch.Tensor:
    x, w1, b1, w2, b2 = (t.double() for t in (x, w1, b1, w2, b2))
    return F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2, b2)


def main_on_rank(rank: int, world: int, args, device=None) -> None:
    device = device or torch.device("cpu")
    mesh = DeviceMesh(torch.arange(world).reshape(world // args.tp, args.tp))
    torch_dtype, dtype = DTYPES[args.dtype]
    fd = define_mlp(args.batch, args.seq, args.hidden, mesh, dtype)
    full = reference_inputs(args.batch, args.seq, args.hidden, torch_dtype, device)
    title = (f"DP x TP MLP: mesh {list(mesh.shape)} (mesh_y = data parallel, mesh_x = tensor parallel), "
             f"batch {args.batch}, seq {args.seq}, hidden {args.hidden}, {args.dtype}")
    execute_and_check(rank, fd, full, reference_mlp(*full), title, ["allreduce"])
    if rank == 0:
        print("OK: the DP x TP MLP matches the aten reference on every rank")


if __name__ == "__main__":
    run_program(main_on_rank, ARGS, ARGS.nproc)
