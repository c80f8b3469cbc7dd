"""A rank that fails inside a plan makes every rank fail promptly, naming the rank and the segment.

Faults are injected on one rank by swapping an op's aten implementation (``tp_fusion.ops.OPS``)
inside the spawned rank: it raises, or it ends the process with ``os._exit``. The process group's
timeout is 60 s; every rank must fail well before it (bounded by the fault grace period).
"""

from __future__ import annotations

import dataclasses
import os
import re
import time

import pytest
import torch

from tp_fusion import DeviceMesh, ExecutionError, FusionDefinition, ParallelType, TPFusionError, shard_tensor
from tp_fusion import ops as _ops
from tp_fusion.errors import LaunchArgumentError, LaunchError
from tp_fusion.launch import RanksFailed, run_on_ranks
from tp_fusion.runtime import dist

PG_TIMEOUT_S = 60.0
BOUND_S = 20.0  # far below the process group's timeout


def _fusion(world: int):
    """relu on row shards (segment 0, compute) -> allgather (segment 1) -> tanh, replicated (segment 2)."""
    mesh = DeviceMesh(range(world))
    with FusionDefinition() as fd:
        x = fd.define_tensor([4 * world, 6])
        a = fd.ops.relu(x)
        b = fd.ops.set(a)
        c = fd.ops.tanh(b)
        fd.add_output(c)
        for tv in (x, a, b, c):
            tv.set_device_mesh(mesh)
        for tv in (x, a):
            tv.outer_split(0, world)
            tv.axis(0).parallelize(ParallelType.mesh_x)
    full = torch.randn(4 * world, 6, generator=torch.Generator().manual_seed(3))
    return fd, [shard_tensor(full, x)], torch.tanh(torch.relu(full))


def _inject(kind: str, fail_rank: int, how: str) -> None:
    original = _ops.OPS[kind]

    def impl(*args, **kwargs):
        if dist.rank() == fail_rank:
            if how == "exit":
                os._exit(7)
            raise RuntimeError(f"injected fault in {kind}")
        return original.impl(*args, **kwargs)
    _ops.OPS[kind] = dataclasses.replace(original, impl=impl)


def _check_plan(fd) -> None:
    kinds = [seg.kind for seg in fd.plan.segments]
    assert kinds == ["compute", "communication", "compute"], str(fd.plan)


def _fault_in_segment_0(rank: int, world: int, fail_rank: int, how: str) -> None:
    os.environ["TP_FUSION_FAULT_GRACE_S"] = "1.5"  # how long a rank waits for a silent peer's report
    fd, inputs, want = _fusion(world)
    (out,) = fd.execute(inputs)  # a healthy run first: the faulty run hits the plan cache
    torch.testing.assert_close(out, want)
    _check_plan(fd)
    _inject("relu", fail_rank, how)
    start = time.monotonic()
    with pytest.raises(ExecutionError) as info:
        fd.execute(inputs)
    elapsed = time.monotonic() - start
    msg = str(info.value)
    assert elapsed < BOUND_S, (elapsed, msg)
    if how == "raise":
        assert msg.startswith(f"rank {fail_rank} failed in segment 0 (compute): RuntimeError: injected fault "
                              "in relu"), msg
        if rank != fail_rank:
            assert f"seen from rank {rank}, which then failed in segment 1 (communication)" in msg, msg
    else:
        assert f"rank(s) {fail_rank} stopped responding" in msg, msg
        assert f"while rank {rank} was in segment 1 (communication)" in msg, msg
    assert not dist.is_initialized()  # the failure aborted this rank's process group


def test_run_on_ranks_under_torchrun_spawns_nothing(monkeypatch):
    """Every torchrun rank would spawn ranks of its own: a clear error instead, before any process starts."""
    for name, value in (("RANK", "1"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "1")):
        monkeypatch.setenv(name, value)
    with pytest.raises(LaunchError, match=r"under torchrun \(rank 1 of 2\), each torchrun rank would spawn 2") as info:
        run_on_ranks(_fault_in_segment_0, 2, 0, "raise")
    assert isinstance(info.value, TPFusionError) and isinstance(info.value, RuntimeError)


@pytest.fixture
def no_spawn(monkeypatch):
    """Fail the test if run_on_ranks gets as far as starting processes."""
    def start_processes(*args, **kwargs):
        raise AssertionError("run_on_ranks started processes")
    monkeypatch.setattr("tp_fusion.launch.mp.start_processes", start_processes)


@pytest.mark.parametrize("nproc", [0, -1, 2.0, "2", True])
def test_run_on_ranks_refuses_a_bad_rank_count(no_spawn, nproc):
    match = rf"run_on_ranks: nproc must be a positive integer .*, got {nproc!r}"
    with pytest.raises(LaunchArgumentError, match=match) as info:
        run_on_ranks(_fault_in_segment_0, nproc, 0, "raise")
    assert isinstance(info.value, TPFusionError) and isinstance(info.value, ValueError)


def _local_function():
    def fn(rank, world):
        pass
    return fn


@pytest.mark.parametrize("fn,name", [(lambda rank, world: None, "<lambda>"),
                                     (_local_function(), "_local_function.<locals>.fn")])
def test_run_on_ranks_refuses_a_function_it_cannot_pickle(no_spawn, fn, name):
    """The ranks unpickle ``fn``: a lambda or a nested function is an error naming it, before any spawn."""
    match = rf"fn must be a module-level function .*, got '[^']*{re.escape(name)}'"
    with pytest.raises(LaunchArgumentError, match=match) as info:
        run_on_ranks(fn, 2)
    assert isinstance(info.value, TPFusionError) and isinstance(info.value, TypeError)


def test_compute_fault_fails_every_rank():
    run_on_ranks(_fault_in_segment_0, 4, 2, "raise", timeout_s=PG_TIMEOUT_S)


@pytest.mark.parametrize("world,fail_rank", [(2, 1)])
def test_exiting_peer_fails_every_rank(world, fail_rank):
    start = time.monotonic()
    with pytest.raises(RanksFailed) as info:
        run_on_ranks(_fault_in_segment_0, world, fail_rank, "exit", timeout_s=PG_TIMEOUT_S)
    assert time.monotonic() - start < PG_TIMEOUT_S
    assert isinstance(info.value, TPFusionError) and isinstance(info.value, RuntimeError)
    codes = info.value.exitcodes
    assert codes == [7 if r == fail_rank else 0 for r in range(world)], str(info.value)
    assert info.value.failures == {}, str(info.value)  # every surviving rank's assertions held


def _store_host_exits(rank: int, world: int) -> None:
    fd, inputs, _ = _fusion(world)
    fd.execute(inputs)
    _inject("relu", 0, "exit")
    start = time.monotonic()
    with pytest.raises(ExecutionError) as info:
        fd.execute(inputs)
    assert time.monotonic() - start < BOUND_S
    msg = str(info.value)
    assert f"rank {rank} failed in segment 1 (communication)" in msg, msg
    assert "rank 0" in msg, msg  # named as the likely culprit: it hosted the store


def test_store_host_exits():
    with pytest.raises(RanksFailed) as info:
        run_on_ranks(_store_host_exits, 2, timeout_s=PG_TIMEOUT_S)
    assert info.value.exitcodes == [7, 0] and info.value.failures == {}, str(info.value)


def _fault_in_last_segment(rank: int, world: int) -> None:
    """Rank 1 fails in the last segment, after the last collective: rank 0 completes this plan
    (its result is right) and fails at its next execute, before any collective of it."""
    fd, inputs, want = _fusion(world)
    fd.execute(inputs)
    _inject("tanh", 1, "raise")
    if rank == 1:
        with pytest.raises(ExecutionError, match=r"^rank 1 failed in segment 2 \(compute\): RuntimeError"):
            fd.execute(inputs)
        return
    (out,) = fd.execute(inputs)
    torch.testing.assert_close(out, want)
    start = time.monotonic()
    with pytest.raises(ExecutionError) as info:
        fd.execute(inputs)
    assert time.monotonic() - start < BOUND_S
    msg = str(info.value)
    assert msg.startswith("rank 1 failed in segment 2 (compute): RuntimeError: injected fault in tanh"), msg
    assert "input agreement before running the plan" in msg, msg




def _fault_then_error_type(rank: int, world: int) -> None:
    """A non-RuntimeError raised in a communicating rank is still reported as this rank's failure."""
    fd, inputs, _ = _fusion(world)
    _inject("relu", 1, "raise")
    with pytest.raises(TPFusionError) as info:
        fd.execute(inputs)
    assert isinstance(info.value, ExecutionError) and isinstance(info.value, RuntimeError)
    assert "rank 1 failed in segment 0" in str(info.value)


def _faults_on_two_ranks(rank: int, world: int, workdir: str) -> None:
    """The two-rank cases one after another (each spawn costs seconds): a fault in segment 0 on rank
    0, a fault after the last collective, a fault at the first execute; each aborts the process
    group, which is then joined again."""
    healthy = dict(_ops.OPS)
    cases = [lambda: _fault_in_segment_0(rank, world, 0, "raise"), lambda: _fault_in_last_segment(rank, world),
             lambda: _fault_then_error_type(rank, world)]
    for k, case in enumerate(cases):
        if k:
            dist.init_process_group("gloo", rank, world, f"file://{os.path.join(workdir, f'rejoin{k}')}",
                                    PG_TIMEOUT_S)
        case()
        _ops.OPS.update(healthy)
        if dist.is_initialized():  # every case aborts the group; a case that did not must not block the next
            dist.abort()


def test_faults_on_two_ranks(tmp_path):
    run_on_ranks(_faults_on_two_ranks, 2, str(tmp_path), timeout_s=PG_TIMEOUT_S)
