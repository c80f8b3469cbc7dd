"""fd.plan.summary(): bytes per rank and FLOPs per segment, checked against hand-computed values."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from tp_fusion.passes import run_pipeline

from tp_fusion import DataType, DefinitionError, DeviceMesh, FusionDefinition, ParallelType
from tp_fusion.summary import format_bytes, format_flops, summarize

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import tp_mlp  # noqa: E402

T, H, F = 64, 32, 128  # tokens, hidden, ffn = 4 * hidden; f32 = 4 bytes


def _summary(mode: str, d: int = 2):
    return summarize(run_pipeline(tp_mlp.define_mlp(T, H, d, mode, DataType.Float).fusion))


def test_tp_mlp_allreduce():
    s = _summary("tp")
    # the row-parallel bias is added to the reduced rows inside the fused segment
    assert [seg.ops for seg in s.segments] == ["linear+gelu", "linear+allreduce+add"]
    assert [seg.fused for seg in s.segments] == [False, True]
    # segment 0: x [64, 32] @ w1 shard [64, 32]^T -> [64, 64]: 2*64*64*32, then gelu on 64*64
    assert s.segments[0].flops == 2 * T * (F // 2) * H + T * (F // 2)
    # segment 1: [64, 64] @ w2 shard [32, 64]^T -> [64, 32] partial; allreduce of 64*32*4 bytes; the bias add
    assert s.segments[1].flops == 2 * T * H * (F // 2) + T * H
    (ar,) = s.segments[1].comms
    assert (ar.kind, ar.group_size, ar.payload) == ("allreduce", 2, T * H * 4)
    assert ar.sent == ar.received == 2 * (2 - 1) * (T * H * 4) // 2 == 8192
    assert s.sent == s.received == 8192
    assert s.flops == 266240 + 262144 + 2048


@pytest.mark.parametrize("d", [2, 4])
def test_sp_mlp_allgather_reduce_scatter(d):
    s = _summary("sp", d)
    # the row-parallel bias is added to the reduced rows inside the fused segment
    assert [seg.ops for seg in s.segments] == ["allgather+linear+gelu", "linear+reduce_scatter+add"]
    ag, rs = s.segments[0].comms[0], s.segments[1].comms[0]
    full = T * H * 4  # the gathered x and the unreduced partial output: [64, 32] f32
    assert (ag.kind, ag.payload, ag.sent, ag.received) == ("allgather", full, full * (d - 1) // d,
                                                           full * (d - 1) // d)
    assert (rs.kind, rs.payload, rs.sent) == ("reduce_scatter", full, full * (d - 1) // d)
    assert s.segments[0].flops == 2 * T * (F // d) * H + T * (F // d)
    assert s.segments[1].flops == 2 * T * H * (F // d) + (T // d) * H
    text = str(s)
    assert f"allgather (mesh_x, n={d})" in text and "fused (undecided)" in text
    assert text.splitlines()[-1].split()[0] == "total"


def test_send_recv_and_formatting():
    with FusionDefinition() as fd:
        x = fd.define_tensor([8, 4])
        y = fd.ops.set(x)
        fd.add_output(y)
        x.set_device_mesh(DeviceMesh([0, 1]))
        y.set_device_mesh(DeviceMesh([2, 3]))
        for tv in (x, y):
            tv.outer_split(0, 2)
            tv.axis(0).parallelize(ParallelType.mesh_x)
    fusion = run_pipeline(fd.fusion)
    s = summarize(fusion)  # rank 0 sends its shard to rank 2; rank 2 receives it
    (c,) = [c for seg in s.segments for c in seg.comms]
    assert (c.kind, c.payload, c.sent, c.received) == ("send_recv", 4 * 4 * 4, 64, 0)
    (c,) = [c for seg in summarize(fusion, rank=2).segments for c in seg.comms]
    assert (c.sent, c.received) == (0, 64)
    assert s.flops == 0
    assert format_bytes(512) == "512 B" and format_bytes(8192) == "8.0 KiB"
    assert format_bytes(3 * 2**29) == "1.5 GiB"
    assert format_flops(999) == "999" and format_flops(266240) == "266.2 k"
    assert format_flops(2 * 8192 * 14336 * 8192) == "1.924 T"


def test_symbolic_extent_is_a_clear_error():
    """A lowered fusion with a symbolic extent has no byte or FLOP counts (they came out negative): an error
    that says to summarize a compiled plan, which binds the extents."""
    mesh = DeviceMesh(range(2))
    with FusionDefinition() as fd:
        x, w = fd.define_tensor([-1, 4]), fd.define_tensor([6, 4])
        y = fd.ops.linear(x, w)
        fd.add_output(y)
        for tv in (x, w, y):
            tv.set_device_mesh(mesh)
        x.outer_split(0, 2).axis(0).parallelize(ParallelType.mesh_x)
    with pytest.raises(DefinitionError, match=r"T0 f32\[\?, 4\] has a symbolic extent, so its bytes and FLOPs are "
                                              r"unknown; summarize fd.compile\(global_input_shapes\) instead"):
        summarize(run_pipeline(fd.fusion))
    assert summarize(fd.compile([[8, 4], [6, 4]])).sent == 8 * 6 * 4 // 2  # y gathered


def test_pending_sum_on_two_mesh_axes_is_one_allreduce():
    """A sum over a dim that both axes of a 2x2 mesh split is one allreduce over the four devices: a ring
    sends 2 * 3/4 of the payload (one allreduce per axis sent 2 * 1/2 twice, 2x)."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([8, 16])
        fd.add_output(fd.ops.sum(x, [1]))
        x.set_device_mesh(DeviceMesh([[0, 1], [2, 3]]))
        x.outer_split(1, 2).axis(1).parallelize(ParallelType.mesh_y)
        x.outer_split(2, 2).axis(2).parallelize(ParallelType.mesh_x)  # [8, mesh_y{2}, mesh_x{2}, 4]
    s = summarize(run_pipeline(fd.fusion))
    (ar,) = [c for seg in s.segments for c in seg.comms]
    assert (ar.kind, ar.group, ar.group_size, ar.payload) == ("allreduce", "mesh_y+mesh_x, n=4", 4, 8 * 4)
    assert ar.sent == ar.received == 2 * 3 * 8 * 4 // 4
