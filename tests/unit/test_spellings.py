"""nvFuser spellings (issue 14): define_tensor's layout arguments, DataType.Null, fd.fusion.inputs(),
inner_split and chained splits, negative broadcast_dims, fd.ops.size/shape; checked against torch."""

import pytest
import torch

import tp_fusion
from tp_fusion import DataType, DeviceMesh, FusionDefinition, ParallelType
from tp_fusion.errors import DefinitionError, InputError, LoweringError


def _add_fusion(**layout):
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 6], **layout)
        fd.add_output(fd.ops.add(x, 1.0))
    return fd


def test_define_tensor_takes_nvfusers_arguments_in_order():
    with FusionDefinition() as fd:
        x = fd.define_tensor([2, 3], [True, False], DataType.Double, False, [1, 0])
        fd.add_output(fd.ops.neg(x))
    assert x.dtype is DataType.Double and x.contiguity == (True, False)
    t = torch.randn(2, 3, dtype=torch.float64)
    torch.testing.assert_close(fd.execute([t])[0], -t)


def test_dtype_as_second_positional_argument_is_a_clear_error():
    with FusionDefinition() as fd, pytest.raises(DefinitionError, match="dtype=DataType.Half by keyword"):
        fd.define_tensor([2, 3], DataType.Half)


@pytest.mark.parametrize("contiguity", [None, False, True, [True, True], [False, True]])
def test_a_contiguous_input_fits_any_row_major_layout(contiguity):
    t = torch.randn(4, 6)
    torch.testing.assert_close(_add_fusion(contiguity=contiguity).execute([t])[0], t + 1)


def test_no_promise_accepts_any_strides():
    t = torch.randn(6, 4).t()
    torch.testing.assert_close(_add_fusion(contiguity=False).execute([t])[0], t + 1)
    torch.testing.assert_close(_add_fusion().execute([t])[0], t + 1)


def test_a_transposed_input_contradicts_a_contiguous_layout():
    fd = _add_fusion(contiguity=True)
    with pytest.raises(InputError, match="T0.*dim 0 must have a larger stride than dim 1"):
        fd.execute([torch.randn(6, 4).t()])


def test_a_padded_row_contradicts_contiguity_even_after_a_good_call():
    fd = _add_fusion(contiguity=True)
    fd.execute([torch.randn(4, 6)])  # plans are cached by shape: the layout is checked anyway
    with pytest.raises(InputError, match="dim 0 is declared contiguous, so its stride must be 6, got 8"):
        fd.execute([torch.randn(4, 8)[:, :6]])


def test_inner_dim_contiguous_only():
    fd = _add_fusion(contiguity=[False, True])
    t = torch.randn(4, 8)[:, :6]
    torch.testing.assert_close(fd.execute([t])[0], t + 1)
    with pytest.raises(InputError, match="dim 1 is declared contiguous, so its stride must be 1, got 2"):
        fd.execute([torch.randn(4, 12)[:, ::2]])


def test_stride_order_column_major():
    fd = _add_fusion(contiguity=True, stride_order=[0, 1])  # dim 0 has the smallest stride
    assert fd.fusion.inputs()[0].stride_order == (0, 1)
    t = torch.randn(6, 4).t()
    torch.testing.assert_close(fd.execute([t])[0], t + 1)
    with pytest.raises(InputError, match=r"stride_order \[0, 1\].*dim 1 must have a larger stride than dim 0"):
        fd.execute([torch.randn(4, 6)])


def test_broadcast_dims_are_free():
    with FusionDefinition() as fd:
        x = fd.define_tensor([1, -1], contiguity=[None, True])
        y = fd.define_tensor([-1, -1], contiguity=[True, None])  # dim 1 expanded
        fd.add_output(fd.ops.add(x, y))
    a, b = torch.randn(1, 5), torch.randn(3, 1).expand(3, 5)
    torch.testing.assert_close(fd.execute([a, b])[0], a + b)


@pytest.mark.parametrize("kw, match", [
    ({"contiguity": [True]}, "one True, False or None per dim"),
    ({"contiguity": "yes"}, "contiguity must be"),
    ({"stride_order": [0, 0]}, "permutation"),
    ({"dtype": DataType.Null}, "other than Null"),
    ({"is_cpu": 1}, "is_cpu must be a bool"),
])
def test_bad_layout_arguments(kw, match):
    with FusionDefinition() as fd, pytest.raises(DefinitionError, match=match):
        fd.define_tensor([4, 6], **kw)


def test_a_size_one_dim_must_be_declared_broadcast():
    with FusionDefinition() as fd, pytest.raises(DefinitionError, match="dim 0 .* extent 1.*must be None"):
        fd.define_tensor([1, 6], contiguity=[True, True])


def test_sharded_input_layout_is_checked_on_the_local_shard():
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 6], contiguity=True)
        fd.add_output(fd.ops.mul(x, 2.0))
        x.set_device_mesh(DeviceMesh([0]))
        x.outer_split(1, 1).axis(1).parallelize(ParallelType.mesh_x)
    t = torch.randn(4, 6)
    torch.testing.assert_close(fd.execute([tp_fusion.shard_tensor(t, x, 0)])[0], t * 2)


def test_fusion_inputs_called_and_as_tuple():
    with FusionDefinition() as fd:
        a = fd.define_tensor([2])
        b = fd.define_tensor([2])
        fd.add_output(fd.ops.add(a, b))
    inputs = fd.fusion.inputs
    assert inputs == (0, 1) and list(inputs) == [0, 1] and inputs[1] == 1
    tvs = fd.fusion.inputs()
    assert [tv.name for tv in tvs] == [a.name, b.name] and tvs[0].shape == (2,)


def test_null_dtype_means_no_dtype():
    with FusionDefinition() as fd:
        x = fd.define_tensor([3, 4], dtype=DataType.Half)
        fd.add_output(fd.ops.sum(x, [0], dtype=DataType.Null))
    t = torch.randn(3, 4).half()
    torch.testing.assert_close(fd.execute([t])[0], t.sum(0))
    assert DataType.from_torch(torch.float32) is DataType.Float
    with pytest.raises(ValueError, match="Null"):
        _ = DataType.Null.torch


def test_splits_chain_and_inner_split():
    with FusionDefinition() as fd:
        x = fd.define_tensor([12, 4])
        fd.add_output(x)
    assert x.inner_split(0, 3) is x
    assert [ax.extent for ax in (x.axis(i) for i in range(3))] == [4, 3, 4]
    assert x.outer_split(2, 2).split(0, 2) is x
    assert [x.axis(i).extent for i in range(5)] == [2, 2, 3, 2, 2]


def test_negative_broadcast_dims():
    with FusionDefinition() as fd:
        x = fd.define_tensor([4])
        fd.add_output(fd.ops.broadcast_in_dim(x, [3, 4], [-1]))
    t = torch.randn(4)
    torch.testing.assert_close(fd.execute([t])[0], t.expand(3, 4))


def test_size_and_shape_are_ints():
    with FusionDefinition() as fd:
        x = fd.define_tensor([3, 5])
        assert fd.ops.size(x, 0) == 3 and fd.ops.size(x, -1) == 5
        assert fd.ops.shape(x) == [3, 5]
        y = fd.ops.reshape(x, [fd.ops.size(x, 1), fd.ops.size(x, 0)])
        fd.add_output(y)
    t = torch.randn(3, 5)
    torch.testing.assert_close(fd.execute([t])[0], t.reshape(5, 3))


def test_size_of_a_symbolic_extent_is_not_implemented():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, 5])
        assert fd.ops.size(x, 1) == 5
        with pytest.raises(LoweringError, match="dim 0 .* symbolic") as e:
            fd.ops.size(x, 0)
        assert isinstance(e.value, NotImplementedError)
        with pytest.raises(LoweringError):
            fd.ops.shape(x)


def test_multidevice_module():
    import tp_fusion.multidevice as md

    assert md.DeviceMesh is tp_fusion.DeviceMesh and md.shard_tensor is tp_fusion.shard_tensor
