"""Starting ranks: under torchrun use the ranks given; otherwise spawn local CPU ranks with gloo.

``run_on_ranks(fn, nproc)`` is what the examples and the multidevice tests use so that the same
program runs on a laptop, in CI and on a GPU node.
"""

from __future__ import annotations

import os
import socket
import traceback

import torch
import torch.multiprocessing as mp

from tp_fusion.runtime import dist


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def init_from_env(timeout_s: float = 300.0) -> torch.device:
    """Join the process group torchrun describes; CUDA+NCCL when there are GPUs, else CPU+gloo."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, rank, world, "env://", timeout_s)
    return device


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, world, port, fn, args, errors, timeout_s):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank, world, f"tcp://127.0.0.1:{port}", timeout_s)
    try:
        fn(rank, world, *args)
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise
    finally:
        dist.destroy_process_group()


def run_on_ranks(fn, nproc: int, *args, timeout_s: float = 120.0) -> None:
    """Run ``fn(rank, world, *args)`` on ``nproc`` spawned CPU ranks joined by gloo.

    ``fn`` must be picklable (a module-level function). If any rank fails, raises
    ``RuntimeError`` carrying the failing ranks' tracebacks.
    """
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    port = _free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, nproc, port, fn, args, errors, timeout_s), daemon=False)
        for r in range(nproc)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout_s + 60)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    if failures or any(p.exitcode != 0 for p in procs):
        codes = [p.exitcode for p in procs]
        detail = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures))
        raise RuntimeError(f"ranks failed (exit codes {codes}):\n{detail}")
