"""CUDA-graph capture of a plan run (tp_fusion/runtime/graphs.py) on one GPU.

Run on a machine with a GPU:  python -m pytest tests/gpu/test_graphs_gpu.py
A capture that fails (here: a host synchronization inside it) must leave the process healthy: a
later capture replays right (inputs read in place while the same tensors come, copied once they
move), and the process exits cleanly (torch 2.11 aborted at exit with
``captures_underway.empty()`` after a failed capture, until graphs.py ended its allocations).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SCRIPT = textwrap.dedent("""
    import torch
    from tp_fusion.runtime import graphs

    x = torch.arange(8.0, device="cuda")

    def syncs(xs):
        y = xs[0] * 2
        torch.cuda.synchronize()  # not allowed while capturing
        return [y]
    try:
        graphs.GraphedRun(syncs, [x])
        raise SystemExit("the capture should have failed")
    except RuntimeError:
        pass
    w = torch.ones(8, device="cuda")
    graphed = graphs.GraphedRun(lambda xs: [xs[0] * 3 + xs[1]], [x, w])
    (out,) = graphed.replay([x + 1, w])  # new activations: copied into a buffer of their own
    assert torch.equal(out, (x + 1) * 3 + w), out
    w.add_(1)  # the weight is read in place: an update is seen by the next replay, even through .data
    w.data.mul_(2)
    (out,) = graphed.replay([x + 2, w])
    assert torch.equal(out, (x + 2) * 3 + 4), out
    (out,) = graphed.replay([x, torch.zeros(8, device="cuda")])  # another weight tensor: copied too
    assert torch.equal(out, x * 3), out
    graphs.release_all()
    torch.cuda.empty_cache()
    print("ok")
""")


def test_failed_capture_leaves_the_process_healthy():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr


def test_capture_is_not_broken_by_collecting_another_plans_graphs():
    """A graph freed mid-capture (another plan's, in a reference cycle that Python's collector frees) is
    reset, which a capturing stream does not permit: that invalidated the capture (5 of about 850
    plans fell back to eager launches). The collector is off while a plan is captured: here it would
    run at the capture's first allocations, with an earlier plan's graphs waiting in a cycle."""
    import gc

    from tp_fusion.runtime import graphs

    x = torch.arange(8.0, device="cuda")

    def run(xs):
        if torch.cuda.is_current_stream_capturing():
            gc.set_threshold(1)  # a collection at (almost) every allocation from here on
            _ = [[] for _ in range(100)]
        return [xs[0] + 1]
    threshold = gc.get_threshold()
    gc.set_threshold(10**9)  # the cycle below stays until the capture
    try:
        cycle = [graphs.GraphedRun(lambda xs: [xs[0] * 2], [x])]
        cycle.append(cycle)
        del cycle
        (out,) = graphs.GraphedRun(run, [x]).replay([x])
        assert torch.equal(out, x + 1)
    finally:
        gc.set_threshold(*threshold)
        gc.collect()
