"""Starting ranks: under torchrun use the ranks given; otherwise spawn local CPU ranks with gloo.

``run_on_ranks(fn, nproc)`` is what the examples and the multidevice tests use so that the same
program runs on a laptop, in CI and on a GPU node.
"""

from __future__ import annotations

import os
import socket
import time
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
    dist.warm_up_before_init()
    dist.init_process_group(backend, rank, world, "env://", timeout_s)
    return device


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, world, port, fn, args, errors, timeout_s):
    torch.set_num_threads(1)
    dist.warm_up_before_init()
    dist.init_process_group("gloo", rank, world, f"tcp://127.0.0.1:{port}", timeout_s)
    try:
        fn(rank, world, *args)
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise
    finally:
        dist.destroy_process_group()


class RanksFailed(RuntimeError):
    """Some spawned ranks failed: ``exitcodes`` per rank (None: killed), ``failures`` rank -> traceback."""

    def __init__(self, message: str, exitcodes: list, failures: dict[int, str]):
        super().__init__(message)
        self.exitcodes, self.failures = exitcodes, failures


def run_on_ranks(fn, nproc: int, *args, timeout_s: float = 120.0, grace_s: float = 30.0) -> None:
    """Run ``fn(rank, world, *args)`` on ``nproc`` spawned CPU ranks joined by gloo.

    ``fn`` must be picklable (a module-level function). Bounded in time: ``timeout_s`` is the
    process group's timeout (each collective, and joining it), the whole run may take at most
    ``timeout_s + 60`` seconds, and once a rank has failed the others get ``grace_s`` seconds to
    finish before they are killed. If any rank fails, raises ``RanksFailed`` (a RuntimeError)
    carrying the exit codes and the failing ranks' tracebacks.
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
    failures: dict[int, str] = {}
    deadline, failed_at, killed = time.monotonic() + timeout_s + 60, None, []
    while True:
        while not errors.empty():
            r, tb = errors.get()
            failures[r] = tb
        alive = [p for p in procs if p.is_alive()]
        if not alive:
            break
        now = time.monotonic()
        if failed_at is None and (failures or any(p.exitcode not in (None, 0) for p in procs)):
            failed_at = now
        if now > deadline or (failed_at is not None and now - failed_at > grace_s):
            for p in alive:
                killed.append(procs.index(p))
                p.kill()
            for p in alive:
                p.join()
            break
        alive[0].join(0.05)
    while not errors.empty():
        r, tb = errors.get()
        failures[r] = tb
    codes = [p.exitcode for p in procs]
    if failures or any(c != 0 for c in codes):
        detail = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items()))
        note = f" (killed: ranks {killed}, still running after the others failed or the deadline)" if killed else ""
        raise RanksFailed(f"ranks failed (exit codes {codes}){note}:\n{detail}", codes, failures)


def run_program(main_on_rank, args, nproc: int) -> None:
    """Run ``main_on_rank(rank, world, args, device)`` on every rank: under torchrun on the ranks it
    started (CUDA + NCCL when there are GPUs), otherwise on ``nproc`` spawned CPU ranks with gloo.
    The examples' ``main``; ``main_on_rank`` must be a module-level function (it is pickled)."""
    if under_torchrun():
        device = init_from_env()
        try:
            main_on_rank(dist.rank(), dist.world_size(), args, device)
        finally:
            dist.destroy_process_group()
    else:
        run_on_ranks(main_on_rank, nproc, args)

