"""Scalar inputs (nvFuser's ``define_scalar(None, dtype)`` and ``define_vector``): numbers that ``execute`` takes
in order with the tensors. Ops take a scalar as a 0-d tensor, read at every call. Where they take a number that
only sets values (a fill value, a bound, a seed: ``OpDef.value_attrs``), it is read at every call too; where the
number shapes the plan (an extent, an index), its value is bound when the plan is built, a plan per value."""

from __future__ import annotations

import pytest
import torch

from tp_fusion import DataType, DeviceMesh, FusionDefinition, InputError, ParallelType
from tp_fusion.errors import DefinitionError
from tp_fusion.ops import opdef, operand_types


def _plans(fd) -> int:
    """How many plans the fusion has built (one per input signature and value of its bound scalars)."""
    return len(fd._executor._cache)


def test_an_operand_scalar_is_read_at_every_call_without_a_new_plan():
    with FusionDefinition() as fd:
        x = fd.define_tensor([3, 4])
        s = fd.define_scalar(None, dtype=DataType.Double)
        t = fd.define_scalar(None, dtype=DataType.Double)
        total = fd.ops.add(s, t)  # an op on scalars is a scalar
        fd.add_output(fd.ops.mul(x, total))
    assert not s.is_tensor() and not total.is_tensor() and x.is_tensor()
    x_full = torch.randn(3, 4)
    for a, b in ((0.5, 1.0), (2.0, -3.0)):
        (out,) = fd.execute([x_full, a, b])
        # a float64 0-d tensor does not widen a float32 tensor, as torch promotes 0-d tensors
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, x_full * torch.tensor(a + b, dtype=torch.float64))
    assert _plans(fd) == 1


def test_extents_from_scalars_are_bound_per_value_and_a_fill_value_is_read_per_call():
    with FusionDefinition() as fd:
        rows = fd.define_scalar(None, dtype=DataType.Int)
        cols = fd.define_scalar(None, dtype=DataType.Int)
        fill = fd.define_scalar(None, dtype=DataType.Float)
        y = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.add(fd.ops.full((rows, cols), fill, DataType.Float), y))
    for shape, value in (((5, 10), 2.5), ((5, 10), 3.5), ((2, 3), 2.5)):
        y_full = torch.randn(shape)
        (out,) = fd.execute([*shape, value, y_full])
        torch.testing.assert_close(out, y_full + value)
    assert _plans(fd) == 2  # one per shape: the fill value builds no plan


def test_seeds_bounds_and_fill_values_from_scalars_are_read_at_every_call():
    """A training loop's seed changes every step: the draw follows it with no new plan, as do the other value
    attributes (a clamp's bounds, a normal's mean, a fill value computed from a scalar)."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([8, 16])
        seed = fd.define_scalar(None, dtype=DataType.Int)
        offset = fd.define_scalar(None, dtype=DataType.Int)
        low = fd.define_scalar(None, dtype=DataType.Double)
        keep = fd.ops.uniform(0.0, 1.0, [8, 16], rng_seed=seed, rng_offset=offset)
        fd.add_output(keep)
        fd.add_output(fd.ops.normal(low, 2.0, [4], rng_seed=seed, rng_offset=offset))
        fd.add_output(fd.ops.clamp(x, min=low, max=fd.ops.add(low, 1.0)))
        fd.add_output(fd.ops.add(x, fd.ops.full([8, 16], fd.ops.mul(low, 2.0), DataType.Float)))
    assert "shape=[8, 16], dtype=DataType.Float, rng_seed=T1.item(), rng_offset=T2.item()" in str(fd)
    x_full = torch.randn(8, 16)
    draws = []
    for step, value in enumerate((-0.5, 0.25, -0.5)):
        with FusionDefinition() as constant:  # the same draws with the numbers written in
            constant.add_output(constant.ops.uniform(0.0, 1.0, [8, 16], rng_seed=100 + step, rng_offset=step * 4))
            constant.add_output(constant.ops.normal(value, 2.0, [4], rng_seed=100 + step, rng_offset=step * 4))
        draw, normal, clamped, shifted = fd.execute([x_full, 100 + step, step * 4, value])
        expected_draw, expected_normal = constant.execute([])
        torch.testing.assert_close(draw, expected_draw, rtol=0, atol=0)
        torch.testing.assert_close(normal, expected_normal, rtol=0, atol=0)
        torch.testing.assert_close(clamped, x_full.clamp(value, value + 1.0))
        torch.testing.assert_close(shifted, x_full + 2 * value)
        draws.append(draw)
    assert not torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], draws[2])  # seeds 100, 101, 102
    assert _plans(fd) == 1
    fd.validate([x_full, 5, 8, 0.75])  # its reference reads them likewise
    plan = fd.compile([[8, 16], 3, 0, 0.5])  # the plan keeps them as numbers of the call
    assert "rng_seed=T1.item()" in str(plan) and "min=T3.item()" in str(plan)
    # ... so no CUDA graph may capture such an op: a replay would keep the captured call's numbers
    clamp = next(op for op in plan.fusion.ops if op.kind == "clamp")
    assert not opdef("clamp").capturable(operand_types(clamp, plan.fusion.tensor), dict(clamp.attrs))
    assert opdef("clamp").capturable(operand_types(clamp, plan.fusion.tensor), {"min": 0.0, "max": 1.0})


def test_iota_start_and_step_and_attention_scale_from_scalars_are_read_at_every_call():
    """Values that set no shape (``iota``'s start and step, attention's scale) build no plan per value."""
    with FusionDefinition() as fd:
        q, k, v, g = (fd.define_tensor([2, 3, 8, 16]) for _ in range(4))
        start = fd.define_scalar(None, dtype=DataType.Double)
        step = fd.define_scalar(None, dtype=DataType.Double)
        scale = fd.define_scalar(None, dtype=DataType.Double)
        fd.add_output(fd.ops.iota(5, start, step, DataType.Float))
        out, lse, seed, offset = fd.ops.sdpfa_fwd(q, k, v, scale=scale)
        fd.add_output(out)
        for grad in fd.ops.sdpfa_bwd(g, q, k, v, out, lse, 0.0, False, seed, offset, scale):
            fd.add_output(grad)
    q_full, k_full, v_full, g_full = (torch.randn(2, 3, 8, 16, generator=torch.Generator().manual_seed(i))
                                      for i in range(4))
    for a, b, c in ((0.0, 1.0, 0.25), (-2.0, 0.5, 0.25), (1.0, 3.0, 0.1)):
        sequence, out, *grads = fd.execute([q_full, k_full, v_full, g_full, a, b, c])
        torch.testing.assert_close(sequence, a + b * torch.arange(5, dtype=torch.float32))
        qr, kr, vr = (t.double().requires_grad_() for t in (q_full, k_full, v_full))
        want = torch.nn.functional.scaled_dot_product_attention(qr, kr, vr, scale=c)
        want.backward(g_full.double())
        for got, ref in zip((out, *grads), (want, qr.grad, kr.grad, vr.grad), strict=True):
            torch.testing.assert_close(got, ref.float(), rtol=1e-4, atol=1e-5)
    assert _plans(fd) == 1


def test_a_vector_is_its_scalars_and_execute_takes_it_as_one_list():
    with FusionDefinition() as fd:
        x = fd.define_tensor([2, 3, 4])
        shape = fd.define_vector(2)
        fd.add_output(fd.ops.sum(fd.ops.reshape(x, shape), dims=[0]))
    assert len(shape) == 2 and all(not s.is_tensor() for s in shape)
    x_full = torch.randn(2, 3, 4)
    for new_shape in ([6, 4], (4, 6), [-1, 12]):
        (out,) = fd.execute([x_full, new_shape])
        torch.testing.assert_close(out, x_full.reshape(new_shape).sum(0))
    (out,) = fd.execute([x_full, 6, 4])  # or its elements, in order
    torch.testing.assert_close(out, x_full.reshape(6, 4).sum(0))
    with pytest.raises(InputError, match="cannot reshape"):
        fd.execute([x_full, [5, 6]])


def test_an_extent_computed_from_scalars_is_a_whole_number():
    """nvFuser's test_reshape_dynamic: an extent computed in floats (192 * reciprocal(n)) is taken as an integer."""
    with FusionDefinition() as fd:
        n = fd.define_scalar(None, dtype=DataType.Int)
        x = fd.define_tensor([-1, -1, -1])
        cols = fd.ops.mul(fd.define_scalar(192, dtype=DataType.Int), fd.ops.reciprocal(n))
        fd.add_output(fd.ops.sum(fd.ops.reshape(x, [n, cols]), dims=[1]))
    x_full = torch.randn(4, 8, 6)
    (out,) = fd.execute([32, x_full])
    torch.testing.assert_close(out, x_full.reshape(32, 6).sum(1))
    with pytest.raises(InputError, match="scalar T.* is 3.8399.*, where an op takes an integer"):
        fd.execute([50, torch.randn(4, 5, 10)])


def test_seeds_indices_and_scatter_values_from_scalars():
    with FusionDefinition() as fd:
        x = fd.define_tensor([8, 16])
        index = fd.define_tensor([8, 16], dtype=DataType.Int)
        seed = fd.define_scalar(DataType.Int)  # nvFuser's spelling of a scalar input of a dtype
        row = fd.define_scalar(None, dtype=DataType.Int)
        src = fd.define_scalar(None, dtype=DataType.Double)
        fd.add_output(fd.ops.uniform(0.0, 1.0, [8, 16], rng_seed=seed, rng_offset=0))
        fd.add_output(fd.ops.select(x, row, 0))
        fd.add_output(fd.ops.scatter(x, index, src, 1))
    with FusionDefinition() as constant:
        constant.add_output(constant.ops.uniform(0.0, 1.0, [8, 16], rng_seed=7, rng_offset=0))
    x_full, index_full = torch.randn(8, 16), torch.randint(0, 16, (8, 16))
    draw, picked, scattered = fd.execute([x_full, index_full, 7, -2, 1.5])
    torch.testing.assert_close(draw, constant.execute([])[0], rtol=0, atol=0)
    torch.testing.assert_close(picked, x_full[-2])
    torch.testing.assert_close(scattered, torch.scatter(x_full, 1, index_full, 1.5))
    _, _, scattered = fd.execute([x_full, index_full, 7, -2, -4.0])  # src is read at run time: no new plan
    torch.testing.assert_close(scattered, torch.scatter(x_full, 1, index_full, -4.0))
    assert _plans(fd) == 1


def test_arithmetic_on_a_symbolic_size_gives_a_scalar():
    """nvFuser's mean over a symbolic dim, ``sum(x, 1) * reciprocal(size(x, 1))``, and an extent computed from a
    size: the size is a Scalar once an op takes it (one per size)."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        n = fd.ops.size(x, 1)
        fd.add_output(fd.ops.mul(fd.ops.sum(x, [1]), fd.ops.reciprocal(n)))
        fd.add_output(fd.ops.reshape(x, [fd.ops.mul(n, 2), -1]))
    assert str(fd).count("full(shape=[], fill_value=T0.size(1)") == 1
    for shape in ((4, 6), (2, 5)):
        x_full = torch.randn(shape)
        mean, reshaped = fd.execute([x_full])
        torch.testing.assert_close(mean, x_full.mean(1))
        torch.testing.assert_close(reshaped, x_full.reshape(2 * shape[1], -1))


def test_a_scalar_input_refuses_what_is_no_number_of_its_kind():
    with FusionDefinition() as fd:
        x = fd.define_tensor([4])
        n = fd.define_scalar(None, dtype=DataType.Int)
        fd.add_output(fd.ops.mul(x, n))
    x_full = torch.randn(4)
    for bad in ("2", 2.5, torch.ones(2, dtype=torch.int64)):
        with pytest.raises(InputError, match="input T1 is a scalar of torch.int64 .*pass a number of its kind"):
            fd.execute([x_full, bad])
    torch.testing.assert_close(fd.execute([x_full, True])[0], x_full)  # a bool is an int, as in Python


def test_compile_takes_a_scalar_inputs_value_in_its_place():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, 4])
        rows = fd.define_scalar(None, dtype=DataType.Int)
        fd.add_output(fd.ops.reshape(x, [rows, -1]))
    assert "reshape(T0, shape=[T1.item(), -1])" in str(fd)
    plan = fd.compile([[6, 4], 3])
    assert "reshape(T0, shape=[3, -1]) : f32[3, 8]" in str(plan)
    with pytest.raises(InputError, match="input T1 is a scalar; give its value"):
        fd.compile([[6, 4], [3]])
    with pytest.raises(InputError, match=r"a number of its kind, torch.int64\), got 2.5"):  # as execute refuses it
        fd.compile([[6, 4], 2.5])


def test_a_scalar_where_a_number_must_be_known_now_is_refused():
    with FusionDefinition() as fd:
        x = fd.define_tensor([8])
        k = fd.define_scalar(None, dtype=DataType.Int)
        with pytest.raises(DefinitionError, match="k must be an int or a define_scalar, got a scalar of "
                                                  "DataType.Int known only at execute"):
            fd.ops.topk(x, k)
        with pytest.raises(DefinitionError, match="pad_widths must be a list of ints"):
            fd.ops.pad(x, [k, 1])
        flag = fd.define_scalar(None, dtype=DataType.Bool)
        with pytest.raises(DefinitionError, match="index must be an int or a define_scalar, got a scalar of "
                                                  "DataType.Bool"):
            fd.ops.select(x, flag, 0)


@pytest.mark.ranks(2)
def test_a_scalar_input_on_every_rank(multidevice_test):
    """A replicated scalar scales a sharded tensor, and another sets the extents of a sharded reshape."""
    mesh = DeviceMesh(range(multidevice_test.size))
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 6])
        scale = fd.define_scalar(None, dtype=DataType.Float)
        cols = fd.define_scalar(None, dtype=DataType.Int)
        y = fd.ops.reshape(fd.ops.mul(x, scale), [4, cols, -1])
        fd.add_output(y)
        for tv in (x, y):
            tv.set_device_mesh(mesh)
            tv.outer_split(0, mesh.size)
            tv.axis(0).parallelize(ParallelType.mesh_x)
    full = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    for value, c in ((2.0, 3), (0.5, 3), (2.0, 2)):
        (out,) = fd.execute([multidevice_test.shard_tensor(full, x), value, c])
        torch.testing.assert_close(out, multidevice_test.shard_tensor((full * value).reshape(4, c, -1), y))
        assert fd.plan.collectives() == []
    assert _plans(fd) == 2


@pytest.mark.ranks(2)
def test_a_seed_from_a_scalar_input_on_every_rank(multidevice_test):
    """A sharded draw whose seed is a scalar input: each rank keeps its slice of the whole draw of that seed,
    and a new seed builds no new plan."""
    mesh = DeviceMesh(range(multidevice_test.size))
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 6])
        seed = fd.define_scalar(None, dtype=DataType.Int)
        noise = fd.ops.uniform(0.0, 1.0, [4, 6], rng_seed=seed, rng_offset=0)
        y = fd.ops.add(x, noise)
        fd.add_output(y)
        for tv in (x, noise, y):
            tv.set_device_mesh(mesh)
            tv.outer_split(0, mesh.size)
            tv.axis(0).parallelize(ParallelType.mesh_x)
    full = torch.randn(4, 6)
    for s in (3, 4):
        with FusionDefinition() as whole:
            whole.add_output(whole.ops.uniform(0.0, 1.0, [4, 6], rng_seed=s, rng_offset=0))
        (expected,) = whole.execute([])
        (out,) = fd.execute([multidevice_test.shard_tensor(full, x), s])
        torch.testing.assert_close(out, multidevice_test.shard_tensor(full + expected, y))
    assert _plans(fd) == 1
