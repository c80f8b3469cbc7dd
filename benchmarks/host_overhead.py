"""Where the host time of one ``fd.execute`` goes, for a small sequence-parallel MLP.

    torchrun --nproc_per_node=2 benchmarks/host_overhead.py [--tokens 256 --hidden 1024 --ffn 4096]

At small shapes the GPU finishes an MLP faster than Python can issue it, so the frontend's host
time per call decides the speed. Prints, max over ranks: GPU time per iteration of the plan and of
NCCL sequential (CUDA events over back-to-back calls), host time per ``execute`` call, the
cross-rank input agreement alone, and the top functions of a cProfile of rank 0.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from examples.cli import parser  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument("--tokens", type=int, default=256, help="tokens (rows of the input)")
    p.add_argument("--hidden", type=int, default=1024, help="hidden size")
    p.add_argument("--ffn", type=int, default=4096, help="the MLP's inner size")
    return p.parse_args(argv)


if __name__ == "__main__":
    ARGS = parse_args()  # before torch is imported: --help answers at once

import cProfile  # noqa: E402
import io  # noqa: E402
import pstats  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.tp_mlp import make_inputs, mlp_local_fused, time_ms, tp_fusion_runner  # noqa: E402
from tp_fusion.launch import init_from_env  # noqa: E402
from tp_fusion.runtime import dist, faults  # noqa: E402


def host_us(fn, calls: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    return host / calls * 1e6


def main(args: argparse.Namespace) -> None:
    if not torch.cuda.is_available():
        print("benchmarks/host_overhead.py: this machine has no CUDA GPU; nothing to measure.")
        return
    device = init_from_env()
    n, r = dist.world_size(), dist.rank()
    inp = make_inputs(args.tokens, args.hidden, args.ffn, n, r, device)
    plan_fn, _ = tp_fusion_runner(args.tokens, args.hidden, args.ffn, n, inp)
    gathered = torch.empty_like(inp["x_full"])
    out = torch.empty(args.tokens // n, args.hidden, device=device, dtype=torch.bfloat16)

    def sequential():
        dist.all_gather(gathered, inp["x_local"], None)
        dist.reduce_scatter(out, mlp_local_fused(gathered, inp["w1"], inp["b1"], inp["w2"]), None)

    rows = {
        "plan GPU ms/iter": time_ms(plan_fn, 50, 10),
        "NCCL sequential GPU ms/iter": time_ms(sequential, 50, 10),
        "plan host us/call": host_us(plan_fn, 200),
        "NCCL sequential host us/call": host_us(sequential, 200),
        "agreement host us/call": host_us(lambda: faults.agree(False, 0), 200),
        "F.linear host us/call": host_us(lambda: F.linear(inp["x_local"], inp["w1"]), 200),
    }
    worst = dist.gather_from_all(rows)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(100):
        plan_fn()
    prof.disable()
    torch.cuda.synchronize()
    if r == 0:
        print(f"shape tokens={args.tokens} hidden={args.hidden} ffn={args.ffn}, {n} ranks")
        for key in rows:
            print(f"  {key:32s} {max(w[key] for w in worst):10.3f}")
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(15)
        print(s.getvalue())
    dist.destroy_process_group()


if __name__ == "__main__":
    main(ARGS)
