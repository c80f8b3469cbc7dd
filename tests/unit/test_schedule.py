"""The sharding schedule on loop domains (issue 14 items 3-5, API.md "Sharding schedule"): reduction
axes r{K}, a device-parallel reduction piece (rfactor), an unsplit or symbolic axis parallelized
directly, strided shards (inner and middle pieces), two mesh axes on one dim, reorder, and
``tv.dtype()``. No process group: loop domains, shardings, ``shard_tensor`` on every rank, the
collectives' local reorders checked against torch, and plans from ``fd.compile``."""

from __future__ import annotations

import pytest
import torch
from tp_fusion.sharding.sharding import PARTIAL_SUM, REPLICATE, Partial, Shard, Sharding, unshard_tensor

from tp_fusion import DataType, DeviceMesh, FusionDefinition, LoweringError, ParallelType, ShardingError, shard_tensor
from tp_fusion.runtime.collectives import _stack_chunks, _unstack, local_slice

X, Y = ParallelType.mesh_x, ParallelType.mesh_y
MESH2 = DeviceMesh(range(2))
MESH22 = DeviceMesh(torch.arange(4).reshape(2, 2))


def _loop(tv) -> str:
    return "[" + ", ".join(map(str, tv._loop())) + "]"


def _local(tv, full: torch.Tensor, mesh: DeviceMesh) -> dict[int, torch.Tensor]:
    return {r: shard_tensor(full, tv, rank=r) for r in mesh.devices}


# --- reduction axes -----------------------------------------------------------------------------


def test_gemm_and_reduction_outputs_keep_their_reduced_axes():
    with FusionDefinition() as fd:
        x, w = fd.define_tensor([4, 3, 8]), fd.define_tensor([6, 8])
        lin = fd.ops.linear(x, w)
        mm = fd.ops.matmul(x, fd.define_tensor([8, 5]))
        s = fd.ops.sum(x, [0, 2])
        kept = fd.ops.mean(x, [1], keepdim=True)
        var, mean = fd.ops.var_mean(x, [1])
        fd.add_output(lin)
    assert _loop(lin) == "[4, 3, 6, r{8}]" and _loop(mm) == "[4, 3, 5, r{8}]"
    assert _loop(s) == "[r{4}, 3, r{8}]"  # in place
    assert _loop(kept) == "[4, 1, 8]"  # keepdim: a size-1 dim, no reduction axis
    assert _loop(var) == _loop(mean) == "[4, r{3}, 8]"
    assert lin.axis(-1).extent == 8 and lin.axis(-2).extent == 6  # negative indices count r{K}


def test_split_reduction_axis_parallelized_is_partial_and_allreduced():
    with FusionDefinition() as fd:
        x, w = fd.define_tensor([4, 8]), fd.define_tensor([6, 8])
        y = fd.ops.linear(x, w)
        z = fd.ops.relu(y)
        fd.add_output(z)
    for tv in (x, w, y):
        tv.set_device_mesh(MESH2)
    for tv in (x, w):
        tv.outer_split(-1, 2).axis(-2).parallelize(X)
    y.outer_split(-1, 2)
    y.axis(-2).parallelize(X)
    assert _loop(y) == "[4, 6, rmesh_x{2}, r{4}]"
    assert y.sharding.placements == (PARTIAL_SUM,)
    assert "partial(sum: mesh_x)" in str(fd)
    plan = fd.compile([[4, 8], [6, 8]])
    assert plan.collectives() == ["allreduce"]  # relu is not linear: the pending sum is done first
    assert plan.output_shardings()[0].is_replicated


@pytest.mark.parametrize("op,pending", [("max", "max"), ("min", "min"), ("prod", "prod"), ("sum", "sum"),
                                        ("var", "sum")])
def test_a_parallelized_reduction_axis_leaves_the_reductions_own_partial(op, pending):
    """max, min and prod leave their own op pending (one allreduce of it); var, which no reduction of pieces
    finishes, runs as its parts (a mean, allreduced, then a sum of squares, left pending as the annotation
    says), not on x gathered."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 8])
        m = getattr(fd.ops, op)(x, [1])
        fd.add_output(fd.ops.relu(m))
    x.set_device_mesh(MESH2)
    x.outer_split(1, 2).axis(1).parallelize(X)
    m.set_device_mesh(MESH2)
    m.outer_split(1, 2).axis(1).parallelize(X)
    assert m.sharding.placements == (Partial(pending),)
    assert f"partial({pending}: mesh_x)" in str(fd)
    plan = fd.compile([[4, 8]])
    assert plan.collectives() == ["allreduce"] * (2 if op == "var" else 1)
    assert {o.attr("reduce_op", "sum") for o in plan.fusion.ops if o.kind == "allreduce"} == {pending}


def test_an_output_without_a_mesh_has_the_unsharded_sharding():
    """API.md: one Sharding per output, also in a fusion without meshes (nvFuser: an empty mesh)."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 3])
        fd.add_output(fd.ops.relu(x))
    full = torch.randn(4, 3)
    fd.execute([full])
    (sharding,) = fd.output_shardings()
    assert sharding == Sharding.unsharded() and sharding.mesh is None
    assert sharding.axis_sharded_on(X) == sharding.axis_sharded_on(Y) == -1
    torch.testing.assert_close(shard_tensor(full, sharding, rank=1), full)


def test_reduction_and_logical_dim_on_one_mesh_axis_is_a_reduce_scatter():
    with FusionDefinition() as fd:
        x, w = fd.define_tensor([4, 8]), fd.define_tensor([6, 8])
        y = fd.ops.linear(x, w)
        fd.add_output(y)
    for tv in (x, w, y):
        tv.set_device_mesh(MESH2)
        tv.split(-1, 2, inner_split=False)
        tv.axis(-2).parallelize(X)
    y.outer_split(0, 2)
    y.axis(0).parallelize(X)  # mesh_x once more, now on a logical dim
    assert y.sharding.placements == (Shard(0),)
    assert fd.compile([[4, 8], [6, 8]]).collectives() == ["reduce_scatter"]


def test_partial_output_is_summed_and_shard_tensor_gives_the_sum():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        s = fd.ops.sum(x, [1])
        fd.add_output(s)
    for tv in (x, s):
        tv.set_device_mesh(MESH2)
        tv.outer_split(1, 2)
        tv.axis(1).parallelize(X)
    full = torch.arange(12.0).reshape(2, 6)
    assert s.sharding.has_partial
    for r in (0, 1):
        torch.testing.assert_close(shard_tensor(full.sum(1), s, rank=r), full.sum(1))  # nvFuser's meaning
        torch.testing.assert_close(shard_tensor(full, x, rank=r), full[:, 3 * r:3 * r + 3])
    plan = fd.compile([[2, 6]])
    assert plan.collectives() == ["allreduce"] and plan.output_shardings()[0].is_replicated


def test_rfactor_makes_the_partial_explicit():
    with FusionDefinition() as fd:
        a, b = fd.define_tensor([4, 8]), fd.define_tensor([8, 6])
        out = fd.ops.matmul(a, b)
        fd.add_output(out)
        for tv in (a, b, out):
            tv.set_device_mesh(MESH2)
        a.outer_split(-1, 2).axis(-2).parallelize(X)
        b.outer_split(0, 2).axis(0).parallelize(X)
        out.outer_split(-1, 2)  # [4, 6, r{2}, r{4}]
        local = out.rfactor(axes=[-1])
        local.axis(-2).parallelize(X)
    assert _loop(local) == "[4, 6, rmesh_x{2}, r{4}]" and _loop(out) == "[4, 6, r{2}]"
    assert local.sharding.has_partial and out.sharding.is_replicated
    assert [op.kind for op in fd.fusion.ops] == ["matmul", "set"]
    assert fd.compile([[4, 8], [8, 6]]).collectives() == ["allreduce"]


def test_rfactor_errors():
    with FusionDefinition() as fd:
        x, w = fd.define_tensor([4, 8]), fd.define_tensor([6, 8])
        y = fd.ops.linear(x, w)
        fd.add_output(y)
    with pytest.raises(ShardingError, match=r"T2.rfactor: axes \[0\] must name reduction axes .*\[4, 6, r\{8\}\]"):
        y.rfactor([0])
    with pytest.raises(ShardingError, match="T0.rfactor: axes"):
        x.rfactor([0])


# --- an axis parallelized without a split -------------------------------------------------------


def test_symbolic_unsplit_axis_parallelized_has_the_mesh_size():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, 4])
        fd.add_output(fd.ops.relu(x))
    x.set_device_mesh(MESH2)
    x.axis(0).parallelize(X)
    assert x.axis(0).extent == 2 and x.sharding.placements == (Shard(0),)
    assert x.sharding.local_shape((2, 4)) == (1, 4)
    plan = fd.compile([[2, 4]])
    assert plan.collectives() == [] and plan.output_shardings()[0].placements == (Shard(0),)  # relu keeps it
    with pytest.raises(ShardingError, match=r"T0 f32\[\?, 4\]: dim 0's schedule gives it extent 2 \(a dim "
                                            r"parallelized without a split spans the mesh axis\), but it is 6 at "
                                            r"execute; pass a tensor whose dim 0 is 2, or to shard it in 2 pieces "
                                            r"split its loop axis first \(outer_split\(0, 2\)\) and parallelize"):
        fd.compile([[6, 4]])


def test_concrete_unsplit_axis_of_the_mesh_size():
    with FusionDefinition() as fd:
        x = fd.define_tensor([2, 4])
        fd.add_output(fd.ops.relu(x))
    x.set_device_mesh(MESH2)
    x.axis(0).parallelize(X)
    full = torch.arange(8.0).reshape(2, 4)
    assert [tuple(p.shape) for p in _local(x, full, MESH2).values()] == [(1, 4), (1, 4)]


# --- strided shards and two mesh axes on one dim ----------------------------------------------


@pytest.mark.parametrize("schedule,outer,pieces", [
    (lambda t: t.inner_split(0, 2).axis(1), 6, lambda f, r: f.reshape(6, 2)[:, r]),
    (lambda t: t.outer_split(0, 3).outer_split(1, 2).axis(1), 3, lambda f, r: f.reshape(3, 2, 2)[:, r].flatten()),
    (lambda t: t.outer_split(0, 2).axis(0), 1, lambda f, r: f.reshape(2, 6)[r]),
])
def test_any_piece_of_a_split_can_be_device_parallel(schedule, outer, pieces):
    with FusionDefinition() as fd:
        t = fd.define_tensor([12])
        fd.add_output(fd.ops.relu(t))
    t.set_device_mesh(MESH2)
    schedule(t).parallelize(X)
    assert t.sharding.placements == (Shard(0, outer),)
    full = torch.arange(12.0)
    local = _local(t, full, MESH2)
    for r, piece in local.items():
        torch.testing.assert_close(piece, pieces(full, r))
    torch.testing.assert_close(unshard_tensor(local, t.sharding), full)


def test_symbolic_strided_shard_is_bound_by_the_full_tensor():
    with FusionDefinition() as fd:
        t = fd.define_tensor([-1])
        fd.add_output(t)
    t.set_device_mesh(MESH2)
    t.inner_split(0, 2)
    t.axis(1).parallelize(X)
    assert t.sharding.placements == (Shard(0, -1),)  # the place depends on the extent
    full = torch.arange(10.0)
    torch.testing.assert_close(shard_tensor(full, t, rank=1), full.reshape(5, 2)[:, 1])


def test_two_mesh_axes_split_one_dim():
    """Context and tensor parallel: [b, s, e] with s split on mesh_x outside and mesh_y inside."""
    with FusionDefinition() as fd:
        t = fd.define_tensor([2, 12, 5])
        fd.add_output(fd.ops.relu(t))
    t.set_device_mesh(MESH22)
    t.outer_split(1, 2).axis(1).parallelize(X)
    t.outer_split(2, 2).axis(2).parallelize(Y)
    t.reorder({2: 0, 1: 1})  # loop order only
    assert _loop(t) == "[mesh_y{2}, mesh_x{2}, 2, 3, 5]"
    assert t.sharding.placements == (Shard(1, 2), Shard(1, 1))
    full = torch.arange(120.0).reshape(2, 12, 5)
    local = _local(t, full, MESH22)
    for r, piece in local.items():
        y, x = MESH22.coords(r)
        torch.testing.assert_close(piece, full.reshape(2, 2, 2, 3, 5)[:, x, y])
    torch.testing.assert_close(unshard_tensor(local, t.sharding), full)
    plan = fd.compile([[2, 12, 5]], rank=3)
    assert plan.collectives() == []  # a pointwise op keeps both pieces
    assert plan.output_shardings()[0].placements == (Shard(1, 2), Shard(1))


@pytest.mark.parametrize("world", [2, 4])
def test_a_size_one_mesh_axis_outside_another_on_one_dim(world):
    """Both pieces start at the same place when the outer mesh axis has size 1: it takes the whole dim,
    so the other's shard is as if it were alone (round 17: refused as overlapping before)."""
    mesh = DeviceMesh(torch.arange(world).reshape(world, 1))
    with FusionDefinition() as fd:
        t = fd.define_tensor([8, 3])
        fd.add_output(fd.ops.set(t))
    t.set_device_mesh(mesh)
    t.outer_split(0, 1).axis(0).parallelize(X)  # mesh_x: the size-1 axis, outside
    t.outer_split(1, world).axis(1).parallelize(Y)
    full = torch.arange(24.0).reshape(8, 3)
    local = _local(t, full, mesh)
    for r, piece in local.items():
        torch.testing.assert_close(piece, full.chunk(world)[r])
    torch.testing.assert_close(unshard_tensor(local, t.sharding), full)
    # The unannotated output keeps both pieces, as any nesting pair (round 19; before, propagation refused
    # two mesh axes on one dim whenever their Shards were equal, and gathered it)
    plan = fd.compile([[8, 3]])
    assert plan.collectives() == [] and plan.output_shardings()[0] == t.sharding


@pytest.mark.parametrize("shape,dim,outer", [((12, 3), 0, 3), ((3, 12), 1, 2), ((2, 12, 2), 1, 1)])
def test_collective_reorders_match_the_shards(shape, dim, outer):
    """Stacking chunks (reduce_scatter, all_to_all) picks each rank's strided piece; unstacking
    (allgather) restores the full tensor; a local slice is the rank's piece."""
    n = 2
    full = torch.arange(float(torch.Size(shape).numel())).reshape(shape)
    s = Sharding(MESH2, (Shard(dim, outer),))
    stacked = _stack_chunks(full, n, dim, outer)
    for r in range(n):
        mine = shard_tensor(full, s, rank=r)
        torch.testing.assert_close(stacked[r], mine)
        torch.testing.assert_close(local_slice(full, n, dim, r, outer), mine)
    torch.testing.assert_close(_unstack(stacked, dim, outer), full)


def test_pointwise_ops_and_reductions_keep_a_strided_shard():
    with FusionDefinition() as fd:
        x, b = fd.define_tensor([8, 4]), fd.define_tensor([4])
        y = fd.ops.add(fd.ops.relu(x), b)  # b broadcasts along the strided dim
        z = fd.ops.sum(y, [0])  # sums its pieces: partial, then an allreduce
        fd.add_output(y)
        fd.add_output(z)
    x.set_device_mesh(MESH2)
    x.inner_split(0, 2).axis(1).parallelize(X)
    plan = fd.compile([[8, 4], [4]])
    assert plan.output_shardings()[0].placements == (Shard(0, 4),)
    assert plan.collectives() == ["allreduce"]


def test_strided_shard_plans():
    with FusionDefinition() as fd:
        x = fd.define_tensor([8, 4])
        y = fd.ops.set(x)
        z = fd.ops.set(x)
        fd.add_output(y)
        fd.add_output(z)
    for tv in (x, y, z):
        tv.set_device_mesh(MESH2)
    x.inner_split(0, 2).axis(1).parallelize(X)  # strided rows
    y.outer_split(0, 2).axis(0).parallelize(X)  # block rows: gather, then slice
    z.outer_split(1, 2).axis(1).parallelize(X)  # columns: all_to_all from strided rows
    plan = fd.compile([[8, 4]])
    assert plan.collectives() == ["allgather", "all_to_all"]
    text = str(plan)
    assert "allgather(T0, mesh_axis=0, dim=0, outer=4)" in text and "src_outer=4" in text


def test_mesh_y_and_mesh_x_nested_in_a_2d_sharded_vector():
    with FusionDefinition() as fd:
        t = fd.define_tensor([-1])
        fd.add_output(t)
    t.set_device_mesh(MESH22)
    t.inner_split(0, 6).outer_split(0, 2).axis(0).parallelize(Y)
    t.outer_split(2, 2).axis(2).parallelize(X)
    full = torch.arange(24.0)
    for r in MESH22.devices:
        y, x = MESH22.coords(r)
        torch.testing.assert_close(shard_tensor(full, t, rank=r), full.reshape(2, 2, 2, 3)[y, :, x, :].flatten())


def test_overlapping_shards_are_refused():
    s = Sharding(MESH22, (Shard(0, 1), Shard(0, 1)))
    with pytest.raises(ShardingError, match="two mesh axes of .* shard overlapping pieces of it"):
        shard_tensor(torch.arange(8.0), s, rank=0)


# --- reorder and dtype() ----------------------------------------------------------------------


def test_reorder_moves_loop_axes_only():
    with FusionDefinition() as fd:
        t = fd.define_tensor([4, 6, 8])
        fd.add_output(t)
    t.set_device_mesh(MESH2)
    t.outer_split(1, 2).axis(1).parallelize(X)
    before = t.sharding
    assert t.reorder({-1: 0}) is t
    assert _loop(t) == "[8, 4, mesh_x{2}, 3]" and t.sharding == before
    with pytest.raises(ShardingError, match=r"reorder \{5: 0\} names an axis out of range"):
        t.reorder({5: 0})
    with pytest.raises(ShardingError, match="moves two axes to one position"):
        t.reorder({0: 1, 2: 1})
    with pytest.raises(ShardingError, match="expected a dict"):
        t.reorder([1, 0])


def test_dtype_is_a_property_and_a_method():
    with FusionDefinition() as fd:
        t = fd.define_tensor([2], dtype=DataType.BFloat16)
        fd.add_output(fd.ops.cast(t, dtype=t.dtype()))
    assert t.dtype is DataType.BFloat16 and t.dtype() is DataType.BFloat16


def test_device_type_once_per_logical_and_once_per_reduction_axis():
    with FusionDefinition() as fd:
        x, w = fd.define_tensor([4, 8]), fd.define_tensor([6, 8])
        y = fd.ops.linear(x, w)
        fd.add_output(y)
    y.set_device_mesh(MESH2)
    y.outer_split(0, 2).axis(0).parallelize(X)  # [mesh_x{2}, 2, 6, r{8}]
    y.outer_split(-1, 2).axis(-2).parallelize(X)  # and a reduction piece: a reduce-scatter
    y.outer_split(2, 2)
    with pytest.raises(ShardingError, match="mesh_x is already bound to loop axis 0"):
        y.axis(2).parallelize(X)


def test_reshard_steps_between_places_of_one_dim():
    from tp_fusion.sharding.reshard import Collective, reshard_steps

    def kinds(src, dst, mesh):
        steps = reshard_steps(Sharding(mesh, src), Sharding(mesh, dst), (8, 8), "test")
        return [(s.collective, s.mesh_axis, s.attrs().get("outer", 1)) for s in steps]
    # another place on the same mesh axis: gather (interleaving), then slice
    assert kinds((Shard(0, 4),), (Shard(0),), MESH2) == [(Collective.ALLGATHER, 0, 4), (Collective.LOCAL_SLICE, 0, 1)]
    # mesh_x wants the piece mesh_y holds: mesh_y lets go first
    assert kinds((Shard(0), REPLICATE), (REPLICATE, Shard(0)), MESH22) == [
        (Collective.ALLGATHER, 0, 1), (Collective.LOCAL_SLICE, 1, 1)]
    # nested pieces (mesh_y outside, mesh_x inside): gathering mesh_x interleaves in the local tensor
    assert kinds((Shard(0), Shard(0, 2)), (Shard(0), REPLICATE), MESH22) == [(Collective.ALLGATHER, 1, 1)]
    assert kinds((Shard(0, 2), Shard(0)), (REPLICATE, Shard(0)), MESH22) == [(Collective.ALLGATHER, 0, 1)]
    assert kinds((Shard(0, 2), Shard(0, 4)), (Shard(0, 2), REPLICATE), MESH22) == [(Collective.ALLGATHER, 1, 2)]
    # a shard going partial: gather, then the value on the axis' first rank (zeros elsewhere)
    assert kinds((Shard(0),), (PARTIAL_SUM,), MESH2) == [(Collective.ALLGATHER, 0, 1), (Collective.TO_PARTIAL, 0, 1)]
    # partials of two reductions: the first is done (an allreduce of its op), then the value goes partial again
    steps = reshard_steps(Sharding(MESH2, (Partial("max"),)), Sharding(MESH2, (PARTIAL_SUM,)), (8,), "test")
    assert [(s.collective, s.attrs().get("reduce_op", "sum")) for s in steps] == [
        (Collective.ALLREDUCE, "max"), (Collective.TO_PARTIAL, "sum")]
    # a pending sum on both axes: one allreduce over the four devices (a ring sends 1.5x the payload, where one
    # per axis sent 2x); partials of two reductions, or an allgather between them, stay apart
    assert kinds((PARTIAL_SUM, PARTIAL_SUM), (REPLICATE, REPLICATE), MESH22) == [(Collective.ALLREDUCE, (0, 1), 1)]
    assert kinds((Partial("max"), PARTIAL_SUM), (REPLICATE, REPLICATE), MESH22) == [
        (Collective.ALLREDUCE, 1, 1), (Collective.ALLREDUCE, 0, 1)]
    mesh222 = DeviceMesh(torch.arange(8).reshape(2, 2, 2))
    assert kinds((PARTIAL_SUM, Shard(1), PARTIAL_SUM), (REPLICATE, REPLICATE, REPLICATE), mesh222) == [
        (Collective.ALLREDUCE, 2, 1), (Collective.ALLGATHER, 1, 1), (Collective.ALLREDUCE, 0, 1)]
    # wanted sharded on one axis and whole on the other: reduce-scatter first, then allreduce the half left
    assert kinds((PARTIAL_SUM, PARTIAL_SUM), (Shard(0), REPLICATE), MESH22) == [
        (Collective.REDUCE_SCATTER, 0, 1), (Collective.ALLREDUCE, 1, 1)]
    # a pending sum sent to another stage: reduce-scattered, its pieces sent, gathered there
    steps = reshard_steps(Sharding(MESH2, (PARTIAL_SUM,)), Sharding(DeviceMesh([2, 3]), (REPLICATE,)), (4, 8), "test")
    assert [(s.collective, s.attrs().get("dim")) for s in steps] == [
        (Collective.REDUCE_SCATTER, 1), (Collective.SEND_RECV, None), (Collective.ALLGATHER, 1)]
    assert MESH22.axis_group((0, 1), 3) == (0, 1, 2, 3)
    assert DeviceMesh([[3, 1], [2, 0]]).all_axis_groups((0, 1)) == [(3, 1, 2, 0)]
    assert mesh222.all_axis_groups((0, 2)) == [(0, 1, 4, 5), (2, 3, 6, 7)]
    # overlapping pieces of one dim (S(0) of 2 on mesh_y, S(0, outer=3) on mesh_x) are no sharding to reach:
    # an error, where the search for a step once looped forever
    with pytest.raises(LoweringError, match="overlap"):
        kinds((Shard(0), REPLICATE), (Shard(0), Shard(0, 3)), MESH22)


@pytest.mark.parametrize("schedule,placement,collectives", [
    (lambda y: y.inner_split(1, 2).axis(2), Shard(1, 3), ["reduce_scatter"]),  # out dim strided
    (lambda y: y.outer_split(-1, 2).axis(-2), PARTIAL_SUM, ["allreduce"]),  # a pending sum: bias once
])
def test_biased_linear_with_an_annotated_output(schedule, placement, collectives):
    with FusionDefinition() as fd:
        x, w, b = fd.define_tensor([4, 8]), fd.define_tensor([6, 8]), fd.define_tensor([6])
        y = fd.ops.linear(x, w, b)
        fd.add_output(fd.ops.set(y))
    for tv in (x, w, y):
        tv.set_device_mesh(MESH2)
    for tv in (x, w):
        tv.outer_split(-1, 2).axis(-2).parallelize(X)  # the contraction: the product is partial
    schedule(y).parallelize(X)
    assert y.sharding.placements == (placement,)
    plan = fd.compile([[4, 8], [6, 8], [6]])
    assert plan.collectives() == collectives
    add = next(op for op in plan.fusion.ops if op.kind == "add")
    bias = plan.fusion.tensor(add.inputs[1]).sharding.placements
    assert bias == ((Shard(0, 3),) if placement == Shard(1, 3) else (PARTIAL_SUM,))


def test_gemms_and_normalizations_keep_a_strided_shard():
    """Context parallel tokens (an inner piece of dim 0) through layer_norm, linear and gelu: no
    communication; a strided contraction is a partial like a block one."""
    with FusionDefinition() as fd:
        x, w1, w2 = fd.define_tensor([8, 4]), fd.define_tensor([6, 4]), fd.define_tensor([4, 6])
        h = fd.ops.gelu(fd.ops.linear(fd.ops.layer_norm(x, [4]), w1))
        fd.add_output(h)
        fd.add_output(fd.ops.linear(h, w2))
    x.set_device_mesh(MESH2)
    x.inner_split(0, 2).axis(1).parallelize(X)
    plan = fd.compile([[8, 4], [6, 4], [4, 6]])
    assert plan.collectives() == []
    assert [s.placements for s in plan.output_shardings()] == [(Shard(0, 4),), (Shard(0, 4),)]
    with FusionDefinition() as fd:
        x, w = fd.define_tensor([8, 4]), fd.define_tensor([6, 4])
        fd.add_output(fd.ops.linear(x, w))
    x.set_device_mesh(MESH2)
    x.inner_split(1, 2).axis(2).parallelize(X)  # the contraction, strided
    assert fd.compile([[8, 4], [6, 4]]).collectives() == ["allreduce"]


def test_a_schedule_call_that_changes_nothing_keeps_the_plan():
    """Building a plan is collective on ranks: a call that gives a tensor what it has must not make one
    rank rebuild while its peers run the cached plan. A change does rebuild."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 6])
        y = fd.ops.relu(x)
        fd.add_output(y)
        x.set_device_mesh(DeviceMesh([0]))
    t = torch.randn(4, 6)
    fd.execute([t])
    plan = fd.plan
    x.set_device_mesh(DeviceMesh([0]))
    fd.execute([t])
    assert fd.plan is plan
    y.set_device_mesh(DeviceMesh([0]))
    fd.execute([t])
    assert fd.plan is not plan
