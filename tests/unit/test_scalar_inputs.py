"""Scalar inputs (nvFuser's ``define_scalar(None, dtype)`` and ``define_vector``): numbers that ``execute`` takes
in order with the tensors. Ops take a scalar as a 0-d tensor, read at every call; where they take a number
(an extent, a fill value, a seed, an index), its value is bound when the plan is built, a plan per value."""

from __future__ import annotations

import pytest
import torch

from tp_fusion import DataType, DeviceMesh, FusionDefinition, InputError, ParallelType
from tp_fusion.errors import DefinitionError


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


def test_scalars_where_ops_take_numbers_are_bound_per_value():
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
    assert _plans(fd) == 3


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
