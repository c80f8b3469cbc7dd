"""Startup costs a user waits for, each the median of interleaved rounds, in seconds:

- ``import torch`` and ``import torch, tp_fusion`` in a fresh interpreter (tp_fusion's own cost is
  the difference);
- ``--help`` of every example and benchmark (a fresh interpreter each);
- ``tp_fusion.launch.run_on_ranks`` with a function that does nothing, against plain
  ``torch.multiprocessing.start_processes`` whose ranks join a gloo group and leave it.

    python benchmarks/startup.py                 # everything, 5 rounds
    python benchmarks/startup.py --only spawn --nproc 2 4 --rounds 7
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout

from examples.cli import parser  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument("--only", choices=("imports", "help", "spawn"), action="append",
                   help="measure only these (repeatable); all by default")
    p.add_argument("--rounds", type=int, default=5, help="rounds per measurement (the median is shown)")
    p.add_argument("--nproc", type=int, nargs="+", default=[2, 4], help="rank counts for the spawn measurement")
    return p.parse_args(argv)


if __name__ == "__main__":
    ARGS = parse_args()  # before torch is imported: --help answers at once

import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402


def _seconds(cmd: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def _medians(cases: dict, rounds: int) -> dict[str, float]:
    """Run every case once per round, cases interleaved; the median per case."""
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, run in cases.items():
            times[name].append(run())
    return {name: statistics.median(t) for name, t in times.items()}


def _noop(rank: int, world: int) -> None:
    pass


def _plain_rank(rank: int, world: int, init_file: str) -> None:
    import torch.distributed as tdist

    tdist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"file://{init_file}")
    tdist.barrier()
    tdist.destroy_process_group()


def _plain_spawn(nproc: int) -> float:
    import torch.multiprocessing as mp

    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_plain_rank, (nproc, os.path.join(tmp, "store")), nprocs=nproc)
    return time.perf_counter() - start


def _run_on_ranks(nproc: int) -> float:
    from tp_fusion.launch import run_on_ranks

    start = time.perf_counter()
    run_on_ranks(_noop, nproc)
    return time.perf_counter() - start


def main(args: argparse.Namespace) -> None:
    only = set(args.only or ("imports", "help", "spawn"))
    py = sys.executable
    if "imports" in only:
        got = _medians({"import torch": lambda: _seconds([py, "-c", "import torch"]),
                        "import torch, tp_fusion": lambda: _seconds([py, "-c", "import torch, tp_fusion"])},
                       args.rounds)
        for name, s in got.items():
            print(f"{name:<40} {s:6.2f} s")
        print(f"{'tp_fusion on top of torch':<40} {got['import torch, tp_fusion'] - got['import torch']:6.2f} s")
    if "help" in only:
        scripts = sorted(str(p.relative_to(ROOT)) for d in ("examples", "benchmarks") for p in (ROOT / d).glob("*.py")
                         if p.name not in ("common.py", "cli.py"))
        got = _medians({s: (lambda s=s: _seconds([py, s, "--help"])) for s in scripts}, args.rounds)
        for name, s in got.items():
            print(f"{name + ' --help':<40} {s:6.2f} s{'' if s < 1 else '   (over 1 s)'}")
    if "spawn" in only:
        for n in args.nproc:
            got = _medians({"plain": lambda n=n: _plain_spawn(n), "run_on_ranks": lambda n=n: _run_on_ranks(n)},
                           args.rounds)
            plain, ours = got["plain"], got["run_on_ranks"]
            print(f"{n} ranks: plain start_processes + gloo {plain:6.2f} s, run_on_ranks {ours:6.2f} s, "
                  f"ratio {ours / plain:.2f}")


if __name__ == "__main__":
    main(ARGS)
