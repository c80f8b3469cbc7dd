"""Asynchronous collectives on ranks: the runner issues a communication segment as soon as its input
exists and waits for it only where its result is read, in an order every rank shares, and the values
match torch. CUDA plans get this schedule from ``fd.execute``; on gloo, plans keep program order (see
``program.build_program``), so the runner is given the schedule here. tests/unit/test_overlapped_collectives.py
covers the schedule itself."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import overlapped_fusion, rand

from tp_fusion.program import schedule_collectives
from tp_fusion.runtime import dist
from tp_fusion.runtime.runner import Runner


@pytest.mark.ranks(2, 4)
def test_overlapped_collectives_match_torch_and_run_early(multidevice_test):
    d = multidevice_test.size
    fd, x_tv = overlapped_fusion(d)
    x, a = rand(0, 4 * d, 8), rand(1, 6, 8)
    inputs = [multidevice_test.shard_tensor(x, x_tv), a.to(multidevice_test.device)]
    want = [x.sum(0), x @ (torch.tanh(a) * 2.0).T]
    fd.execute(inputs)  # compiles (and on GPUs tunes)
    schedule = {1: (0, 5), 3: (-1, 4)}  # the allreduce after segment 0 until the end; the allgather from the start
    assert fd.plan.overlapped == (schedule if inputs[0].is_cuda else {})
    runner = Runner(dataclasses.replace(fd.plan, overlapped=schedule_collectives(fd.plan.segments)))
    calls = []
    real = {name: getattr(dist, name) for name in ("all_gather", "all_reduce")}

    def spy(name):
        def call(*args, async_op=False, **kwargs):
            calls.append((name, async_op))
            return real[name](*args, async_op=async_op, **kwargs)
        return call
    for name in real:
        setattr(dist, name, spy(name))
    try:
        got = runner.run_eager(inputs)
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.cpu(), w)
    # The allgather of the input goes out first, before the column sums exist; then the allreduce.
    assert calls == [("all_gather", True), ("all_reduce", True)], calls
