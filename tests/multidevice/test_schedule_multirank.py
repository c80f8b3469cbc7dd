"""Schedules of issue 14 items 3-5 executed on gloo ranks: strided shards (inner pieces of a split), two
mesh axes on one dim, and a split reduction axis (rfactor), against plain torch, with the plan's
collectives. tests/unit/test_schedule.py covers loop domains, shardings and plans without ranks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import rand

from tp_fusion import DataType, DeviceMesh, FusionDefinition, ParallelType, shard_tensor

X, Y = ParallelType.mesh_x, ParallelType.mesh_y


def _run(fd, tvs, full, out_tv, want, collectives):
    (out,) = fd.execute([shard_tensor(t, tv) for tv, t in zip(tvs, full)])
    torch.testing.assert_close(out, shard_tensor(want, out_tv))
    assert fd.plan.collectives() == collectives


def _set_fusion(d: int, schedule_in, schedule_out, shape=(4, 6)):
    """x -> set(x), each side scheduled by a function of (tv, d)."""
    mesh = DeviceMesh(range(d))
    with FusionDefinition() as fd:
        x = fd.define_tensor([shape[0] * d, shape[1] * d], dtype=DataType.Double)
        y = fd.ops.set(x)
        fd.add_output(y)
    for tv, schedule in ((x, schedule_in), (y, schedule_out)):
        tv.set_device_mesh(mesh)
        schedule(tv, d)
    return fd, x, y


def _inner_rows(tv, d):
    tv.inner_split(0, d).axis(1).parallelize(X)


def _middle_rows(tv, d):
    tv.outer_split(0, 2).outer_split(1, d).axis(1).parallelize(X)


def _block_rows(tv, d):
    tv.outer_split(0, d).axis(0).parallelize(X)


def _block_cols(tv, d):
    tv.outer_split(1, d).axis(1).parallelize(X)


@pytest.mark.parametrize("src,dst,collectives", [
    (_inner_rows, lambda tv, d: None, ["allgather"]),  # gathered, then interleaved locally
    (_middle_rows, lambda tv, d: None, ["allgather"]),
    (_inner_rows, _block_rows, ["allgather"]),  # another place in the same dim: gather, then slice
    (_inner_rows, _block_cols, ["all_to_all"]),
    (_block_cols, _middle_rows, ["all_to_all"]),
    (lambda tv, d: None, _inner_rows, []),  # a local slice
])
def test_strided_reshardings(multidevice_test, src, dst, collectives):
    d = multidevice_test.size
    fd, x, y = _set_fusion(d, src, dst)
    full = rand(0, 4 * d, 6 * d)
    _run(fd, [x], [full], y, full, collectives if d > 1 else [])


def test_pointwise_ops_and_reductions_keep_a_strided_shard(multidevice_test):
    d = multidevice_test.size
    with FusionDefinition() as fd:
        x = fd.define_tensor([3 * d, 4], dtype=DataType.Double)
        y = fd.ops.mul(fd.ops.relu(x), 2.0)
        fd.add_output(y)
        fd.add_output(fd.ops.sum(y, [0]))
    x.set_device_mesh(DeviceMesh(range(d)))
    _inner_rows(x, d)
    full = rand(6, 3 * d, 4)
    y_out, s_out = fd.execute([shard_tensor(full, x)])
    assert fd.plan.collectives() == (["allreduce"] if d > 1 else [])  # the sum of the pieces' sums only
    want = torch.relu(full) * 2.0
    torch.testing.assert_close(y_out, shard_tensor(want, fd.output_shardings()[0]))
    torch.testing.assert_close(s_out, want.sum(0))


# Ops that map each index of a sharded dim to the same index of their output: x[3d, 4] (rows on an inner
# piece) -> (the fusion's output, torch's). A strided shard of the rows passes through as a block one does.
_ROW_KEEPING = {
    "permute": (lambda fd, x: fd.ops.permute(x, [1, 0]), lambda t: t.T),
    "slice": (lambda fd, x: fd.ops.slice(x, [0, 1], [x.shape[0], 3]), lambda t: t[:, 1:3]),
    "cat": (lambda fd, x: fd.ops.cat([x, fd.ops.neg(x)], 1), lambda t: torch.cat([t, -t], 1)),
    "pad": (lambda fd, x: fd.ops.pad(x, [1, 2], 5.0), lambda t: F.pad(t, [1, 2], value=5.0)),
    "cumsum": (lambda fd, x: fd.ops.cumsum(x, 1), lambda t: t.cumsum(1)),
    "select": (lambda fd, x: fd.ops.select(x, fd.define_scalar(2), 1), lambda t: t[:, 2]),
    "index_select": (lambda fd, x: fd.ops.index_select(x, fd.define_tensor([3], dtype=DataType.Int), 1),
                     lambda t: t[:, [3, 0, 3]]),
    "broadcast_in_dim": (lambda fd, x: fd.ops.broadcast_in_dim(x, [2, x.shape[0], 4], [1, 2]),
                         lambda t: t.expand(2, *t.shape)),
    "reshape": (lambda fd, x: fd.ops.reshape(x, [x.shape[0] * 4]), lambda t: t.reshape(-1)),
    "triu": (lambda fd, x: fd.ops.triu(fd.ops.reshape(x, [x.shape[0], 2, 2]), 1),
             lambda t: torch.triu(t.reshape(-1, 2, 2), 1)),
}


@pytest.mark.parametrize("op", list(_ROW_KEEPING))
def test_ops_that_keep_indices_keep_a_strided_shard(multidevice_test, op):
    """Shape, scan and indexing ops run on the rows' strided pieces where they are, as pointwise ops do
    (they used to gather them first)."""
    d = multidevice_test.size
    output, reference = _ROW_KEEPING[op]
    with FusionDefinition() as fd:
        x = fd.define_tensor([3 * d, 4], dtype=DataType.Double)
        fd.add_output(output(fd, x))
    x.set_device_mesh(DeviceMesh(range(d)))
    _inner_rows(x, d)
    full = rand(15, 3 * d, 4)
    extra = [torch.tensor([3, 0, 3])] if op == "index_select" else []
    (got,) = fd.execute([shard_tensor(full, x), *extra])
    torch.testing.assert_close(got, shard_tensor(reference(full), fd.output_shardings()[0]))
    assert fd.plan.collectives() == []
    if d > 1:
        assert any(getattr(p, "outer", 1) == 3 for p in fd.output_shardings()[0].placements)  # still strided


def test_strided_token_ids_through_an_embedding(multidevice_test):
    """Token ids on an inner piece look up their rows where they are; the vocabulary stays whole."""
    d = multidevice_test.size
    with FusionDefinition() as fd:
        ids = fd.define_tensor([3 * d], dtype=DataType.Int)
        weight = fd.define_tensor([7, 4], dtype=DataType.Double)
        fd.add_output(fd.ops.embedding_fwd(ids, weight))
    ids.set_device_mesh(DeviceMesh(range(d)))
    _inner_rows(ids, d)
    full_ids, full_w = torch.randint(0, 7, (3 * d,), generator=torch.Generator().manual_seed(16)), rand(17, 7, 4)
    (got,) = fd.execute([shard_tensor(full_ids, ids), full_w])
    torch.testing.assert_close(got, shard_tensor(F.embedding(full_ids, full_w), fd.output_shardings()[0]))
    assert fd.plan.collectives() == []


def test_a_vocabulary_in_strided_pieces(multidevice_test):
    """Each rank looks up the rows of its strided piece of the vocabulary (zeros for the others), then
    one allreduce, as for a block of rows."""
    d = multidevice_test.size
    with FusionDefinition() as fd:
        ids = fd.define_tensor([5], dtype=DataType.Int)
        weight = fd.define_tensor([3 * d, 4], dtype=DataType.Double)
        fd.add_output(fd.ops.embedding_fwd(ids, weight))
    weight.set_device_mesh(DeviceMesh(range(d)))
    _inner_rows(weight, d)
    full_ids, full_w = torch.tensor([3 * d - 1, 0, 1, d, 1]), rand(20, 3 * d, 4)
    (got,) = fd.execute([full_ids, shard_tensor(full_w, weight)])
    torch.testing.assert_close(got, F.embedding(full_ids, full_w))
    assert fd.plan.collectives() == (["allreduce"] if d > 1 else [])


def test_partial_to_strided_is_a_reduce_scatter(multidevice_test):
    d = multidevice_test.size
    mesh = DeviceMesh(range(d))
    with FusionDefinition() as fd:
        x, w = fd.define_tensor([2 * d, 3 * d], dtype=DataType.Double), fd.define_tensor([5, 3 * d],
                                                                                          dtype=DataType.Double)
        y = fd.ops.linear(x, w)
        fd.add_output(y)
    for tv in (x, w):
        tv.set_device_mesh(mesh)
        tv.outer_split(-1, d).axis(-2).parallelize(X)  # the contraction
    y.set_device_mesh(mesh)
    _inner_rows(y, d)
    full = [rand(1, 2 * d, 3 * d), rand(2, 5, 3 * d)]
    _run(fd, [x, w], full, y, F.linear(*full), ["reduce_scatter"] if d > 1 else [])


@pytest.mark.parametrize("source", ["linear", "sum"])
def test_a_reduce_scatter_of_a_tensor_without_elements(multidevice_test, source):
    """A pending sum without columns (a symbolic extent bound to 0) reduce-scattered onto row shards (strided ones
    after a linear, blocks after a sum: a linear's blocks go to the fused kernel, which skips an empty GEMM): the
    reduce_scatter viewed it with an extent left to infer (-1), which a tensor without elements does not determine
    (a RuntimeError in the segment on every rank; found by test_properties_sizes)."""
    d = multidevice_test.size
    mesh = DeviceMesh(range(d))
    with FusionDefinition() as fd:
        if source == "linear":
            ins = [fd.define_tensor([4 * d, 3 * d], dtype=DataType.Double),
                   fd.define_tensor([-1, 3 * d], dtype=DataType.Double)]
            y = fd.ops.linear(*ins)
        else:
            ins = [fd.define_tensor([4 * d, 3 * d, -1], dtype=DataType.Double)]
            y = fd.ops.sum(ins[0], [1])
        fd.add_output(y)
    for tv in ins:
        tv.set_device_mesh(mesh)
        tv.outer_split(1, d).axis(1).parallelize(X)  # the contraction, or the summed dim
    y.set_device_mesh(mesh)
    (_inner_rows if source == "linear" else _block_rows)(y, d)
    for n in (0, 5):
        if source == "linear":
            full = [rand(1, 4 * d, 3 * d), rand(2, n, 3 * d)]
            want = F.linear(*full)
        else:
            full = [rand(1, 4 * d, 3 * d, n)]
            want = full[0].sum(1)
        _run(fd, ins, full, y, want, ["reduce_scatter"] if d > 1 else [])


def test_split_reduction_axis_then_relu(multidevice_test):
    """nvFuser's rfactor through the schedule alone: a device-parallel r{} piece, summed before relu."""
    d = multidevice_test.size
    mesh = DeviceMesh(range(d))
    with FusionDefinition() as fd:
        a, b = fd.define_tensor([3, 2 * d], dtype=DataType.Double), fd.define_tensor([2 * d, 4], dtype=DataType.Double)
        mm = fd.ops.matmul(a, b)
        out = fd.ops.relu(mm)
        fd.add_output(out)
    for tv in (a, b, mm):
        tv.set_device_mesh(mesh)
    a.outer_split(1, d).axis(1).parallelize(X)
    b.outer_split(0, d).axis(0).parallelize(X)
    mm.outer_split(-1, d).axis(-2).parallelize(X)  # [3, 4, r{d}, r{2}]: partial on mesh_x
    full = [rand(3, 3, 2 * d), rand(4, 2 * d, 4)]
    _run(fd, [a, b], full, out, torch.relu(full[0] @ full[1]), ["allreduce"] if d > 1 else [])


@pytest.mark.parametrize("op", ["max", "min", "prod"])
def test_split_reduction_axis_of_a_max_min_or_prod(multidevice_test, op):
    """A device-parallel r{} piece of a max, min or prod leaves that op pending: one allreduce of it (it
    used to be taken as a pending sum: the input gathered, reduced whole, then allreduced as a sum)."""
    d = multidevice_test.size
    mesh = DeviceMesh(range(d))
    with FusionDefinition() as fd:
        x = fd.define_tensor([3, 4 * d], dtype=DataType.Double)
        m = getattr(fd.ops, op)(x, [1])
        fd.add_output(fd.ops.relu(m))
    for tv in (x, m):
        tv.set_device_mesh(mesh)
        tv.outer_split(1, d).axis(1).parallelize(X)
    full = rand(18, 3, 4 * d)
    want = {"max": full.amax(1), "min": full.amin(1), "prod": full.prod(1)}[op]
    _run(fd, [x], [full], m, torch.relu(want), ["allreduce"] if d > 1 else [])


@pytest.mark.parametrize("scatter", [False, True], ids=["allreduce", "reduce_scatter"])
def test_max_and_min_over_a_sharded_dim_keep_nan(multidevice_test, scatter):
    """torch's amax and amin return NaN where the reduced row holds one; NCCL's and gloo's max and min drop
    it, so a NaN on any rank but the first was lost (and a NaN beside an inf came back inf)."""
    d = multidevice_test.size
    mesh = DeviceMesh(range(d))
    full = rand(21, 4, 2 * d)
    full[0, 0], full[1, -1], full[2, -1], full[2, 0] = float("nan"), float("nan"), float("nan"), float("inf")
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 2 * d], dtype=DataType.Double)
        outs = fd.ops.max(x, [1]), fd.ops.min(x, [1])
        for out in outs:
            fd.add_output(out)
    x.set_device_mesh(mesh)
    x.outer_split(1, d).axis(1).parallelize(X)
    if scatter:
        for out in outs:
            out.set_device_mesh(mesh)
            out.outer_split(0, d).axis(0).parallelize(X)
    got = fd.execute([shard_tensor(full, x)])
    for out, want, sharding in zip(got, (full.amax(1), full.amin(1)), fd.output_shardings()):
        torch.testing.assert_close(out, shard_tensor(want, sharding), equal_nan=True)
    kind = "reduce_scatter" if scatter else "allreduce"
    assert fd.plan.collectives() == ([kind, kind] if d > 1 else [])


def test_a_pending_max_reduced_into_one_device(multidevice_test):
    """A max over a sharded dim, wanted on the last device alone: the pieces' maxima reduced into it."""
    d = multidevice_test.size
    with FusionDefinition() as fd:
        x = fd.define_tensor([3, 4 * d], dtype=DataType.Double)
        m = fd.ops.max(x, [1])
        y = fd.ops.set(m)
        fd.add_output(y)
    x.set_device_mesh(DeviceMesh(range(d)))
    x.outer_split(1, d).axis(1).parallelize(X)
    y.set_device_mesh(DeviceMesh([d - 1]))
    full = rand(19, 3, 4 * d)
    (got,) = fd.execute([shard_tensor(full, x)])
    torch.testing.assert_close(got, shard_tensor(full.amax(1), fd.output_shardings()[0]))
    assert fd.plan.collectives() == (["reduce"] if d > 1 else [])


@pytest.mark.ranks(4)
def test_context_and_tensor_parallel_execute(multidevice_test):
    """[b, s, e] with s split on mesh_x (outer) and mesh_y (inner), gathered to a replicated output."""
    mesh = DeviceMesh(torch.arange(4).reshape(2, 2))
    with FusionDefinition() as fd:
        x = fd.define_tensor([2, 12, 5], dtype=DataType.Double)
        y = fd.ops.mul(x, 2.0)
        fd.add_output(y)
    for tv in (x, y):
        tv.set_device_mesh(mesh)
    x.outer_split(1, 2).axis(1).parallelize(X)
    x.outer_split(2, 2).axis(2).parallelize(Y)
    full = rand(5, 2, 12, 5)
    _run(fd, [x], [full], y, full * 2.0, ["allgather", "allgather"])


@pytest.mark.ranks(4)
@pytest.mark.parametrize("n", [6, 8, 10])
def test_blocks_and_strided_pieces_of_one_dim_on_two_mesh_axes(multidevice_test, n):
    """x in blocks on mesh_y, w in strided pieces on mesh_x, added. For n = 6 and 10 the two pieces overlap
    (S(0) of 2 and S(0, outer=n/2) of 2), so the output cannot take both: propagation once gave it both and
    lowering looped forever (a black-box fuzz, round 19); for n = 8 they nest and no collective runs."""
    mesh = DeviceMesh(torch.arange(4).reshape(2, 2))
    with FusionDefinition() as fd:
        x, w = fd.define_tensor([n], dtype=DataType.Double), fd.define_tensor([n], dtype=DataType.Double)
        fd.add_output(fd.ops.add(x, w))
    x.set_device_mesh(mesh)
    x.outer_split(0, 2).axis(0).parallelize(Y)
    w.set_device_mesh(mesh)
    w.inner_split(0, 2).axis(1).parallelize(X)
    full = [rand(11, n), rand(12, n)]
    (got,) = fd.execute([shard_tensor(t, tv) for tv, t in zip((x, w), full)])
    torch.testing.assert_close(got, shard_tensor(full[0] + full[1], fd.output_shardings()[0]))
    assert fd.plan.collectives() == ([] if n == 8 else ["allgather"])


def test_slice_bounds_normalized_at_execute_keep_a_sharded_dim(multidevice_test):
    """Bounds on a symbolic extent are normalized at execute (negative from the end, clamped): a sharded
    dim they cover whole stays sharded and runs in full on each rank; the narrowed dim is sliced locally."""
    d = multidevice_test.size
    mesh = DeviceMesh(range(d))
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], dtype=DataType.Double)
        y = fd.ops.slice(x, [-1000, 1], [1000, -1])
        fd.add_output(y)
    for tv in (x, y):
        tv.set_device_mesh(mesh)
        tv.outer_split(0, d).axis(0).parallelize(X)
    full = rand(13, 2 * d, 5)
    (got,) = fd.execute([shard_tensor(full, x)])
    torch.testing.assert_close(got, shard_tensor(full[:, 1:-1], fd.output_shardings()[0]))
    assert fd.plan.collectives() == []


@pytest.mark.parametrize("to_one_device", [False, True], ids=["allgather", "gather"])
def test_a_strided_shard_of_a_symbolic_dim_bound_to_zero(multidevice_test, to_one_device):
    """An empty dim's pieces are empty wherever they lie: its strided shard works as a block one (its
    ``outer`` was 0, which shard_tensor and the collectives divided by), and every device holds its
    (empty) piece already, so nothing moves; then a plan for rows gathers them."""
    d = multidevice_test.size
    with FusionDefinition() as fd:
        x = fd.define_tensor([2, -1], dtype=DataType.Double)
        y = fd.ops.set(x)
        fd.add_output(y)
    x.set_device_mesh(DeviceMesh(range(d)))
    x.inner_split(1, d).axis(2).parallelize(X)
    y.set_device_mesh(DeviceMesh([d - 1]) if to_one_device else DeviceMesh(range(d)))
    for width in (0, 3 * d):
        full = rand(14, 2, width)
        (got,) = fd.execute([shard_tensor(full, x)])
        torch.testing.assert_close(got, shard_tensor(full, fd.output_shardings()[0]))
        moves = d > 1 and width > 0
        assert fd.plan.collectives() == (["gather" if to_one_device else "allgather"] if moves else [])


# case: (the output, the collectives on more than one rank)
_BIASED_CASES = {
    "strided out dim": (lambda y, fd: fd.ops.mul(y, 2.0), lambda t: t * 2.0, ["reduce_scatter"]),
    "pending sum": (lambda y, fd: fd.ops.relu(y), torch.relu, ["allreduce"]),
    # a sharded bias is gathered and added once (on the first rank of the sum)
    "pending sum, sharded bias": (lambda y, fd: y, lambda t: t, ["allgather", "allreduce"]),
}


@pytest.mark.parametrize("case", list(_BIASED_CASES))
def test_biased_linear_with_an_annotated_output(multidevice_test, case):
    """The bias is added once: sharded as a strided out dim, or on one device of a pending sum."""
    output, reference, collectives = _BIASED_CASES[case]
    d = multidevice_test.size
    mesh = DeviceMesh(range(d))
    with FusionDefinition() as fd:
        x, w = fd.define_tensor([4, 2 * d], dtype=DataType.Double), fd.define_tensor([3 * d, 2 * d],
                                                                                      dtype=DataType.Double)
        b = fd.define_tensor([3 * d], dtype=DataType.Double)
        y = fd.ops.linear(x, w, b)
        fd.add_output(output(y, fd))
    for tv in (x, w, y):
        tv.set_device_mesh(mesh)
    for tv in (x, w):
        tv.outer_split(-1, d).axis(-2).parallelize(X)
    if case == "strided out dim":
        y.inner_split(1, d).axis(2).parallelize(X)
    else:
        y.outer_split(-1, d).axis(-2).parallelize(X)
    if case == "pending sum, sharded bias":
        b.set_device_mesh(mesh)
        b.outer_split(0, d).axis(0).parallelize(X)
    full = [rand(7, 4, 2 * d), rand(8, 3 * d, 2 * d), rand(9, 3 * d)]
    (got,) = fd.execute([shard_tensor(t, tv) for tv, t in zip((x, w, b), full)])
    torch.testing.assert_close(got, shard_tensor(reference(F.linear(*full)), fd.output_shardings()[0]))
    assert fd.plan.collectives() == ([] if d == 1 else collectives)


def test_context_parallel_tokens_through_a_block(multidevice_test):
    """Tokens on an inner piece (strided) through layer_norm, linear, gelu and a strided contraction."""
    d = multidevice_test.size
    mesh = DeviceMesh(range(d))
    with FusionDefinition() as fd:
        x = fd.define_tensor([3 * d, 4 * d], dtype=DataType.Double)
        w1 = fd.define_tensor([5, 4 * d], dtype=DataType.Double)
        w2 = fd.define_tensor([4 * d, 5], dtype=DataType.Double)
        h = fd.ops.linear(fd.ops.layer_norm(x, [4 * d]), w1)
        fd.add_output(fd.ops.gelu(h))
        fd.add_output(fd.ops.matmul(x, w2))
    x.set_device_mesh(mesh)
    x.inner_split(0, d).axis(1).parallelize(X)
    full = [rand(10, 3 * d, 4 * d), rand(11, 5, 4 * d), rand(12, 4 * d, 5)]
    outs = fd.execute([shard_tensor(full[0], x), full[1], full[2]])
    assert fd.plan.collectives() == []
    want = [F.gelu(F.linear(F.layer_norm(full[0], [4 * d]), full[1])), full[0] @ full[2]]
    for got, ref, sharding in zip(outs, want, fd.output_shardings()):
        torch.testing.assert_close(got, shard_tensor(ref, sharding))
