"""Asynchronous collectives on gloo ranks: a plan issues a communication segment as soon as its input
exists and waits for it only where its result is read, in an order every rank shares; the values
match torch. tests/unit/test_overlapped_collectives.py covers the schedule itself."""

from __future__ import annotations

import pytest
import torch
from conftest import overlapped_fusion, rand

from tp_fusion.runtime import dist


@pytest.mark.ranks(2, 4)
def test_overlapped_collectives_match_torch_and_run_early(multidevice_test):
    d = multidevice_test.size
    fd, x_tv = overlapped_fusion(d)
    x, a = rand(0, 4 * d, 8), rand(1, 6, 8)
    inputs = [multidevice_test.shard_tensor(x, x_tv), a.to(multidevice_test.device)]
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
        for _ in range(2):  # the first call compiles (and on GPUs tunes), the second runs the cached plan
            calls.clear()
            colsum, out = (t.cpu() for t in fd.execute(inputs))
            torch.testing.assert_close(colsum, x.sum(0))
            torch.testing.assert_close(out, x @ (torch.tanh(a) * 2.0).T)
        # The allgather of the input goes out first, before the column sums exist; the allreduce after
        # them, awaited only at the end. (A plan replayed as a CUDA graph issues nothing from the host.)
        assert calls == ([] if fd.plan.cuda_graph else [("all_gather", True), ("all_reduce", True)]), calls
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
    assert fd.plan.overlapped == {1: (0, 5), 3: (-1, 4)}
