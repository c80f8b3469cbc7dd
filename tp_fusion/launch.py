"""Starting ranks: under torchrun use the ranks given; otherwise spawn local CPU ranks with gloo.

``run_on_ranks(fn, nproc)`` is what the examples and the multidevice tests use so that the same
program runs on a laptop, in CI and on a GPU node.
"""

from __future__ import annotations

import datetime
import numbers
import os
import pickle
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import wait

import torch
import torch.multiprocessing as mp

from tp_fusion.errors import LaunchArgumentError, LaunchError, RanksFailed


def under_torchrun() -> bool:
    """True when torchrun (or another launcher) set RANK, WORLD_SIZE and LOCAL_RANK."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def init_from_env(timeout_s: float = 300.0) -> torch.device:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT);
    CUDA+NCCL when there are GPUs, else CPU+gloo. ``timeout_s`` (default 300 s) bounds joining and
    every collective of the group. Returns this rank's device (``cuda:LOCAL_RANK`` or ``cpu``)."""
    from tp_fusion.runtime import dist

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


def _join_store(rank: int, world: int, workdir: str, timeout_s: float):
    """Rank 0 hosts a TCPStore on a port the OS picks and leaves the port in ``workdir``; the others
    wait for it and connect (no port is reserved and released, so none can be taken meanwhile)."""
    import torch.distributed as tdist

    timeout, path = datetime.timedelta(seconds=timeout_s), os.path.join(workdir, "port")
    if rank == 0:
        store = tdist.TCPStore("127.0.0.1", 0, world, True, timeout, wait_for_workers=False)
        with open(path + ".tmp", "w") as f:
            f.write(str(store.port))
        os.rename(path + ".tmp", path)
        return store
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 published no store port within {timeout_s} s")
        time.sleep(0.005)
    with open(path) as f:
        port = int(f.read())
    return tdist.TCPStore("127.0.0.1", port, world, False, timeout)


def _rank_main(rank, world, workdir, fn, args, timeout_s):
    """A spawned rank: join the gloo group, run ``fn``, leave a traceback in ``workdir`` on failure.

    Where ``fn`` uses tp_fusion (its module, unpickled before this runs, imported it), torch's lazily
    loaded dispatch machinery is warmed up before the group exists (``dist.warm_up_before_init``,
    about a second): imported after init, it keeps the default group alive past its destruction, and
    the process then aborts at exit now and then ("terminate called without an active exception").
    """
    import torch.distributed as tdist

    torch.set_num_threads(1)
    tp_dist = sys.modules.get("tp_fusion.runtime.dist")
    if tp_dist is not None:
        tp_dist.warm_up_before_init()
    try:
        store = _join_store(rank, world, workdir, timeout_s)
        tdist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                 timeout=datetime.timedelta(seconds=timeout_s))
        tdist.barrier()  # every rank holds its gloo connections before any can return and close them
        fn(rank, world, *args)
    except BaseException:
        with open(os.path.join(workdir, f"error.{rank}"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        # tp_fusion's destroy (it releases CUDA graphs first) where the rank imported it, else torch's.
        tp_dist = sys.modules.get("tp_fusion.runtime.dist")
        if tp_dist is not None:
            tp_dist.destroy_process_group()
        elif tdist.is_initialized():
            tdist.destroy_process_group()
    # The rank's work is done and its group torn down. Objects that outlive ``fn`` in torch's own
    # caches (a DeviceMesh keeps its process group) would be destroyed at interpreter exit, where
    # a gloo group's threads abort the process now and then ("terminate called without an active
    # exception"): so the rank ends here, without interpreter teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _kill(procs) -> None:
    for p in procs:
        p.kill()
    for p in procs:
        p.join()


def _wait(procs, deadline: float, grace_s: float) -> list[int]:
    """Wait for ``procs`` to end; kill those still running at ``deadline`` or ``grace_s`` seconds
    after one failed. Returns the indices of the killed ones."""
    failed_at = None
    while True:
        alive = [p for p in procs if p.exitcode is None]
        if not alive:
            return []
        now = time.monotonic()
        if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
            failed_at = now
        end = deadline if failed_at is None else min(deadline, failed_at + grace_s)
        if now >= end:
            _kill(alive)
            return [procs.index(p) for p in alive]
        wait([p.sentinel for p in alive], timeout=end - now)
        for p in alive:
            if not p.is_alive():
                p.join()


def _start_method() -> str:
    """``forkserver`` where the platform has it: one server process imports torch and tp_fusion once,
    and every rank of every later ``run_on_ranks`` forks from it (a fresh ``spawn`` re-imports torch
    per rank, seconds on a small machine). The server never runs CUDA or joins a process group, so
    the forked ranks start clean."""
    import multiprocessing

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    multiprocessing.set_forkserver_preload(["torch", "tp_fusion", "tp_fusion.launch"])
    return "forkserver"


def run_on_ranks(fn, nproc: int, *args, timeout_s: float = 120.0, grace_s: float = 30.0,
                 deadline_s: float | None = None) -> None:
    """Run ``fn(rank, world, *args)`` on ``nproc`` spawned CPU ranks joined by gloo.

    ``fn`` must be picklable (a module-level function) and ``nproc`` a positive integer, else a
    ``LaunchArgumentError`` (a ValueError and a TypeError) before any rank starts. Bounded in time:
    ``timeout_s`` is the process group's timeout (each collective, and joining it), the whole run may
    take at most ``deadline_s`` seconds (default ``timeout_s + 60``), and once a rank has failed the
    others get ``grace_s`` seconds to finish before they are killed. If any rank fails, raises ``RanksFailed``
    (a ``TPFusionError`` and a RuntimeError) carrying the exit codes and the failing ranks' tracebacks.

    Example::

        def hello(rank, world):
            print(f"rank {rank} of {world}")

        run_on_ranks(hello, 2)

    Under torchrun, whose ranks exist already, it raises instead of spawning ranks of its own on
    every one of them: there, join the group (``init_from_env``) and call ``fn`` directly, or use
    ``run_program``, which does either.
    """
    if isinstance(nproc, bool) or not isinstance(nproc, numbers.Integral) or nproc < 1:
        raise LaunchArgumentError(f"run_on_ranks: nproc must be a positive integer (the ranks to spawn), got {nproc!r}")
    try:
        pickle.dumps(fn)
    except (pickle.PicklingError, AttributeError, TypeError) as e:
        raise LaunchArgumentError(
            f"run_on_ranks: fn must be a module-level function (each rank unpickles it by name), got "
            f"{getattr(fn, '__qualname__', fn)!r}, which cannot be pickled ({e}); define it at the top level "
            "of a module") from e
    if under_torchrun():
        raise LaunchError(
            f"run_on_ranks: running under torchrun (rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']}), "
            f"each torchrun rank would spawn {nproc} ranks of its own; run the script with python, or under "
            "torchrun join its group (tp_fusion.launch.init_from_env()) and call the function on each rank")
    with tempfile.TemporaryDirectory(prefix="tp_fusion_ranks_") as workdir:
        ctx = mp.start_processes(_rank_main, (nproc, workdir, fn, args, timeout_s), nprocs=nproc, join=False,
                                 start_method=_start_method())
        procs = ctx.processes
        try:
            killed = _wait(procs, time.monotonic() + (timeout_s + 60 if deadline_s is None else deadline_s), grace_s)
        except BaseException:  # interrupted (Ctrl-C, a test timeout): leave no rank behind
            _kill([p for p in procs if p.exitcode is None])
            raise
        failures = {}
        for r in range(nproc):
            path = os.path.join(workdir, f"error.{r}")
            if os.path.exists(path):
                with open(path) as f:
                    failures[r] = f.read()
        for path in ctx.error_files:  # torch's own copies of the tracebacks above
            if os.path.exists(path):
                os.unlink(path)
    codes = [p.exitcode for p in procs]
    if failures or any(c != 0 for c in codes):
        detail = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items()))
        note = f" (killed: ranks {killed}, still running after the others failed or the deadline)" if killed else ""
        if not failures and not killed:  # no rank reached fn: each failed starting, its error on stderr above
            note = (" before running the function: see the ranks' errors above. A script that calls "
                    "run_on_ranks when imported must call it under `if __name__ == \"__main__\":` (each rank "
                    "imports the script again)")
        raise RanksFailed(f"ranks failed (exit codes {codes}){note}" + (f":\n{detail}" if detail else ""), codes,
                          failures)


def run_program(main_on_rank, args, nproc: int) -> None:
    """Run ``main_on_rank(rank, world, args, device)`` on every rank: under torchrun on the ranks it
    started (CUDA + NCCL when there are GPUs), otherwise on ``nproc`` spawned CPU ranks with gloo.
    The examples' ``main``; ``main_on_rank`` must be a module-level function (it is pickled)."""
    if under_torchrun():
        from tp_fusion.runtime import dist

        device = init_from_env()
        try:
            main_on_rank(dist.rank(), dist.world_size(), args, device)
        finally:
            dist.destroy_process_group()
    else:
        run_on_ranks(main_on_rank, nproc, args)
