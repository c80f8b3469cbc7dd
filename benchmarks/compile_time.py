"""How defining and compiling a fusion scales with its size (issue: compile cost grows linearly).

N residual TP-MLP layers (5 ops each: linear, gelu, relu, linear, add), tiny tensors, column- then
row-parallel weights on a 2-rank mesh. ``define`` records the ops and the schedule; ``compile`` is
``fd.compile`` for rank 0 (the pure compile that every rank runs at its first execute: shape
binding, the pass pipeline, the program). Prints seconds per size and the ratio per 4x ops.

    python benchmarks/compile_time.py --layers 52 205 820
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from examples.cli import parser  # noqa: E402


def build(layers: int, d: int = 2):
    from tp_fusion import DeviceMesh, FusionDefinition, ParallelType

    mesh = DeviceMesh(range(d))
    with FusionDefinition() as fd:
        x = fd.define_tensor([8, 16])
        weights = []
        for _ in range(layers):
            w1, w2 = fd.define_tensor([32, 16]), fd.define_tensor([16, 32])
            weights.append((w1, w2))
            h = fd.ops.gelu(fd.ops.linear(x, w1))
            x = fd.ops.add(x, fd.ops.linear(fd.ops.relu(h), w2))
        fd.add_output(x)
        for w1, w2 in weights:
            for w, axis in ((w1, 0), (w2, 1)):
                w.set_device_mesh(mesh)
                w.outer_split(axis, d)
                w.axis(axis).parallelize(ParallelType.mesh_x)
    return fd


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--layers", type=int, nargs="+", default=[52, 205, 820], help="layer counts (5 ops each)")
    p.add_argument("--repeat", type=int, default=3, help="best of this many runs")
    args = p.parse_args()
    build(2).compile([[8, 16]] + [[32, 16], [16, 32]] * 2)  # warm up imports and torch's dispatch
    print(f"{'ops':>6} {'define s':>9} {'compile s':>10}")
    prev = None
    for layers in args.layers:
        define_s, compile_s = [], []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            fd = build(layers)
            t1 = time.perf_counter()
            fd.compile([[8, 16]] + [[32, 16], [16, 32]] * layers)
            t2 = time.perf_counter()
            define_s.append(t1 - t0)
            compile_s.append(t2 - t1)
        row = (min(define_s), min(compile_s))
        growth = "" if prev is None else f"   x{row[0] / prev[0]:.2f} define, x{row[1] / prev[1]:.2f} compile"
        print(f"{layers * 5:>6} {row[0]:>9.3f} {row[1]:>10.3f}{growth}")
        prev = row


if __name__ == "__main__":
    main()
