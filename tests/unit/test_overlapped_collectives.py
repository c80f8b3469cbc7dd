"""Asynchronous collectives (``program.schedule_collectives``): which communication segments a plan
issues early and awaits late (on CUDA), so that the segments in between overlap them. The runner's
values and the order it issues the collectives in are checked on ranks in
tests/multidevice/test_overlapped_collectives_multirank.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from conftest import overlapped_fusion
from tp_fusion.sharding.reshard import Collective

from tp_fusion import DeviceMesh, FusionDefinition, ParallelType
from tp_fusion.program import schedule_collectives


def test_collectives_are_issued_early_and_awaited_late():
    plan = overlapped_fusion(2)[0].compile([[8, 8], [6, 8]], device="cuda")
    kinds = [seg.kind for seg in plan.segments]
    assert kinds == ["compute", "communication", "compute", "communication", "compute"], plan
    # The allreduce of the partial column sums: issued once they exist, awaited at the end (an output
    # only); the allgather of the input x: issued at the start, awaited by the matmul.
    assert plan.overlapped == {1: (0, 5), 3: (-1, 4)}
    text = str(plan)
    assert "segment 1: communication (asynchronous: issued after segment 0, awaited at the end)" in text
    assert "segment 3: communication (asynchronous: issued at the start, awaited before segment 4)" in text
    # On the CPU (gloo) every collective runs in program order.
    assert overlapped_fusion(2)[0].compile([[8, 8], [6, 8]]).overlapped == {}


def test_a_collective_read_by_the_next_segment_stays_in_order():
    mesh = DeviceMesh(range(2))
    with FusionDefinition() as fd:
        x, w = fd.define_tensor([8, 4]), fd.define_tensor([4, 3])
        gathered = fd.ops.set(x)
        fd.add_output(fd.ops.matmul(gathered, w))
    for tv in (x, w, gathered):
        tv.set_device_mesh(mesh)
    x.outer_split(0, 2)
    x.axis(0).parallelize(ParallelType.mesh_x)
    plan = fd.compile([[8, 4], [4, 3]], device="cuda")
    assert plan.collectives() == ["allgather"] and plan.overlapped == {}


def _segment(kind, reads=(), writes=(), collective=None, donate=False):
    op = SimpleNamespace(tensor_inputs=tuple(reads), outputs=tuple(writes))
    return SimpleNamespace(kind=kind, steps=(SimpleNamespace(op=op, collective=collective, donate=donate),))


@pytest.mark.parametrize("donate, issued_after", [(False, 0), (True, 1)])
def test_an_allreduce_in_place_waits_for_the_other_readers_of_its_input(donate, issued_after):
    segments = [_segment("compute", writes=[1]), _segment("compute", reads=[1], writes=[2]),
                _segment("compute", writes=[3]),
                _segment("communication", [1], [4], Collective.ALLREDUCE, donate),
                _segment("compute", reads=[4, 2, 3], writes=[5])]
    assert schedule_collectives(segments) == {3: (issued_after, 4)}


def test_chained_collectives_run_in_order():
    """A collective on the result of an asynchronous one is not made asynchronous itself."""
    segments = [_segment("communication", [0], [1], Collective.ALLGATHER), _segment("compute", writes=[2]),
                _segment("communication", [1], [3], Collective.ALLREDUCE), _segment("compute", writes=[4]),
                _segment("compute", reads=[3], writes=[5])]
    assert schedule_collectives(segments) == {0: (-1, 2)}


def test_a_collective_needed_sooner_is_not_queued_behind_an_asynchronous_one():
    """A process group runs its collectives in issue order. The allgather of input 0 (needed by segment 4)
    is issued after the in-order allgather of segment 1 (needed at once by segment 2), not at the start,
    where segment 1's would wait behind it."""
    gather = Collective.ALLGATHER
    segments = [_segment("compute", writes=[1]), _segment("communication", [1], [2], gather),
                _segment("compute", reads=[2], writes=[3]), _segment("communication", [0], [4], gather),
                _segment("compute", reads=[4, 3])]
    assert schedule_collectives(segments) == {3: (1, 4)}
    # Here the in-order allgather comes last before the wait: nothing would be left to overlap the
    # allgather of input 0 after it, so that one runs in order too.
    segments = [_segment("communication", [0], [9], gather), _segment("compute", writes=[1]),
                _segment("communication", [1], [2], gather), _segment("compute", reads=[9, 2])]
    assert schedule_collectives(segments) == {}
