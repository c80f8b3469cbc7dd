"""Where the fused MLP's time over the best compute goes: the copy-engine traffic, the chunking, the rest.

    torchrun --nproc_per_node=2 benchmarks/contention.py [--shapes T,H,F ...] [--rounds 5]

For each sequence-parallel MLP shape of ``benchmarks/tp_mlp.py`` (from 2048 tokens), every rank runs,
in interleaved rounds timed as ``tp_mlp.py`` times them (``time_rounds``):

- ``compute``: the best compute of its local work (``torch._addmm_activation`` with bias and GELU,
  then ``F.linear``; the yardstick of issue 13);
- ``chunked``: the GEMMs as the fused kernels split them, with no communication: one GEMM per rank's
  rows (bias and GELU in the epilogue; every other one on a second stream where the default ``Tuning``
  has ``ag_streams=2``, as until round 11),
  one per destination rank's rows, and the pass that adds the received partial;
- ``compute+pushes`` and ``chunked+pushes``: the same while the copy stream pushes, with no flag and no
  dependency, the bytes that the fused allgather and reduce_scatter push (this rank's rows of x and its
  partial of each peer's rows, into each peer's symmetric memory, copy-engine writes over NVLink),
  issued when the compute starts;
- ``fused``: the fused kernels themselves (``overlap.allgather_linear`` then
  ``overlap.linear_reduce_scatter``, ``mode="fused"``, the default ``Tuning``);
- ``pushes``: the pushes alone.

Over ``compute``: ``compute+pushes`` is what the traffic costs the GEMMs when nothing waits on anything
(a fused design that moves the same bytes on the copy engines cannot beat it, however well it is
scheduled), ``chunked`` what the chunking costs, and ``fused`` against ``chunked+pushes`` what the
flags and waits cost. Prints ms (max over ranks, median of rounds) and the ratios per shape.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from examples.cli import add_timing_options, parser  # noqa: E402

SHAPES = ((2048, 8192, 28672), (3072, 12288, 49152), (4096, 5120, 13824), (8192, 4096, 16384),
          (8192, 8192, 28672), (8192, 12288, 49152), (16384, 8192, 28672))


def parse_args(argv=None) -> argparse.Namespace:
    p = parser(__doc__)
    shape = lambda s: tuple(int(v) for v in s.split(","))  # noqa: E731
    p.add_argument("--shapes", nargs="*", type=shape, default=list(SHAPES), help="tokens,hidden,ffn triples")
    add_timing_options(p, iters=20, warmup=5, rounds=5)
    return p.parse_args(argv)


if __name__ == "__main__":
    ARGS = parse_args()  # before torch is imported: --help answers at once

import torch  # noqa: E402

from benchmarks.tp_mlp import time_rounds  # noqa: E402
from tp_fusion.launch import init_from_env  # noqa: E402
from tp_fusion.runtime import dist, overlap, symm  # noqa: E402


def variants(tokens: int, hidden: int, ffn: int, device) -> dict:
    n = dist.world_size()
    gen = torch.Generator(device).manual_seed(dist.rank())
    rand = lambda *shape: torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16) / shape[-1] ** 0.5  # noqa: E731
    x, w1, b1, w2 = rand(tokens, hidden), rand(ffn // n, hidden), rand(ffn // n), rand(hidden, ffn // n)
    rows = tokens // n
    box = symm.mailbox("contention", 2, (rows, hidden), torch.bfloat16, None, device)
    box.start_call()
    main, comm = torch.cuda.current_stream(device), symm.comm_stream(device)
    side = symm.side_stream(device) if overlap.DEFAULT_TUNING.ag_streams == 2 else main
    driver = symm.driver()
    sources = (x[:rows], rand(rows, hidden))  # this rank's rows of x; a partial of a peer's rows
    peers = [(box.rank + step) % n for step in range(1, n)]
    y, z, out = x.new_empty(tokens, ffn // n), x.new_empty(n, rows, hidden), x.new_empty(rows, hidden)

    def compute():
        h = torch._addmm_activation(b1, x, w1.t(), use_gelu=True)
        return torch.nn.functional.linear(h, w2)

    def chunked():
        if side is not main:
            symm.stream_wait(side, main)
        for c in range(n):
            with torch.cuda.stream(side if c % 2 else main):
                lo = slice(c * rows, (c + 1) * rows)
                torch._addmm_activation(b1, x[lo], w1.t(), use_gelu=True, out=y[lo])
        if side is not main:
            symm.stream_wait(main, side)
        for c in range(n):
            torch.mm(y[c * rows:(c + 1) * rows], w2.t(), out=z[c])
        overlap._sum_slots(z, out)  # the fused reduce_scatter's add of the received partials
        return out

    def with_pushes(fn):
        """``fn`` while the copy stream pushes ``sources`` to every peer (no flags: nothing waits on them)."""
        def run():
            symm.stream_wait(comm, main)
            for part, src in enumerate(sources):
                for peer in peers:
                    driver.copy(comm, box.peer_slot(peer, part), src)
            fn()
            symm.stream_wait(main, comm)
        return run

    def fused():
        h = overlap.allgather_linear(x[:rows], w1, b1, gather_dim=0, pg=None, epilogue=overlap.gelu_tanh,
                                     mode="fused")
        return overlap.linear_reduce_scatter(h, w2, scatter_dim=0, pg=None, mode="fused")

    return {"compute": compute, "chunked": chunked, "compute+pushes": with_pushes(compute),
            "chunked+pushes": with_pushes(chunked), "fused": fused, "pushes": with_pushes(lambda: None)}


def main(args) -> int:
    if not torch.cuda.is_available():
        print("benchmarks/contention.py: this machine has no CUDA GPU, so there is nothing to measure.")
        return 0
    device = init_from_env()
    if dist.rank() == 0:
        print(f"{dist.world_size()}x {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16; ms per "
              f"iteration, max over ranks, median of {args.rounds} rounds; ratios over compute")
    for tokens, hidden, ffn in args.shapes:
        row = {"ms_rounds": {}}
        time_rounds(row, variants(tokens, hidden, ffn, device), args)
        ms = row["ms"]
        if dist.rank() == 0:
            print(f"{tokens},{hidden},{ffn}: " + ", ".join(f"{k} {v:.3f}" for k, v in ms.items()) + "\n    "
                  + ", ".join(f"{k} {ms[k] / ms['compute']:.3f}" for k in ms if k not in ("compute", "pushes")),
                  flush=True)
        torch.cuda.empty_cache()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
