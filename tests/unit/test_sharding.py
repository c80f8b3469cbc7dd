"""Sharding propagation, resharding and lowering on whole fusions, without a process group.

Each case builds a fusion with concrete global shapes, runs the whole pipeline with ``verify``
after every pass, and checks the shardings, the lowered ops and the segments. The cases follow
nvFuser's multidevice Python tests, plus the ones nvFuser gets wrong (broadcasts of device dims,
factory ops, a ``set`` that adds one sharding and removes another).
"""

from __future__ import annotations

import math

import pytest
import torch
from tp_fusion.sharding.sharding import Partial, Replicate, Shard, Sharding, shard_tensor, unshard_tensor

from tp_fusion import (
    DataType,
    DeviceMesh,
    FusionDefinition,
    ParallelType,
    ShardingError,
    TPFusionError,
    passes,
)
from tp_fusion.ops import OPS, Trait, traits
from tp_fusion.program import build_program
from tp_fusion.summary import summarize

X, Y = ParallelType.mesh_x, ParallelType.mesh_y
R = Replicate()
MESH2 = DeviceMesh(range(2))
MESH4 = DeviceMesh(range(4))
MESH22 = DeviceMesh(torch.arange(4).reshape(2, 2))


def shard(tv, mesh, dims: dict[int, ParallelType] | None = None) -> None:
    """Put ``tv`` on ``mesh`` and shard logical dim d on ``dims[d]`` (outer split, then parallelize)."""
    tv.set_device_mesh(mesh)
    for d, ptype in sorted((dims or {}).items(), reverse=True):  # right to left: loop indices stay valid
        i = next(i for i, ax in enumerate(tv._loop()) if ax.dim == d and not ax.reduction)  # past r{} axes
        tv.outer_split(i, mesh.shape[ptype.mesh_axis(mesh.ndim)])
        tv.axis(i).parallelize(ptype)


def lower(fd: FusionDefinition):
    return passes.run_pipeline(fd.fusion, check=True)


def kinds(f) -> list[str]:
    return [op.kind for op in f.ops]


def comms(f) -> list[str]:
    return [op.kind for op in f.ops if traits(op.kind) & Trait.COLLECTIVE]


def placements(f, tv) -> tuple:
    return f.tensor(tv.name if hasattr(tv, "name") else tv).sharding.placements


def out_placements(f, i: int = 0) -> tuple:
    return f.tensor(f.outputs[i]).sharding.placements


def seg_summary(f) -> list[tuple[str, str, list[str]]]:
    return [(s.kind, s.note, [f.ops[i].kind for i in s.ops]) for s in f.segments]


def only(f, kind: str):
    (op,) = [op for op in f.ops if op.kind == kind]
    return op


# --- linear layers ---------------------------------------------------------------------------


@pytest.mark.parametrize("bias", [False, True])
def test_column_parallel_linear(bias):
    with FusionDefinition() as fd:
        x, w = fd.define_tensor([8, 4]), fd.define_tensor([6, 4])
        b = fd.define_tensor([6]) if bias else None
        z = fd.ops.linear(x, w, b)
        fd.add_output(z)
        shard(x, MESH2)
        shard(w, MESH2, {0: X})
        if bias:
            shard(b, MESH2, {0: X})
    f = lower(fd)
    assert kinds(f) == ["linear"]  # no communication: each rank computes its columns
    assert placements(f, z) == (Shard(1),)
    assert placements(f, x) == (R,) and placements(f, w) == (Shard(0),)
    assert seg_summary(f) == [("compute", "", ["linear"])]


def test_row_parallel_linear_without_bias():
    with FusionDefinition() as fd:
        x, w = fd.define_tensor([8, 4]), fd.define_tensor([6, 4])
        z = fd.ops.linear(x, w)
        fd.add_output(z)
        shard(x, MESH2, {1: X})
        shard(w, MESH2, {1: X})
    f = lower(fd)
    assert kinds(f) == ["linear", "allreduce"]
    lin = only(f, "linear")
    assert placements(f, lin.outputs[0]) == (Partial(),)
    assert out_placements(f) == (R,)
    assert seg_summary(f) == [("fused", "linear+allreduce", ["linear", "allreduce"])]


def test_of_two_operands_sharded_alike_the_smaller_moves():
    """where(hit, logits, 0) with hit on rows and logits on columns (a vocab-parallel cross entropy with
    its targets sharded on tokens): the boolean hit moves to the logits' columns, not the logits to rows."""
    with FusionDefinition() as fd:
        hit, logits = fd.define_tensor([8, 16], dtype=DataType.Bool), fd.define_tensor([8, 16], dtype=DataType.Double)
        fd.add_output(fd.ops.where(hit, logits, 0.0))
        shard(hit, MESH2, {0: X})
        shard(logits, MESH2, {1: X})
    f = lower(fd)
    assert comms(f) == ["all_to_all"]
    assert f.tensor(only(f, "all_to_all").inputs[0]).dtype == DataType.Bool
    assert out_placements(f) == (Shard(1),)


@pytest.mark.parametrize("gemm, to", [
    (DataType.Float, DataType.BFloat16), (DataType.Float, DataType.Half), (DataType.BFloat16, DataType.Half),
    (DataType.BFloat16, DataType.Float), (DataType.Float, DataType.Double)])
def test_a_pending_sum_is_summed_before_a_cast(gemm, to):
    """A row-parallel linear's pending sum, cast as an output, is summed in the GEMM's dtype: before a
    narrowing cast it must be (rounded once, as torch rounds linear(x, w).to(bf16)); before a widening
    one it moves fewer bytes (as Megatron-LM sums in the GEMM's dtype, then casts)."""
    with FusionDefinition() as fd:
        x, w = fd.define_tensor([8, 4], dtype=gemm), fd.define_tensor([6, 4], dtype=gemm)
        z = fd.ops.cast(fd.ops.linear(x, w), to)
        fd.add_output(z)
        shard(x, MESH2, {1: X})
        shard(w, MESH2, {1: X})
    f = lower(fd)
    assert kinds(f) == ["linear", "allreduce", "cast"]
    assert f.tensor(only(f, "allreduce").inputs[0]).dtype == gemm


def test_a_pending_sum_cast_wider_for_ops_on_rows_is_reduce_scattered_in_its_dtype():
    """An SP RMSNorm backward in f32 of a bf16 GEMM's pending gradient, grad_x on rows: the gradient is
    reduce-scattered in bf16 (as Megatron-LM does; before: its f32 cast, twice the bytes)."""
    t, f, h = 16, 64, 32
    with FusionDefinition() as fd:
        gg, w = fd.define_tensor([t, f], dtype=DataType.BFloat16), fd.define_tensor([f, h], dtype=DataType.BFloat16)
        x, g = fd.define_tensor([t, h], dtype=DataType.Float), fd.define_tensor([h], dtype=DataType.Float)
        gy = fd.ops.cast(fd.ops.matmul(gg, w), DataType.Float)
        grad_x = fd.ops.mul(fd.ops.mul(gy, g), x)
        fd.add_output(grad_x)
        fd.add_output(fd.ops.sum(fd.ops.mul(gy, x), [0]))
        shard(gg, MESH2, {1: X})
        shard(w, MESH2, {0: X})
        shard(x, MESH2, {0: X})
        shard(grad_x, MESH2, {0: X})
    f = lower(fd)
    assert comms(f) == ["reduce_scatter", "allreduce"]
    assert f.tensor(only(f, "reduce_scatter").inputs[0]).dtype == DataType.BFloat16


def test_a_pending_sum_cast_wider_is_not_summed_onto_pieces_that_overlap():
    """A bf16 GEMM's pending sum (on mesh_x) cast to f32 for an op whose operand holds strided column pieces on
    both mesh axes: summing it in bf16 to the mesh_x piece (a reduce_scatter in its dtype), beside the GEMM's own
    mesh_y piece of the same columns, took pieces that overlap (S(1, outer=4) on both axes), which lowering
    refused (a LoweringError for a valid schedule; found by test_properties_dtypes, seed 323 on a [[0, 2], [1, 3]]
    mesh). It is summed after the cast then, where the pieces nest."""
    mesh = DeviceMesh(torch.tensor([[0, 2], [1, 3]]))
    with FusionDefinition() as fd:
        a = fd.define_tensor([6, 2], dtype=DataType.BFloat16)
        b = fd.define_tensor([2, 8], dtype=DataType.BFloat16)
        c = fd.define_tensor([6, 8], dtype=DataType.Float)
        fd.add_output(fd.ops.mul(fd.ops.cast(fd.ops.matmul(a, b), DataType.Float), c))
        for t in (a, b, c):
            t.set_device_mesh(mesh)
        a.inner_split(0, 2).axis(1).parallelize(X)  # [3, x{2}, y{2}]: rows strided, the contraction on mesh_y
        a.axis(2).parallelize(Y)
        b.axis(0).parallelize(X)  # [x{2}, 4, y{2}]: the contraction on mesh_x, columns strided on mesh_y
        b.inner_split(1, 2).axis(2).parallelize(Y)
        c.inner_split(0, 2).axis(1).parallelize(Y)  # [3, y{2}, 4, x{2}]
        c.inner_split(2, 2).axis(3).parallelize(X)
    f = lower(fd)
    assert out_placements(f) == (Shard(0, 3), Shard(1, 4))
    for t in f.tensors:
        if t.sharding is not None:
            assert all(t.sharding.nests(d) for d in range(len(t.shape))), t


def test_row_parallel_linear_with_bias_adds_bias_once():
    with FusionDefinition() as fd:
        x, w, b = fd.define_tensor([8, 4]), fd.define_tensor([6, 4]), fd.define_tensor([6])
        z = fd.ops.linear(x, w, b)
        fd.add_output(z)
        shard(x, MESH2, {1: X})
        shard(w, MESH2, {1: X})
        shard(b, MESH2)
        shard(z, MESH2)
    f = lower(fd)
    assert kinds(f) == ["linear", "allreduce", "add"]
    lin, ar, add = f.ops
    assert len(lin.inputs) == 2  # the GEMM runs without bias ...
    assert placements(f, lin.outputs[0]) == (Partial(),)
    assert add.inputs == (ar.outputs[0], b.name) and add.outputs == (z.name,)  # ... added after the sum
    assert placements(f, z) == (R,)
    assert seg_summary(f) == [("fused", "linear+allreduce+add", ["linear", "allreduce", "add"])]


@pytest.mark.parametrize("sp", [False, True])
def test_a_residual_add_after_the_reduction_joins_the_fused_segment(sp):
    """``x + linear(h, w, b)`` with a row-parallel linear: the bias add and then the residual add join the
    GEMM+reduction (the kernel adds the residual as its own rows' GEMM's C operand); the program's fused
    GEMM names both. An addend of another shape is left to a compute segment."""
    with FusionDefinition() as fd:
        x, h, w, b = fd.define_tensor([8, 6]), fd.define_tensor([8, 4]), fd.define_tensor([6, 4]), fd.define_tensor([6])
        z = fd.ops.add(x, fd.ops.linear(h, w, b))
        fd.add_output(z)
        shard(h, MESH2, {1: X})
        shard(w, MESH2, {1: X})
        shard(b, MESH2)
        shard(x, MESH2, {0: X} if sp else {})
        shard(z, MESH2, {0: X} if sp else {})
    f = lower(fd)
    reduction = "reduce_scatter" if sp else "allreduce"
    assert seg_summary(f) == [("fused", f"linear+{reduction}+add+add", ["linear", reduction, "add", "add"])]
    (fused,) = build_program(f, 0, torch.device("cpu")).segments
    assert (fused.fused.bias, fused.fused.residual, fused.fused.out) == (b.name, x.name, z.name)

    with FusionDefinition() as fd:  # a [1, 6] addend broadcasts over the rows: a compute segment adds it
        x, h, w, b = fd.define_tensor([1, 6]), fd.define_tensor([8, 4]), fd.define_tensor([6, 4]), fd.define_tensor([6])
        z = fd.ops.add(fd.ops.linear(h, w, b), x)
        fd.add_output(z)
        shard(h, MESH2, {1: X})
        shard(w, MESH2, {1: X})
        for tv in (b, x, z):
            shard(tv, MESH2)
    assert seg_summary(lower(fd)) == [("fused", "linear+allreduce+add", ["linear", "allreduce", "add"]),
                                      ("compute", "", ["add"])]


def test_row_parallel_linear_with_bias_and_sharded_output_adds_bias_shard_once():
    with FusionDefinition() as fd:
        x, w, b = fd.define_tensor([8, 4]), fd.define_tensor([6, 4]), fd.define_tensor([6])
        z = fd.ops.linear(x, w, b)
        fd.add_output(z)
        shard(x, MESH2, {1: X})
        shard(w, MESH2, {1: X})
        shard(b, MESH2)
        shard(z, MESH2, {1: X})  # scatter the out features
    f = lower(fd)
    assert kinds(f) == ["linear", "reduce_scatter", "local_slice", "add"]
    rs, sl = only(f, "reduce_scatter"), only(f, "local_slice")
    assert rs.attr("dim") == 1
    assert sl.inputs == (b.name,) and placements(f, sl.outputs[0]) == (Shard(0),)  # the bias's local slice
    assert placements(f, z) == (Shard(1),)


def test_an_op_with_a_result_assigned_to_another_mesh_is_planned():
    """native_layer_norm_backward on a 1x2 mesh, its weight gradient assigned to a 1-D mesh of the same
    devices: the bytes of the results' moves are counted with the op's mesh (an IndexError before)."""
    mesh_1x2 = DeviceMesh([[0, 1]])
    with FusionDefinition() as fd:
        gy, x, w = fd.define_tensor([4, 4]), fd.define_tensor([4, 4]), fd.define_tensor([4])
        mean = fd.ops.mean(x, [1], keepdim=True)
        rstd = fd.ops.rsqrt(fd.ops.add(fd.ops.var(x, [1], correction=0, keepdim=True), 1e-5))
        grad_x, grad_w, _ = fd.ops.native_layer_norm_backward(gy, x, [4], mean, rstd, w)
        fd.add_output(grad_x)
        fd.add_output(grad_w)
        shard(gy, mesh_1x2, {0: X})
        for tv in (x, w, grad_x):
            shard(tv, mesh_1x2)
        shard(grad_w, DeviceMesh([1, 0]))
    f = lower(fd)
    assert f.tensor(f.outputs[1]).sharding.mesh == DeviceMesh([1, 0])


def test_linear_reduce_scatter():
    with FusionDefinition() as fd:
        x, w = fd.define_tensor([8, 4]), fd.define_tensor([6, 4])
        z = fd.ops.linear(x, w)
        fd.add_output(z)
        shard(x, MESH2, {1: X})
        shard(w, MESH2, {1: X})
        shard(z, MESH2, {0: X})
    f = lower(fd)
    assert kinds(f) == ["linear", "reduce_scatter"]
    assert only(f, "reduce_scatter").attr("dim") == 0
    assert seg_summary(f) == [("fused", "linear+reduce_scatter", ["linear", "reduce_scatter"])]


def test_sequence_parallel_linear_allgathers_the_tokens():
    with FusionDefinition() as fd:
        x, w = fd.define_tensor([8, 4]), fd.define_tensor([6, 4])
        z = fd.ops.linear(x, w)
        fd.add_output(z)
        shard(x, MESH2, {0: X})
        shard(w, MESH2, {0: X})
        shard(z, MESH2, {1: X})
    f = lower(fd)
    assert kinds(f) == ["allgather", "linear"]
    ag = only(f, "allgather")
    assert ag.inputs == (x.name,) and ag.attr("dim") == 0 and ag.attr("mesh_axis") == 0
    assert placements(f, ag.outputs[0]) == (R,)
    assert seg_summary(f) == [("fused", "allgather+linear", ["allgather", "linear"])]


# --- linear with a weight of leading dims (nvFuser's logical split) --------------------------


@pytest.mark.parametrize("bias", [False, True])
def test_logical_split_linear_shards_the_leading_dim_without_communication(bias):
    """w[d, out, in] and b[d, out] sharded on d: the output [d, b, s, out] is sharded on its dim 0."""
    with FusionDefinition() as fd:
        x, w = fd.define_tensor([2, 3, 8]), fd.define_tensor([4, 6, 8])
        b = fd.define_tensor([4, 6]) if bias else None
        z = fd.ops.linear(x, w, b)
        fd.add_output(z)
        shard(x, MESH2)
        for tv in (w, b) if bias else (w,):
            shard(tv, MESH2, {0: X})
    f = lower(fd)
    assert kinds(f) == ["linear"]
    assert out_placements(f) == (Shard(0),)
    assert [str(ax) for ax in z._loop()] == ["4", "2", "3", "6", "r{8}"]  # r{in} last, as a 2-D weight's


def test_logical_split_linear_shards_out_features_and_leading_dims_on_two_mesh_axes():
    with FusionDefinition() as fd:
        x, w, b = fd.define_tensor([3, 8]), fd.define_tensor([4, 6, 8]), fd.define_tensor([4, 6])
        z = fd.ops.linear(x, w, b)
        fd.add_output(z)
        shard(x, MESH22)
        shard(w, MESH22, {0: Y, 1: X})
        shard(b, MESH22, {0: Y, 1: X})
    f = lower(fd)
    assert kinds(f) == ["linear"]
    assert out_placements(f) == (Shard(0), Shard(2))


def test_logical_split_linear_row_parallel_is_not_fused():
    """A sharded contraction leaves the output partial and an allreduce sums it; the fused GEMM kernels
    take a 2-D weight, so the GEMM and the allreduce stay apart."""
    with FusionDefinition() as fd:
        x, w = fd.define_tensor([2, 3, 8]), fd.define_tensor([4, 6, 8])
        z = fd.ops.linear(x, w)
        fd.add_output(z)
        shard(x, MESH2, {2: X})
        shard(w, MESH2, {2: X})
    f = lower(fd)
    assert kinds(f) == ["linear", "allreduce"]
    assert placements(f, only(f, "linear").outputs[0]) == (Partial(),)
    assert seg_summary(f) == [("compute", "", ["linear"]), ("communication", "", ["allreduce"]),]


@pytest.mark.parametrize("mesh,w_dims,b_dims,out", [
    (MESH2, {2: X}, {}, (R,)),
    (MESH22, {0: Y, 2: X}, {0: Y}, (Shard(0), R)),
], ids=["1d", "2x2_leading_dim_on_mesh_y"])
def test_logical_split_linear_row_parallel_adds_the_bias_once_broadcast(mesh, w_dims, b_dims, out):
    """With a bias and a sharded contraction the bias [d, out] is added after the sum, broadcast to the
    output's dims [d, 1, 1, out] (and sharded as the output's leading dim is)."""
    with FusionDefinition() as fd:
        x, w, b = fd.define_tensor([2, 3, 8]), fd.define_tensor([4, 6, 8]), fd.define_tensor([4, 6])
        z = fd.ops.linear(x, w, b)
        fd.add_output(z)
        shard(x, mesh, {2: X})
        shard(w, mesh, w_dims)
        shard(b, mesh, b_dims)
    f = lower(fd)
    assert kinds(f) == ["linear", "allreduce", "broadcast_in_dim", "add"]
    lin, ar, wide, add = f.ops
    assert len(lin.inputs) == 2 and wide.inputs == (b.name,)
    assert f.tensor(wide.outputs[0]).shape == (4, 1, 1, 6) and wide.attr("broadcast_dims") == (0, 3)
    assert add.inputs == (ar.outputs[0], wide.outputs[0]) and add.outputs == (z.name,)
    assert out_placements(f) == out and placements(f, wide.outputs[0]) == out
    assert seg_summary(f)[0] == ("compute", "", ["linear"])


def test_logical_split_linear_with_gathered_tokens_is_not_fused():
    with FusionDefinition() as fd:
        x, w = fd.define_tensor([8, 4]), fd.define_tensor([2, 6, 4])
        z = fd.ops.linear(x, w)
        fd.add_output(z)
        shard(x, MESH2, {0: X})
        shard(w, MESH2, {1: X})
        shard(z, MESH2, {2: X})
    f = lower(fd)
    assert kinds(f) == ["allgather", "linear"]
    assert seg_summary(f) == [("communication", "", ["allgather"]), ("compute", "", ["linear"])]


# --- grouped_mm ----------------------------------------------------------------------------------


def _grouped_mm(mesh, mat1_dims, mat2_dims, offsets_dims=None, out_dims=None):
    """mat1 [32, 8] by mat2 [4, 8, 6] in 4 groups (offsets [4]) -> [32, 6]."""
    with FusionDefinition() as fd:
        mat1, mat2 = fd.define_tensor([32, 8]), fd.define_tensor([4, 8, 6])
        offsets = fd.define_tensor([4], dtype=DataType.Int32)
        z = fd.ops.grouped_mm(mat1, mat2, offsets)
        fd.add_output(z)
        shard(mat1, mesh, mat1_dims)
        shard(mat2, mesh, mat2_dims)
        shard(offsets, mesh, offsets_dims)
        if out_dims is not None:
            shard(z, mesh, out_dims)
    return fd, lower(fd)


def test_grouped_mm_loop_domain_ends_with_the_contraction():
    with FusionDefinition() as fd:
        z = fd.ops.grouped_mm(fd.define_tensor([-1, 8]), fd.define_tensor([4, 8, 6]),
                              fd.define_tensor([4], dtype=DataType.Int32))
    assert [str(ax) for ax in z._loop()] == ["?", "6", "r{8}"]  # nvFuser's [m, n, rk]


def test_column_parallel_grouped_mm_needs_no_communication():
    fd, f = _grouped_mm(MESH2, {}, {2: X})
    assert kinds(f) == ["grouped_mm"]
    assert out_placements(f) == (Shard(1),)
    assert fd.compile([[32, 8], [4, 8, 6], [4]]).collectives() == []


def test_row_parallel_grouped_mm_sums_with_one_allreduce_not_fused():
    """k sharded on both operands: a partial output, summed by an allreduce; grouped_mm is no GEMM the
    fused kernels run (its right operand is a stack of matrices), so the two stay apart."""
    fd, f = _grouped_mm(MESH2, {1: X}, {1: X})
    assert kinds(f) == ["grouped_mm", "allreduce"]
    assert placements(f, only(f, "grouped_mm").outputs[0]) == (Partial(),)
    assert out_placements(f) == (R,)
    assert seg_summary(f) == [("compute", "", ["grouped_mm"]), ("communication", "", ["allreduce"])]
    assert fd.compile([[32, 8], [4, 8, 6], [4]]).collectives() == ["allreduce"]


def test_row_parallel_grouped_mm_scatters_out_features():
    fd, f = _grouped_mm(MESH2, {1: X}, {1: X}, out_dims={1: X})
    assert kinds(f) == ["grouped_mm", "reduce_scatter"]
    assert seg_summary(f)[0] == ("compute", "", ["grouped_mm"])


def test_expert_parallel_grouped_mm_sums_each_ranks_experts():
    """mat2 sharded on its groups (experts): each rank multiplies the rows of the experts it holds, a partial
    output that one allreduce sums; no expert's weight is gathered."""
    fd, f = _grouped_mm(MESH2, {}, {0: X})
    assert kinds(f) == ["grouped_mm", "allreduce"]
    assert placements(f, only(f, "grouped_mm").outputs[0]) == (Partial(),)


@pytest.mark.parametrize("mat1_dims,mat2_dims,offsets_dims,gathered", [
    ({0: X}, {}, {}, "mat1"),  # rows: the offsets are global row positions
    ({}, {}, {0: X}, "offsets"),
], ids=["rows", "offsets"])
def test_grouped_mm_gathers_sharded_rows_and_offsets(mat1_dims, mat2_dims, offsets_dims, gathered):
    fd, f = _grouped_mm(MESH2, mat1_dims, mat2_dims, offsets_dims)
    assert kinds(f) == ["allgather", "grouped_mm"]
    ag, gmm = f.ops
    assert ag.inputs == ({"mat1": 0, "mat2": 1, "offsets": 2}[gathered],)
    assert gmm.inputs[{"mat1": 0, "mat2": 1, "offsets": 2}[gathered]] == ag.outputs[0]


def test_grouped_mm_rule_keeps_rows_and_offsets_whole():
    with FusionDefinition() as fd:
        fd.add_output(fd.ops.grouped_mm(fd.define_tensor([32, 8]), fd.define_tensor([4, 8, 6]),
                                        fd.define_tensor([4], dtype=DataType.Int32)))
    (op,) = fd.fusion.ops
    cands = {(c.inputs, c.outputs) for c in OPS["grouped_mm"].rule(op, fd.fusion, 2)}
    assert cands == {
        ((R, R, R), (R,)),
        ((R, Shard(2), R), (Shard(1),)),  # n: column parallel
        ((Shard(1), Shard(1), R), (Partial(),)),  # k: row parallel
        ((R, Shard(0), R), (Partial(),)),  # g: expert parallel, each rank its experts' rows
        ((Partial(), R, R), (Partial(),)), ((R, Partial(), R), (Partial(),)),  # linear in each operand
    }


# --- MLPs ------------------------------------------------------------------------------------


def _mlp(mesh, d_tp: int, mode: str, shape=(8, 4)):
    """linear(+b1) -> gelu(tanh) -> linear(+b2). ``mode``: tp, sp or dp_tp (x's batch on mesh_y)."""
    with FusionDefinition() as fd:
        h = shape[-1]
        x = fd.define_tensor(list(shape))
        w1, b1 = fd.define_tensor([4 * h, h]), fd.define_tensor([4 * h])
        w2, b2 = fd.define_tensor([h, 4 * h]), fd.define_tensor([h])
        y = fd.ops.gelu(fd.ops.linear(x, w1, b1), approximate="tanh")
        z = fd.ops.linear(y, w2, b2)
        fd.add_output(z)
        for tv in (x, w1, b1, w2, b2, z):
            shard(tv, mesh)
        for tv in (w1, b1):
            shard(tv, mesh, {0: X})
        shard(w2, mesh, {1: X})
        if mode == "sp":
            shard(x, mesh, {0: X})
            shard(z, mesh, {0: X})
        if mode == "dp_tp":
            shard(x, mesh, {0: Y})
            shard(z, mesh, {0: Y})
    return fd, (x, w1, b1, w2, b2, y, z)


TP_MLP_GOLDEN = """\
Fusion(inputs=[T0, T1, T2, T3, T4], outputs=[T7])
  T0 = input : f32[8, 4] @mesh(0 1)[8, 4]
  T1 = input : f32[16, 4] @mesh(0 1)[mesh_x{2}, 8, 4]
  T2 = input : f32[16] @mesh(0 1)[mesh_x{2}, 8]
  T3 = input : f32[4, 16] @mesh(0 1)[4, mesh_x{2}, 8]
  T4 = input : f32[4] @mesh(0 1)[4]
  T5 = linear(T0, T1, T2) : f32[8, 16] @mesh(0 1)[8, mesh_x{2}, 8]
  T6 = gelu(T5, approximate='tanh') : f32[8, 16] @mesh(0 1)[8, mesh_x{2}, 8]
  T8 = linear(T6, T3) : f32[8, 4] @mesh(0 1)[8, 4] partial(sum: mesh_x)
  T9 = allreduce(T8, mesh_axis=0) : f32[8, 4] @mesh(0 1)[8, 4]
  T7 = add(T9, T4) : f32[8, 4] @mesh(0 1)[8, 4]"""

SP_MLP_GOLDEN = """\
Fusion(inputs=[T0, T1, T2, T3, T4], outputs=[T7])
  T0 = input : f32[8, 4] @mesh(0 1)[mesh_x{2}, 4, 4]
  T1 = input : f32[16, 4] @mesh(0 1)[mesh_x{2}, 8, 4]
  T2 = input : f32[16] @mesh(0 1)[mesh_x{2}, 8]
  T3 = input : f32[4, 16] @mesh(0 1)[4, mesh_x{2}, 8]
  T4 = input : f32[4] @mesh(0 1)[4]
  T8 = allgather(T0, mesh_axis=0, dim=0) : f32[8, 4] @mesh(0 1)[8, 4]
  T5 = linear(T8, T1, T2) : f32[8, 16] @mesh(0 1)[8, mesh_x{2}, 8]
  T6 = gelu(T5, approximate='tanh') : f32[8, 16] @mesh(0 1)[8, mesh_x{2}, 8]
  T9 = linear(T6, T3) : f32[8, 4] @mesh(0 1)[8, 4] partial(sum: mesh_x)
  T10 = reduce_scatter(T9, mesh_axis=0, dim=0) : f32[8, 4] @mesh(0 1)[mesh_x{2}, 4, 4]
  T7 = add(T10, T4) : f32[8, 4] @mesh(0 1)[mesh_x{2}, 4, 4]"""


def test_tp_mlp_golden_ir():
    fd, _ = _mlp(MESH2, 2, "tp")
    f = lower(fd)
    assert str(f) == TP_MLP_GOLDEN
    assert seg_summary(f) == [("compute", "", ["linear", "gelu"]),
                              ("fused", "linear+allreduce+add", ["linear", "allreduce", "add"])]


def test_sp_mlp_golden_ir():
    fd, _ = _mlp(MESH2, 2, "sp")
    f = lower(fd)
    assert str(f) == SP_MLP_GOLDEN
    assert seg_summary(f) == [("fused", "allgather+linear+gelu", ["allgather", "linear", "gelu"]),
                              ("fused", "linear+reduce_scatter+add", ["linear", "reduce_scatter", "add"])]


def test_sp_mlp_on_a_mesh_out_of_rank_order_is_not_fused():
    """The fused kernels take a rank's chunk by its process-group rank, which a mesh listing its ranks
    out of increasing order does not give; the plain collectives reorder the pieces instead."""
    fd, _ = _mlp(DeviceMesh([1, 0]), 2, "sp")
    f = lower(fd)
    assert comms(f) == ["allgather", "reduce_scatter"]
    assert [kind for kind, _, _ in seg_summary(f)] == ["communication", "compute", "communication", "compute"]


@pytest.mark.parametrize("mode", ["tp", "sp"])
def test_mlp_on_four_devices(mode):
    fd, (x, w1, b1, w2, b2, y, z) = _mlp(MESH4, 4, mode, shape=(8, 8))
    f = lower(fd)
    assert comms(f) == (["allreduce"] if mode == "tp" else ["allgather", "reduce_scatter"])
    assert placements(f, y) == (Shard(1),)
    assert placements(f, z) == ((R,) if mode == "tp" else (Shard(0),))


def test_dp_tp_mlp_on_2x2_mesh():
    fd, (x, w1, b1, w2, b2, y, z) = _mlp(MESH22, 2, "dp_tp", shape=(4, 2, 8))
    f = lower(fd)
    # mesh_y (axis 0) carries the batch, mesh_x (axis 1) the hidden features.
    assert placements(f, x) == (Shard(0), R)
    assert placements(f, y) == (Shard(0), Shard(2))
    assert kinds(f) == ["linear", "gelu", "linear", "allreduce", "add"]
    lin2, ar = f.ops[2], f.ops[3]
    assert placements(f, lin2.outputs[0]) == (Shard(0), Partial())
    assert ar.attr("mesh_axis") == 1  # only across the TP groups, not across data-parallel replicas
    assert placements(f, z) == (Shard(0), R)


def test_dp_tp_mlp_unannotated_output_keeps_the_batch_sharding():
    with FusionDefinition() as fd:
        x, w = fd.define_tensor([4, 8]), fd.define_tensor([6, 8])
        z = fd.ops.linear(x, w)
        fd.add_output(z)
        shard(x, MESH22, {0: Y, 1: X})
        shard(w, MESH22, {1: X})
    f = lower(fd)
    assert comms(f) == ["allreduce"] and only(f, "allreduce").attr("mesh_axis") == 1
    assert out_placements(f) == (Shard(0), R)  # materialized, never Partial


# --- explicit sets and sums ------------------------------------------------------------------


@pytest.mark.parametrize("src,dst,expected,attrs", [
    ({0: X}, {}, ["allgather"], {"dim": 0}),
    ({}, {0: X}, ["local_slice"], {"dim": 0}),
    ({0: X}, {1: X}, ["all_to_all"], {"src_dim": 0, "dim": 1}),
    ({1: X}, {0: X}, ["all_to_all"], {"src_dim": 1, "dim": 0}),
    ({0: X}, {0: X}, ["set"], {}),  # no resharding: a plain local copy
])
def test_set_lowering_1d(src, dst, expected, attrs):
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 6])
        z = fd.ops.set(x)
        fd.add_output(z)
        shard(x, MESH2, src)
        shard(z, MESH2, dst)
    f = lower(fd)
    assert kinds(f) == expected
    op = f.ops[0]
    assert op.inputs == (x.name,) and op.outputs == (z.name,)
    for k, v in attrs.items():
        assert op.attr(k) == v
    assert [s.kind for s in f.segments] == ["communication" if traits(expected[0]) & Trait.COLLECTIVE else "compute"]


MESH_10 = DeviceMesh([1, 0])


@pytest.mark.parametrize("src,src_mesh,dst_mesh,expected,attrs", [
    ({0: X}, MESH_10, DeviceMesh([0]), ["gather"], {"dim": 0}),  # into one of its devices, not the first
    ({1: X}, MESH4, DeviceMesh([2]), ["gather"], {"dim": 1}),
    ({}, DeviceMesh([1]), MESH4, ["scatter"], {"dim": 0}),  # the destination is sharded on dim 0 below
    ({0: X}, MESH2, DeviceMesh([2]), ["allgather", "broadcast"], {}),  # a device outside the mesh
    ({0: X, 1: Y}, MESH22, DeviceMesh([0]), ["allgather", "allgather"], {}),  # a 2-D mesh: gathered, then kept
    ({}, MESH_10, DeviceMesh([0]), [], {}),  # replicated: the device holds it already
    ({}, MESH22, DeviceMesh([3]), [], {}),
    ({}, MESH2, DeviceMesh([2]), ["broadcast"], {}),  # replicated, but not on that device
])
def test_moves_between_a_mesh_and_one_of_its_devices(src, src_mesh, dst_mesh, expected, attrs):
    with FusionDefinition() as fd:
        x = fd.define_tensor([8, 8])
        z = fd.ops.set(x)
        fd.add_output(z)
        shard(x, src_mesh, src)
        shard(z, dst_mesh, {0: X} if dst_mesh.size > 1 else {})
    f = lower(fd)
    assert comms(f) == expected
    for k, v in attrs.items():
        assert f.ops[0].attr(k) == v
    if expected == ["gather"]:  # the [8, 8] float32 value: 256 B, a piece of 256/n from each other rank
        n, root = src_mesh.size, dst_mesh.devices[0]
        other = next(r for r in src_mesh.devices if r != root)
        for rank, moved in ((root, (0, 256 * (n - 1) // n)), (other, (256 // n, 0)), (5, (0, 0))):
            cost = summarize(f, rank).segments[0].comms[0]
            assert (cost.kind, cost.sent, cost.received) == ("gather", *moved), rank


def test_partial_sum_into_one_device_is_a_reduce():
    with FusionDefinition() as fd:
        x, w = fd.define_tensor([4, 8]), fd.define_tensor([6, 8])
        y = fd.ops.linear(x, w)
        z = fd.ops.set(y)
        fd.add_output(z)
        shard(x, MESH_10, {1: X})
        shard(w, MESH_10, {1: X})
        y.set_device_mesh(MESH_10)
        y.outer_split(-1, 2)
        y.axis(-2).parallelize(X)
        shard(z, DeviceMesh([1]))
    f = lower(fd)
    assert comms(f) == ["reduce"] and placements(f, z) == (R,)


@pytest.mark.parametrize("body,expected,op_mesh", [
    (lambda fd, x: fd.ops.sum(x, [1]), ["sum", "reduce"], MESH_10),
    (lambda fd, x: fd.ops.sum(x, [0]), ["sum", "gather"], MESH_10),
    (lambda fd, x: fd.ops.exp(x), ["gather", "exp"], DeviceMesh([0])),  # its result is no smaller
])
def test_an_op_into_one_device_moves_the_smaller_of_its_result_and_its_operands(body, expected, op_mesh):
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 8])
        z = body(fd, x)
        fd.add_output(z)
        shard(x, MESH_10, {1: X})
        shard(z, DeviceMesh([0]))
    f = lower(fd)
    assert kinds(f) == expected and placements(f, z) == (R,)
    op = next(op for op in f.ops if op.kind in ("sum", "exp"))
    assert f.tensor(op.inputs[0]).sharding.mesh == op_mesh


def test_sum_over_sharded_dim_to_replicated_is_allreduce():
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 6])
        z = fd.ops.sum(x, [0])
        fd.add_output(z)
        shard(x, MESH2, {0: X})
    f = lower(fd)
    assert kinds(f) == ["sum", "allreduce"]
    assert placements(f, f.ops[0].outputs[0]) == (Partial(),)
    assert out_placements(f) == (R,)
    assert seg_summary(f) == [("compute", "", ["sum"]), ("communication", "", ["allreduce"])]


def test_sum_over_sharded_dim_to_sharded_is_reduce_scatter():
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 6])
        z = fd.ops.sum(x, [0])
        fd.add_output(z)
        shard(x, MESH2, {0: X})
        shard(z, MESH2, {0: X})
    f = lower(fd)
    assert kinds(f) == ["sum", "reduce_scatter"]
    assert only(f, "reduce_scatter").attr("dim") == 0


def test_sum_over_unsharded_dim_needs_no_communication():
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 6, 2])
        z = fd.ops.sum(x, [1])
        fd.add_output(z)
        shard(x, MESH2, {0: X})
    f = lower(fd)
    assert kinds(f) == ["sum"]
    assert out_placements(f) == (Shard(0),)


def test_mean_and_amax_over_sharded_dim():
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 6])
        m = fd.ops.mean(x, [1])
        a = fd.ops.amax(x, [1])
        fd.add_output(m)
        fd.add_output(a)
        shard(x, MESH2, {1: X})
    f = lower(fd)
    # mean leaves partial sums, amax partial maxima: an allreduce of each (amax's of its op).
    assert kinds(f) == ["mean", "allreduce", "amax", "allreduce"]
    assert placements(f, only(f, "mean").outputs[0]) == (Partial(),)
    assert placements(f, only(f, "amax").outputs[0]) == (Partial("max"),)
    assert [op.attr("reduce_op", "sum") for op in f.ops if op.kind == "allreduce"] == ["sum", "max"]
    assert out_placements(f, 0) == (R,) and out_placements(f, 1) == (R,)


@pytest.mark.parametrize("shape,grows", [([4, 8], True), ([4, 1], False)])
def test_a_pending_sum_is_summed_before_a_broadcast_that_grows_it(shape, grows):
    """Row sums over a sharded dim broadcast back over it: the [4] sums are allreduced, not the broadcast
    [4, 8] reduce_scattered (a black-box hunt found 1000x the bytes). A broadcast adding only dims of
    extent 1 keeps them pending."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 8])
        s = fd.ops.sum(x, [1])
        b = fd.ops.broadcast_in_dim(s, shape, [0])
        fd.add_output(fd.ops.mul(b, 2.0))
        shard(x, MESH2, {1: X})
    f = lower(fd)
    assert placements(f, b) == ((R,) if grows else (Partial(),))
    assert kinds(f) == (["sum", "allreduce", "broadcast_in_dim", "mul"] if grows else
                        ["sum", "broadcast_in_dim", "mul", "allreduce"])


def test_partial_is_materialized_before_a_nonlinear_op():
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 6])
        s = fd.ops.sum(x, [0])
        z = fd.ops.exp(fd.ops.mul(s, 2.0))
        fd.add_output(z)
        shard(x, MESH2, {0: X})
    f = lower(fd)
    # mul by a constant is linear (stays Partial); exp is not (allreduce first).
    assert kinds(f) == ["sum", "mul", "allreduce", "exp"]
    assert placements(f, only(f, "mul").outputs[0]) == (Partial(),)


def test_add_of_two_partials_stays_partial():
    with FusionDefinition() as fd:
        x, y = fd.define_tensor([4, 6]), fd.define_tensor([4, 6])
        z = fd.ops.add(fd.ops.sum(x, [0]), fd.ops.sum(y, [0]))
        fd.add_output(z)
        shard(x, MESH2, {0: X})
        shard(y, MESH2, {0: X})
    f = lower(fd)
    assert kinds(f) == ["sum", "sum", "add", "allreduce"]  # one allreduce for both


# --- pointwise -------------------------------------------------------------------------------


def test_pointwise_on_sharded_data_stays_local():
    with FusionDefinition() as fd:
        x, y = fd.define_tensor([4, 6]), fd.define_tensor([4, 6])
        z = fd.ops.tanh(fd.ops.mul(fd.ops.add(x, y), 3.0))
        fd.add_output(z)
        shard(x, MESH2, {1: X})
        shard(y, MESH2, {1: X})
    f = lower(fd)
    assert kinds(f) == ["add", "mul", "tanh"]
    assert all(t.sharding.placements == (Shard(1),) for t in f.tensors)


def test_replicated_and_sharded_operands_slice_locally():
    with FusionDefinition() as fd:
        x, y = fd.define_tensor([4, 6]), fd.define_tensor([4, 6])
        z = fd.ops.add(x, y)
        fd.add_output(z)
        shard(x, MESH2, {0: X})
        shard(y, MESH2)
    f = lower(fd)
    assert kinds(f) == ["local_slice", "add"]  # a local slice of the replicated operand, no collective
    assert only(f, "local_slice").inputs == (y.name,)
    assert out_placements(f) == (Shard(0),)
    assert [s.kind for s in f.segments] == ["compute"]


def test_unannotated_inputs_are_replicated():
    with FusionDefinition() as fd:
        x, y = fd.define_tensor([4, 6]), fd.define_tensor([4, 6])
        z = fd.ops.add(x, y)
        fd.add_output(z)
        shard(x, MESH2, {1: X})
    f = lower(fd)
    assert placements(f, y) == (R,)
    assert f.tensor(y.name).annotated is False
    assert out_placements(f) == (Shard(1),)


def test_annotated_tensors_are_never_changed_by_propagation():
    fd, tvs = _mlp(MESH2, 2, "sp")
    before = {tv.name: fd.fusion.tensor(tv.name) for tv in tvs if fd.fusion.tensor(tv.name).annotated}
    assert set(before) == {tvs[i].name for i in (0, 1, 2, 3, 4, 6)}
    propagated = passes.propagate_shardings(fd.fusion)
    lowered = lower(fd)
    for name, t in before.items():
        assert propagated.tensor(name) == t
        # Lowering keeps its sharding; where a copy or an add now produces it, its loop drops the serial
        # reduction axis r{K} of the linear it came from (that linear writes a new, partial tensor).
        after = lowered.tensor(name)
        assert after.sharding == t.sharding and after.shape == t.shape
        assert after.loop == tuple(a for a in t.loop if not a.reduction), name
    # an annotated intermediate is honoured too, even where propagation would choose otherwise
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 6])
        y = fd.ops.relu(x)
        z = fd.ops.neg(y)
        fd.add_output(z)
        shard(x, MESH2, {0: X})
        shard(y, MESH2, {1: X})
    f = lower(fd)
    assert placements(f, y) == (Shard(1),)
    assert kinds(f) == ["relu", "all_to_all", "neg"]  # relu runs as the input is, then y is resharded
    assert out_placements(f) == (Shard(1),)


# --- what nvFuser gets wrong -----------------------------------------------------------------


def test_broadcast_in_dim_of_sharded_dim_keeps_the_sharding():
    with FusionDefinition() as fd:
        x = fd.define_tensor([8])
        y = fd.ops.broadcast_in_dim(x, [4, 8], [1])
        z = fd.ops.add(y, 1.0)
        fd.add_output(z)
        shard(x, MESH2, {0: X})
    f = lower(fd)
    assert kinds(f) == ["broadcast_in_dim", "add"]
    assert placements(f, y) == (Shard(1),) and out_placements(f) == (Shard(1),)


@pytest.mark.parametrize("grow", ["unsqueeze", "broadcast_in_dim"])
@pytest.mark.parametrize("annotated", [True, False])
def test_a_sharded_source_is_gathered_before_it_grows(grow, annotated):
    """A per-token scale s [T] on token shards times a replicated y [T, H], needed whole (an annotated
    output, or a column-parallel linear's input): s is gathered ([T]) and the product made whole, not the
    product [T, H] made on rows and gathered (H times the bytes)."""
    with FusionDefinition() as fd:
        s, y = fd.define_tensor([8], dtype=DataType.Double), fd.define_tensor([8, 16], dtype=DataType.Double)
        sb = fd.ops.unsqueeze(s, 1) if grow == "unsqueeze" else fd.ops.broadcast_in_dim(s, [8, 16], [0])
        z = fd.ops.mul(y, sb)
        if not annotated:
            w = fd.define_tensor([4, 16], dtype=DataType.Double)
            z = fd.ops.linear(z, w)
            shard(w, MESH2, {0: X})
        fd.add_output(z)
        shard(s, MESH2, {0: X})
        shard(y, MESH2)
        if annotated:
            shard(z, MESH2)
    f = lower(fd)
    assert comms(f) == ["allgather"]
    assert f.tensor(only(f, "allgather").inputs[0]).shape in ((8,), (8, 1))


def test_a_one_hot_of_token_sharded_targets_gathers_the_targets():
    """A sequence-parallel vocab-parallel cross entropy's backward, softmax(logits) - one_hot(tgt) with
    the logits on vocabulary shards and tgt, lse on token shards: tgt and lse ([T]) are gathered and
    broadcast on each rank's vocabulary columns, not the one-hot and exp's [T, V] all_to_all'd."""
    t, e, v = 8, 4, 32
    with FusionDefinition() as fd:
        h, emb = fd.define_tensor([t, e]), fd.define_tensor([v, e])
        tgt, lse = fd.define_tensor([t], dtype=DataType.Int), fd.define_tensor([t])
        logits = fd.ops.linear(h, emb)
        hit = fd.ops.eq(fd.ops.broadcast_in_dim(fd.ops.iota(v, dtype=DataType.Int), [t, v], [1]),
                        fd.ops.broadcast_in_dim(tgt, [t, v], [0]))
        p = fd.ops.exp(fd.ops.sub(logits, fd.ops.broadcast_in_dim(lse, [t, v], [0])))
        grad_h = fd.ops.matmul(fd.ops.sub(p, fd.ops.cast(hit, DataType.Float)), emb)
        fd.add_output(grad_h)
        for tv in (h, tgt, lse, grad_h, emb):
            shard(tv, MESH2, {0: X})
    f = lower(fd)
    assert comms(f) == ["allgather", "allgather", "allgather", "reduce_scatter"]
    gathered = [f.tensor(op.inputs[0]).shape for op in f.ops if op.kind == "allgather"]
    assert sorted(gathered) == [(t,), (t,), (t, e)]  # tgt, lse and the hidden states h


def test_pointwise_broadcast_of_sharded_dim():
    with FusionDefinition() as fd:
        x, w = fd.define_tensor([8, 1]), fd.define_tensor([8, 4])
        z = fd.ops.mul(x, w)  # x's size-1 dim broadcasts, its sharded dim 0 lines up with w's
        fd.add_output(z)
        shard(x, MESH2, {0: X})
    f = lower(fd)
    assert kinds(f) == ["local_slice", "mul"]
    assert out_placements(f) == (Shard(0),)
    with FusionDefinition() as fd:
        x, w = fd.define_tensor([8]), fd.define_tensor([4, 8])
        z = fd.ops.add(x, w)  # a rank-1 operand broadcast over the rows
        fd.add_output(z)
        shard(x, MESH2, {0: X})
    f = lower(fd)
    assert comms(f) == [] and out_placements(f) == (Shard(1),)


def test_factory_op_is_sharded_by_backward_propagation():
    with FusionDefinition() as fd:
        x = fd.define_tensor([8, 4])
        c = fd.ops.full([8, 4], 2.0, DataType.Float)
        z = fd.ops.add(x, c)
        fd.add_output(z)
        shard(x, MESH2, {0: X})
    f = lower(fd)
    assert kinds(f) == ["full", "add"]  # created sharded: no slice, no communication
    assert placements(f, c) == (Shard(0),)


def test_broadcast_of_replicated_tensor_is_sharded_by_backward_propagation():
    with FusionDefinition() as fd:
        x, b = fd.define_tensor([8, 4]), fd.define_tensor([4])
        bb = fd.ops.broadcast_in_dim(b, [8, 4], [1])
        z = fd.ops.add(x, bb)
        fd.add_output(z)
        shard(x, MESH2, {0: X})
    f = lower(fd)
    assert kinds(f) == ["broadcast_in_dim", "add"]
    assert placements(f, b) == (R,)  # the input stays as given (replicated) ...
    assert placements(f, bb) == (Shard(0),)  # ... the broadcast produces only this rank's rows


def test_sp_residual_add_of_replicated_computation():
    # h = x_sp + relu(r): r is a replicated input; relu(r) is computed on the local rows only.
    with FusionDefinition() as fd:
        x, r = fd.define_tensor([8, 4]), fd.define_tensor([8, 4])
        rr = fd.ops.relu(r)
        z = fd.ops.add(x, rr)
        fd.add_output(z)
        shard(x, MESH2, {0: X})
    f = lower(fd)
    assert comms(f) == []
    assert placements(f, rr) == (Shard(0),)
    assert kinds(f) == ["local_slice", "relu", "add"]


def test_backward_keeps_replicated_when_consumers_disagree():
    with FusionDefinition() as fd:
        x, r = fd.define_tensor([8, 4]), fd.define_tensor([8, 4])
        s = fd.ops.relu(r)
        fd.add_output(fd.ops.add(x, s))  # wants s sharded on rows
        fd.add_output(fd.ops.add(s, 1.0))  # wants s whole
        shard(x, MESH2, {0: X})
    f = lower(fd)
    assert placements(f, s) == (R,)
    assert kinds(f) == ["relu", "local_slice", "add", "add"] and comms(f) == []
    assert out_placements(f, 0) == (Shard(0),) and out_placements(f, 1) == (R,)


def test_backward_sharding_a_producer_that_cannot_shard_falls_back_to_a_slice():
    with FusionDefinition() as fd:
        x, r = fd.define_tensor([8, 4]), fd.define_tensor([8, 4])
        s = fd.ops.softmax(r, 0)  # normalizes over the rows: cannot produce a row shard alone
        fd.add_output(fd.ops.add(x, s))
        shard(x, MESH2, {0: X})
    f = lower(fd)
    assert kinds(f) == ["softmax", "local_slice", "add"] and comms(f) == []
    sm = only(f, "softmax")
    assert sm.inputs == (r.name,) and placements(f, sm.outputs[0]) == (R,)


def test_set_that_adds_one_sharding_and_removes_another_1d():
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 8])
        z = fd.ops.set(x)
        fd.add_output(z)
        shard(x, MESH22, {0: X})
        shard(z, MESH22, {1: X})
    f = lower(fd)
    assert kinds(f) == ["all_to_all"]
    assert only(f, "all_to_all").attr("mesh_axis") == 1


def test_set_that_adds_one_sharding_and_removes_another_2d():
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 8])
        z = fd.ops.set(x)
        fd.add_output(z)
        shard(x, MESH22, {0: X})  # sharded on mesh_x ...
        shard(z, MESH22, {1: Y})  # ... becomes sharded on mesh_y, another dim
    f = lower(fd)
    assert sorted(kinds(f)) == ["allgather", "local_slice"]
    ag, sl = only(f, "allgather"), only(f, "local_slice")
    assert (ag.attr("mesh_axis"), ag.attr("dim")) == (1, 0)
    assert (sl.attr("mesh_axis"), sl.attr("dim")) == (0, 1)
    assert kinds(f) == ["local_slice", "allgather"]  # the free slice first: less data to gather
    assert out_placements(f) == (Shard(1), R)


def test_change_on_two_mesh_axes_is_a_sequence():
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 8])
        z = fd.ops.set(x)
        fd.add_output(z)
        shard(x, MESH22, {0: X, 1: Y})
        shard(z, MESH22, {1: X, 0: Y})
    f = lower(fd)
    steps = [op for op in f.ops]
    assert all(len(op.inputs) == 1 for op in steps)
    assert [op.outputs[0] for op in steps[:-1]] == [op.inputs[0] for op in steps[1:]]  # a chain
    assert steps[0].inputs == (x.name,) and steps[-1].outputs == (z.name,)
    assert [op.kind for op in steps] == ["allgather", "all_to_all", "local_slice"]
    # every step touches one mesh axis and no intermediate shards a dim twice
    for op in steps:
        p = placements(f, op.outputs[0])
        assert len([q for q in p if isinstance(q, Shard)]) == len({q for q in p if isinstance(q, Shard)})
    assert [s.kind for s in f.segments] == ["communication", "communication", "compute"]
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 8])
        z = fd.ops.set(x)
        fd.add_output(z)
        shard(x, MESH22, {0: X, 1: Y})
        shard(z, MESH22)
    f = lower(fd)
    assert kinds(f) == ["allgather", "allgather"]
    assert {(op.attr("mesh_axis"), op.attr("dim")) for op in f.ops} == {(1, 0), (0, 1)}


def test_sum_over_one_of_two_sharded_dims_on_2d_mesh():
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 8])
        z = fd.ops.sum(x, [1])
        fd.add_output(z)
        shard(x, MESH22, {0: Y, 1: X})
    f = lower(fd)
    assert kinds(f) == ["sum", "allreduce"]
    assert placements(f, only(f, "sum").outputs[0]) == (Shard(0), Partial())
    assert only(f, "allreduce").attr("mesh_axis") == 1
    assert out_placements(f) == (Shard(0), R)


# --- reshape and normalization ---------------------------------------------------------------


def test_reshape_merge_keeps_sharding_of_leading_dim():
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 6, 8])  # [b, s, h], b sharded
        z = fd.ops.reshape(x, [24, 8])  # [b*s, h]
        fd.add_output(z)
        shard(x, MESH2, {0: X})
    f = lower(fd)
    assert kinds(f) == ["reshape"]
    assert out_placements(f) == (Shard(0),)


def test_reshape_split_keeps_sharding_of_leading_dim():
    with FusionDefinition() as fd:
        x = fd.define_tensor([24, 8])
        z = fd.ops.reshape(x, [4, 6, 8])
        fd.add_output(z)
        shard(x, MESH2, {0: X})
    f = lower(fd)
    assert kinds(f) == ["reshape"]
    assert out_placements(f) == (Shard(0),)


def test_reshape_merge_of_non_leading_sharded_dim_keeps_a_middle_piece():
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 6, 8])
        z = fd.ops.reshape(x, [24, 8])
        fd.add_output(z)
        shard(x, MESH2, {1: X})  # s sharded: each rank holds 3 of every 6 rows of b*s
    f = lower(fd)
    assert kinds(f) == ["reshape"] and out_placements(f) == (Shard(0, 4),)


@pytest.mark.parametrize("src,shape,out,dst", [
    (Shard(0), [12, 2], [3, 4, 2], None),  # a block of 6 rows straddles the rows of 4: gathered
    (Shard(0), [12, 2], [2, 6, 2], Shard(0)),
    (Shard(0, 2), [12, 2], [2, 6, 2], Shard(1)),  # the outer factor split off: a block
    (Shard(0, 2), [12, 2], [4, 3, 2], Shard(0, 2)),  # pieces of 3 rows are rows 0 and 2 of [4, 3]
    (Shard(0, 2), [12, 2], [6, 2, 2], None),  # pieces of 3 rows straddle the rows of 2
    (Shard(1), [4, 6, 2], [2, 12, 2], Shard(1, 2)),  # [4, 6] -> [2, 12]: 3 of 6 columns -> 2 pieces of 3 of 12
    (Shard(1), [2, 6, 2], [3, 4, 2], None),
    (Shard(1), [2, 4, 3], [2, 2, 6], Shard(1)),  # [4, 3] -> [2, 6]: blocks of 2 rows of 3 are 1 row of 6
    (Shard(2), [4, 2, 6], [8, 6], Shard(1)),  # an untouched dim
])
def test_reshape_keeps_a_piece_where_it_maps_onto_one_output_dim(src, shape, out, dst):
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape)
        z = fd.ops.reshape(x, out)
        fd.add_output(z)
        x.set_device_mesh(MESH2)
        if src.outer != 1:
            x.split(src.dim, shape[src.dim] // src.outer)
        x.outer_split(src.dim + (src.outer != 1), 2)
        x.axis(src.dim + (src.outer != 1)).parallelize(X)
    f = lower(fd)
    assert placements(f, x) == (src,)
    assert kinds(f) == (["reshape"] if dst else ["allgather", "reshape"])
    assert out_placements(f) == ((dst,) if dst else (R,))
    full = torch.arange(float(math.prod(shape))).reshape(shape)
    for rank in range(2):  # each rank's piece reshaped alone is its piece of the output
        local = shard_tensor(full, Sharding(MESH2, (src,)), rank)
        if dst:
            torch.testing.assert_close(local.reshape(shard_tensor(full.reshape(out), Sharding(MESH2, (dst,)),
                                                                  rank).shape),
                                       shard_tensor(full.reshape(out), Sharding(MESH2, (dst,)), rank))


def test_reshape_of_untouched_dim_keeps_its_sharding():
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 6, 8])
        z = fd.ops.reshape(x, [24, 8])
        fd.add_output(z)
        shard(x, MESH2, {2: X})
    f = lower(fd)
    assert kinds(f) == ["reshape"] and out_placements(f) == (Shard(1),)


def test_reshape_of_a_tensor_without_elements():
    """A symbolic extent bound to 0 at execute: the reshape rule matched groups of dims by the products of their
    extents, all 0, and ran off the end of the output's dims (an IndexError from compile, found by
    test_properties_sizes). An empty tensor keeps no shard through a reshape; the same fusion at another size
    keeps its block."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, -1, 4])
        fd.add_output(fd.ops.reshape(x, [-1, 4]))
        shard(x, MESH2, {0: X})
    assert fd.compile([[4, 0, 4]], rank=0).collectives() == ["allgather"]
    assert fd.compile([[4, 3, 4]], rank=0).collectives() == []


@pytest.mark.parametrize("affine", [False, True])
def test_layer_norm_over_sharded_dim_runs_decomposed(affine):
    """Each row's mean and sum of squares are allreduced (8 values each), not x gathered; the weight and bias
    are sliced to the result's shards."""
    with FusionDefinition() as fd:
        x, w, b = fd.define_tensor([4, 8]), fd.define_tensor([8]), fd.define_tensor([8])
        fd.add_output(fd.ops.layer_norm(x, [8], w, b) if affine else fd.ops.layer_norm(x, [8]))
        shard(x, MESH2, {1: X})
    f = lower(fd)
    assert [k for k in kinds(f) if k in ("allreduce", "allgather", "reduce_scatter")] == ["allreduce"] * 2
    assert out_placements(f) == (Shard(1),)


@pytest.mark.parametrize("dtype", [DataType.Float, DataType.BFloat16])
def test_softmax_over_sharded_dim_runs_decomposed(dtype):
    """The max and the sum of each row are allreduced (4 values each), not x gathered: the result stays on
    x's shards; a half-precision x is computed in float32, as torch's kernel does."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 32], dtype=dtype)
        fd.add_output(fd.ops.softmax(x, 1))
        shard(x, MESH2, {1: X})
    f = lower(fd)
    half = ["cast"] if dtype is DataType.BFloat16 else []
    assert kinds(f) == [*half, "amax", "allreduce", "sub", "exp", "sum", "allreduce", "div", *half]
    assert [op.attr("reduce_op") for op in f.ops if op.kind == "allreduce"] == ["max", None]
    assert out_placements(f) == (Shard(1),) and f.tensor(f.outputs[0]).dtype is dtype


def test_softmax_over_a_dim_without_elements_stays_one_op():
    """torch's softmax over a dim of extent 0 is an empty tensor; propagation tried the softmax's recipe, whose
    amax refuses a dim of no elements, so a valid call (a symbolic extent bound to 0) raised a DefinitionError
    at execute (found by test_properties_sizes). The op stays whole there."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, 8])
        fd.add_output(fd.ops.softmax(x, 0))
        shard(x, MESH2, {0: X})
    plan = fd.compile([[0, 8]], rank=0)
    assert "softmax" in kinds(plan.fusion) and "amax" not in kinds(plan.fusion)


@pytest.mark.parametrize("kind", ["cumsum", "cumprod"])
def test_scan_over_sharded_dim_runs_in_blocks(kind):
    """A scan of sequence shards: each rank scans its block; only the blocks' totals [3, 2, 1, 4] are gathered
    (to scan them), not x [3, 16, 4]; the result stays on x's shards."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([3, 16, 4])
        fd.add_output(getattr(fd.ops, kind)(x, 1))
        shard(x, MESH2, {1: X})
    f = lower(fd)
    (gather,) = [op for op in f.ops if op.kind == "allgather"]
    assert f.tensor(gather.outputs[0]).shape == (3, 2, 1, 4)
    assert out_placements(f) == (Shard(1),)


@pytest.mark.parametrize("k,sorted_,gathered", [(3, True, (4, 6)), (3, False, (4, 64)), (40, True, (4, 64))])
def test_topk_over_sharded_dim_runs_in_two_stages(k, sorted_, gathered):
    """A sorted top-k of vocabulary shards: each rank's top k, gathered [4, 2k], and their top k (the indices
    summed from the rank that holds each); unsorted (its order is torch's of the whole op) or with k larger
    than a shard, the logits [4, 64] are gathered."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 64])
        for out in fd.ops.topk(x, k, 1, sorted=sorted_):
            fd.add_output(out)
        shard(x, MESH2, {1: X})
    f = lower(fd)
    assert [f.tensor(op.outputs[0]).shape for op in f.ops if op.kind == "allgather"] == [gathered]


def test_topk_cuts_one_block_per_shard_of_its_dim():
    """Vocabulary shards on the TP axis of a DP x TP mesh: 2 blocks, one per shard (not one per device: 4), so
    the candidates gathered are [4, 2k]."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 64])
        for out in fd.ops.topk(x, 3, 1, sorted=True):
            fd.add_output(out)
        shard(x, MESH22, {1: X})
    f = lower(fd)
    assert [f.tensor(op.outputs[0]).shape for op in f.ops if op.kind == "allgather"] == [(4, 6)]


@pytest.mark.parametrize("other", ["zero", "pending", "replicated", "one"])
def test_where_keeps_a_pending_sum_where_it_is_linear(other):
    """``sum(where(hit, y, other), 1)`` of a row-parallel (pending) y: where is linear in y and ``other`` together
    (a replicated other joins the sum locally) or in y alone beside the constant 0, so the [8] row sums are
    allreduced; beside the constant 1 it is not (each rank would add 1), so y [8, 16] is."""
    with FusionDefinition() as fd:
        x, w, r = fd.define_tensor([8, 4]), fd.define_tensor([16, 4]), fd.define_tensor([8, 16])
        hit = fd.define_tensor([8, 16], dtype=DataType.Bool)
        y = fd.ops.linear(x, w)
        b = {"zero": 0.0, "pending": fd.ops.neg(y), "replicated": r, "one": 1.0}[other]
        fd.add_output(fd.ops.sum(fd.ops.where(hit, y, b), [1]))
        shard(x, MESH2, {1: X})
        shard(w, MESH2, {1: X})
    f = lower(fd)
    (allreduce,) = [op for op in f.ops if op.kind == "allreduce"]
    assert f.tensor(allreduce.inputs[0]).shape == ((8, 16) if other == "one" else (8,))


def test_softmax_over_a_dim_gathered_anyway_stays_one_op():
    """The result is wanted whole: gathering x for the one op moves less than gathering the result."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 8])
        z = fd.ops.softmax(x, 1)
        fd.add_output(z)
        shard(x, MESH2, {1: X})
        shard(z, MESH2, {})
    assert kinds(lower(fd)) == ["allgather", "softmax"]


@pytest.mark.parametrize("op", ["softmax", "layer_norm"])
def test_normalization_over_unsharded_dim_stays_local(op):
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 8])
        z = fd.ops.softmax(x, 1) if op == "softmax" else fd.ops.layer_norm(x, [8])
        fd.add_output(z)
        shard(x, MESH2, {0: X})
    f = lower(fd)
    assert kinds(f) == [op] and out_placements(f) == (Shard(0),)


# --- errors ----------------------------------------------------------------------------------


def test_non_divisible_split_raises_sharding_error():
    with FusionDefinition() as fd:
        x = fd.define_tensor([6, 4])
        fd.add_output(fd.ops.relu(x))
        x.set_device_mesh(MESH4)
        with pytest.raises(ShardingError) as e:
            x.outer_split(0, 4)
    assert isinstance(e.value, ValueError) and isinstance(e.value, TPFusionError)
    msg = str(e.value)
    assert "T0" in msg and "axis 0" in msg and "6" in msg and "4" in msg


def test_non_divisible_propagated_extent_raises_sharding_error():
    s = Sharding(MESH4, (Shard(1),))
    with pytest.raises(ShardingError, match=r"T3.*dim 1 of extent 6.*4 devices"):
        s.check_divides((8, 6), "T3")


# --- shard_tensor / unshard_tensor -----------------------------------------------------------


@pytest.mark.parametrize("mesh,pl", [
    (MESH2, (Shard(0),)), (MESH2, (Shard(1),)), (MESH4, (R,)),
    (MESH22, (Shard(0), Shard(1))), (MESH22, (Shard(1), R)), (MESH22, (R, Shard(0))),
])
def test_shard_unshard_roundtrip(mesh, pl):
    full = torch.arange(8 * 4, dtype=torch.float64).reshape(8, 4)
    s = Sharding(mesh, pl)
    pieces = {r: shard_tensor(full, s, rank=r) for r in mesh.devices}
    for r, p in pieces.items():
        assert tuple(p.shape) == s.local_shape((8, 4)), r
    torch.testing.assert_close(unshard_tensor(pieces, s), full)
    if pl == (Shard(0), Shard(1)):  # mesh_y (axis 0) takes rows, mesh_x (axis 1) columns
        torch.testing.assert_close(pieces[1], full[:4, 2:])
        torch.testing.assert_close(pieces[2], full[4:, :2])


def test_partial_shard_sums_to_the_full_value():
    full = torch.arange(6, dtype=torch.float64)
    s = Sharding(MESH2, (Partial(),))
    pieces = {r: shard_tensor(full, s, rank=r) for r in (0, 1)}
    torch.testing.assert_close(pieces[0] + pieces[1], full)
    torch.testing.assert_close(unshard_tensor(pieces, s), full)


@pytest.mark.parametrize("op,others", [("max", "the value"), ("min", "the value"), ("prod", "ones")])
def test_a_partial_of_another_reduction_reduces_to_the_full_value(op, others):
    """Off mesh index 0 a partial holds its reduction's identity (prod: ones) or, for max and min, the
    value itself; reducing the pieces with the op gives the value back."""
    full = torch.arange(6, dtype=torch.float64) - 2.0
    s = Sharding(MESH4, (Partial(op),))
    pieces = {r: shard_tensor(full, s, rank=r) for r in MESH4.devices}
    torch.testing.assert_close(pieces[3], full if others == "the value" else torch.ones(6, dtype=torch.float64))
    torch.testing.assert_close(unshard_tensor(pieces, s), full)
    maxima = {0: full, 1: full + 1, 2: full - 1, 3: full}  # four devices' partial maxima of one value
    if op == "max":
        torch.testing.assert_close(unshard_tensor(maxima, s), full + 1)


def test_a_partial_names_its_reduction():
    assert str(Sharding(MESH2, (Partial("max"),))) == "mesh(0 1)(P(max))"
    with pytest.raises(ShardingError, match=r"Partial\('mean'\): the reduction must be one of sum, max, min, prod"):
        Partial("mean")


def _sharded_4x6():
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 6])
        fd.add_output(x)
    x.set_device_mesh(MESH2)
    x.outer_split(1, 2)
    x.axis(1).parallelize(X)
    return x


@pytest.mark.parametrize("full,match", [
    ((4, 6, 1), r"T0 f32\[4, 6\] has 2 dims, got a full value of shape \[4, 6, 1\]"),
    ((24,), r"has 2 dims, got a full value of shape \[24\]"),
    ((4, 8), r"dim 1's schedule gives it extent 6 \(2 x 3\), but it is 8; pass a tensor whose dim 1 is 6"),
])
def test_shard_tensor_of_a_full_value_that_does_not_fit(full, match):
    with pytest.raises(ShardingError, match=match):
        shard_tensor(torch.zeros(full), _sharded_4x6(), rank=0)


@pytest.mark.parametrize("mesh", [MESH2, None], ids=["sharded", "no_mesh"])
def test_shard_tensor_lays_the_shard_out_as_the_input_declares(mesh):
    """An input declared column-major (``stride_order``) gets a column-major shard, which ``execute``
    takes as it is (it was row-major, and refused as not matching the declared layout)."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 6], stride_order=[0, 1])
        fd.add_output(x)
    if mesh is not None:
        x.set_device_mesh(mesh)
        x.outer_split(1, 2)
        x.axis(1).parallelize(X)
    full = torch.arange(24.0).view(4, 6)
    for rank in (0, 1):
        local = shard_tensor(full, x, rank=rank)
        want = full if mesh is None else full[:, 3 * rank:3 * rank + 3]
        assert local.stride() == (1, 4) and torch.equal(local, want)
        assert local.data_ptr() != full.data_ptr()


def test_shard_tensor_of_a_symbolic_dim_parallelized_without_a_split():
    """Its extent is the mesh axis' size, whatever multiple of it the value has."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, 4])
        fd.add_output(x)
    x.set_device_mesh(MESH2)
    x.axis(0).parallelize(X)
    with pytest.raises(ShardingError, match="dim 0's schedule gives it extent 2 .*spans the mesh axis.*is 6"):
        shard_tensor(torch.zeros(6, 4), x, rank=0)
    assert shard_tensor(torch.arange(8.0).view(2, 4), x, rank=1).tolist() == [[4.0, 5.0, 6.0, 7.0]]


def test_sharding_printing_and_axis_sharded_on():
    assert str(Sharding.unsharded()) == "unsharded"
    assert Sharding.unsharded().axis_sharded_on(X) == -1
    s = _sharded_4x6().sharding
    assert (s.axis_sharded_on(X), s.axis_sharded_on(Y)) == (1, -1)
    with pytest.raises(ShardingError, match="pass a device type"):
        s.axis_sharded_on(ParallelType.serial)


def test_segments_never_mix_communication_and_compute():
    fd, _ = _mlp(MESH22, 2, "dp_tp", shape=(4, 2, 8))
    f = lower(fd)
    for s in f.segments:
        n_comm = sum(bool(traits(f.ops[i].kind) & Trait.COLLECTIVE) for i in s.ops)
        assert n_comm == (0 if s.kind == "compute" else 1)
