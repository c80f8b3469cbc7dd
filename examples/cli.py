"""What the examples' command lines share. Imports no torch, so that ``--help`` answers at once."""

from __future__ import annotations

import argparse
import os

DTYPE_NAMES = ("f32", "bf16", "f64")  # the keys of examples.common.DTYPES


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """The module docstring as written, and every option's default."""


def parser(doc: str) -> argparse.ArgumentParser:
    """An argument parser whose help starts with ``doc``."""
    return argparse.ArgumentParser(description=doc, formatter_class=HelpFormatter)


def add_run_options(p: argparse.ArgumentParser, nproc: int) -> None:
    """The options every example takes: the data type, and how many CPU ranks to spawn."""
    p.add_argument("--dtype", choices=DTYPE_NAMES, default="f32", help="data type")
    p.add_argument("--nproc", type=int, default=nproc, help="CPU ranks to spawn when not under torchrun")


def world_size(nproc: int) -> tuple[int, str]:
    """How many ranks the example will run on, and what says so: torchrun's ``WORLD_SIZE`` under
    torchrun (the test of ``tp_fusion.launch.under_torchrun``, which imports torch), else ``--nproc``."""
    if all(name in os.environ for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
        return int(os.environ["WORLD_SIZE"]), "WORLD_SIZE"
    return nproc, "--nproc"


def check_sizes(p: argparse.ArgumentParser, positive: dict[str, int],
                multiples: list[tuple[str, int, str, int]]) -> None:
    """Exit with one usage error, before any rank starts, naming each size that fails: each value of
    ``positive`` ({"--tokens": 64}) must be at least 1; then for each (what, value, of, divisor) of
    ``multiples``, ``value`` must be a multiple of ``divisor`` ("--tokens 31 must be a multiple of
    --nproc 2")."""
    failed = [f"{name} {value} must be at least 1" for name, value in positive.items() if value < 1]
    if not failed:  # the divisors are positive
        failed = [f"{what} {value} must be a multiple of {of} {divisor}"
                  for what, value, of, divisor in multiples if value % divisor]
    if failed:
        p.error("; ".join(failed))


def add_inspect_options(p: argparse.ArgumentParser) -> None:
    """--explain and --profile, for the examples that print plans and trace a step."""
    p.add_argument("--explain", action="store_true", help="also print the plan summaries (bytes, FLOPs)")
    p.add_argument("--profile", metavar="DIR", help="write per-rank Chrome traces and DIR/timeline.png")


def add_timing_options(p: argparse.ArgumentParser, iters: int, warmup: int, rounds: int) -> None:
    """How the GPU benchmarks time each variant (``benchmarks.tp_mlp.time_rounds``)."""
    p.add_argument("--iters", type=int, default=iters, help="timed iterations per variant (at least)")
    p.add_argument("--warmup", type=int, default=warmup, help="untimed iterations first (at least)")
    p.add_argument("--min-ms", type=float, default=100.0,
                   help="the warmup and the timed iterations each span at least this many ms, so that a variant "
                        "is timed in its own steady state and not in the one its predecessor left")
    p.add_argument("--settle-ms", type=float, default=3000.0,
                   help="before a shape's rounds, run its variants untimed for this long, so that the GPUs' power "
                        "controller has left the transient that follows idle time (tp_fusion.runtime.tuning.settle)")
    p.add_argument("--rounds", type=int, default=rounds,
                   help="timing rounds, each in its own random order of the variants; the median is reported")

