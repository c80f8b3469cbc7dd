"""nvFuser spellings (issue 14): define_tensor's layout arguments, DataType.Null, fd.fusion.inputs(),
inner_split and chained splits, negative broadcast_dims, fd.ops.size/shape and their symbolic scalars,
expanded broadcasts, output layouts and allocation domains; checked against torch."""

import pytest
import torch

import tp_fusion
from tp_fusion import DataType, DeviceMesh, FusionDefinition, ParallelType
from tp_fusion.errors import DefinitionError, InputError
from tp_fusion.ir import Const, SymbolicSize


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


def test_contiguity_is_in_the_allocation_order_with_a_stride_order():
    """As nvFuser's (its TensorDomain validates contiguity against the allocation domain): entry j is the
    j-th dim from the outermost in memory. Layouts from upstream tests (test_issue2532, test_issue4444)."""
    z = torch.randn(4, 2, 6)[:, :, :3].permute(1, 2, 0)  # shape [2, 3, 4], strides [6, 1, 12]
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1, -1], contiguity=[True, False, True], stride_order=[1, 0, 2])
        fd.add_output(fd.ops.neg(x))
    assert x.contiguity == (True, False, True)  # as declared
    torch.testing.assert_close(fd.execute([z])[0], -z)
    e = torch.randn(5, 1, 3).expand(5, 16, 3)  # strides [3, 0, 1]: dim 1 expanded
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, 16, 3], contiguity=[None, True, True], stride_order=[1, 2, 0])
        fd.add_output(fd.ops.neg(x))
    torch.testing.assert_close(fd.execute([e])[0], -e)
    with FusionDefinition() as fd:
        x = fd.define_tensor([1, -1, 1, 1], contiguity=[True, None, None, None], stride_order=[0, 3, 2, 1])
        fd.add_output(fd.ops.neg(x))  # dim 1 (the outermost) is the contiguous one
    with pytest.raises(InputError, match=r"contiguity \[True, True, True\], stride_order \[1, 0, 2\]\): dim 2 must "
                                         "have a larger stride than dim 0"):
        with FusionDefinition() as fd:
            x = fd.define_tensor([2, 3, 4], contiguity=[True, True, True], stride_order=[1, 0, 2])
            fd.add_output(fd.ops.neg(x))
        fd.execute([torch.randn(2, 3, 4)])


@pytest.mark.parametrize("contiguity", [None, False, True])
def test_a_declared_row_major_stride_order_is_checked(contiguity):
    fd = _add_fusion(contiguity=contiguity, stride_order=[1, 0])  # dim 1 has the smallest stride
    assert fd.fusion.inputs()[0].stride_order == (1, 0)
    t = torch.randn(4, 6)
    torch.testing.assert_close(fd.execute([t])[0], t + 1)
    with pytest.raises(InputError, match=r"stride_order \[1, 0\].*dim 0 must have a larger stride than dim 1"):
        fd.execute([torch.randn(6, 4).t()])


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


def test_execute_takes_a_single_tensor_for_its_list():
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 8])
        fd.add_output(fd.ops.relu(x))
    t = torch.randn(4, 8)
    torch.testing.assert_close(fd.execute(t)[0], t.relu())  # not its 4 rows as 4 inputs
    with FusionDefinition() as fd:
        a, b = fd.define_tensor([4]), fd.define_tensor([4])
        fd.add_output(fd.ops.add(a, b))
    with pytest.raises(InputError, match=r"takes 2 inputs \(T0, T1\), got 1"):
        fd.execute(torch.zeros(4))


def test_an_output_added_twice_comes_back_as_two_tensors():
    with FusionDefinition() as fd:
        x = fd.define_tensor([4])
        y = fd.ops.relu(x)
        fd.add_output(y)
        fd.add_output(y)
    first, second = fd.execute([torch.ones(4)])
    first.add_(1)
    assert second.tolist() == [1.0] * 4


def test_null_dtype_means_no_dtype():
    with FusionDefinition() as fd:
        x = fd.define_tensor([3, 4], dtype=DataType.Half)
        fd.add_output(fd.ops.sum(x, [0], dtype=DataType.Null))
    t = torch.randn(3, 4).half()
    torch.testing.assert_close(fd.execute([t])[0], t.sum(0))
    assert DataType.from_torch(torch.float32) is DataType.Float
    with pytest.raises(DefinitionError, match="DataType.Null is no tensor dtype"):  # a TPFusionError and a ValueError
        _ = DataType.Null.torch
    with pytest.raises(DefinitionError, match=r"torch dtype torch.uint8 has no tp_fusion DataType; the DataTypes "
                                              r"are Float, Double, Half, BFloat16, Int, Int32, UInt64, Bool, "
                                              r"ComplexFloat, ComplexDouble"):
        DataType.from_torch(torch.uint8)


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


def test_size_and_shape_of_symbolic_extents_are_symbolic_scalars():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, 5])
        assert fd.ops.size(x, 1) == 5
        rows = fd.ops.size(x, 0)
        assert isinstance(rows, SymbolicSize) and str(rows) == "T0.size(0)"
        assert fd.ops.shape(x) == [rows, 5]
        y = fd.ops.broadcast_in_dim(x, shape=[3, rows, 5], broadcast_dims=[1, 2])  # a new dim of extent 3
        fd.add_output(fd.ops.slice(y, [0, 1, 0], [2, rows, 5]))  # rows 1.. of every one
    assert "shape=[3, T0.size(0), 5]" in str(fd)
    for n in (4, 7):
        t = torch.randn(n, 5)
        (out,) = fd.execute([t])
        torch.testing.assert_close(out, t.expand(3, n, 5)[:2, 1:])


def test_layer_norm_weight_broadcast_to_a_symbolic_shape():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1, 8])
        w = fd.define_tensor([8])
        var, mean = fd.ops.var_mean(x, dims=[-1], correction=0, keepdim=True)
        y = fd.ops.mul(fd.ops.sub(x, mean), fd.ops.rsqrt(fd.ops.add(var, 1e-5)))
        fd.add_output(fd.ops.mul(y, fd.ops.broadcast_in_dim(w, shape=fd.ops.shape(x), broadcast_dims=[-1])))
    t, wt = torch.randn(2, 3, 8), torch.randn(8)
    torch.testing.assert_close(fd.execute([t, wt])[0], torch.nn.functional.layer_norm(t, [8], wt), atol=1e-5,
                               rtol=1e-5)


def test_a_symbolic_slice_bound_is_normalized_at_execute():
    """``x[:len(y)]``: a bound past the extent is clamped, as torch and nvFuser (which normalizes bounds at
    run time) do; round 18 refused it at execute."""
    with FusionDefinition() as fd:
        x, y = fd.define_tensor([-1]), fd.define_tensor([-1])
        fd.add_output(fd.ops.slice(x, [0], [fd.ops.size(y, 0)]))  # x[:len(y)]
    a = torch.randn(6)
    for n in (4, 8):
        torch.testing.assert_close(fd.execute([a, torch.randn(n)])[0], a[:n])


def test_integer_slice_bounds_on_a_symbolic_extent_are_normalized_at_execute():
    """nvFuser takes integer bounds on a dim whose extent is bound at execute, counted from the end where
    negative and clamped to it, as Python's slices (round 18 refused negative ones when recorded and
    bounds past the extent at execute)."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.slice(x, [0, 1], [4, 3]))
        fd.add_output(fd.ops.slice(x, [1, -3], [-1, 100]))
        with pytest.raises(DefinitionError, match=r"a stride >= 1"):
            fd.ops.slice(x, [0, 0], [2, 2], [1, 0])
    for t in (torch.randn(6, 5), torch.randn(3, 2)):
        got = fd.execute([t])
        torch.testing.assert_close(got[0], t[0:4, 1:3])
        torch.testing.assert_close(got[1], t[1:-1, -3:100])


def test_symbolic_sizes_where_extents_go():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, 4])
        fd.add_output(fd.ops.reshape(x, [fd.ops.size(x, 0), 2, 2]))
        with pytest.raises(DefinitionError, match="shape must be a list of ints, fd.ops.size scalars or scalars"):
            fd.ops.broadcast_in_dim(x, shape=[2.0, 4], broadcast_dims=[0, 1])
    x_full = torch.randn(3, 4)
    torch.testing.assert_close(fd.execute([x_full])[0], x_full.reshape(3, 2, 2))


@pytest.mark.parametrize("symbolic", [False, True])
def test_an_expanded_broadcast_broadcasts_against_another_extent(symbolic):
    """nvFuser's triangle update: a [b, n] mask broadcast_in_dim to [b, n, c] masks a [b, n, 2c] tensor."""
    c = 4
    with FusionDefinition() as fd:
        z = fd.define_tensor([-1, -1, 2 * c] if symbolic else [3, 5, 2 * c])
        m = fd.define_tensor([-1, -1] if symbolic else [3, 5], dtype=DataType.Bool)
        b, n = fd.ops.size(z, 0), fd.ops.size(z, 1)
        mask = fd.ops.broadcast_in_dim(m, shape=[b, n, c], broadcast_dims=[0, 1])
        fd.add_output(fd.ops.where(mask, z, 0.0))
        fd.add_output(fd.ops.add(mask, z))
        fd.add_output(mask)  # as defined: c wide
    t, mt = torch.randn(3, 5, 2 * c), torch.rand(3, 5) > 0.5
    masked, added, mask_out = fd.execute([t, mt])
    torch.testing.assert_close(masked, torch.where(mt[..., None], t, 0.0))
    torch.testing.assert_close(added, mt[..., None] + t)
    assert torch.equal(mask_out, mt[..., None].expand(3, 5, c))


def test_an_expanded_broadcast_against_a_symbolic_extent():
    with FusionDefinition() as fd:
        x, v = fd.define_tensor([-1, -1]), fd.define_tensor([-1])
        wide = fd.ops.broadcast_in_dim(v, shape=[fd.ops.size(v, 0), 1], broadcast_dims=[0])
        fd.add_output(fd.ops.mul(fd.ops.broadcast_in_dim(v, shape=[fd.ops.size(v, 0), 3], broadcast_dims=[0]), x))
        fd.add_output(fd.ops.mul(wide, x))
    t, vt = torch.randn(2, 7), torch.randn(2)
    a, b = fd.execute([t, vt])
    torch.testing.assert_close(a, vt[:, None] * t)
    torch.testing.assert_close(b, vt[:, None] * t)


def test_multidevice_module():
    import tp_fusion.multidevice as md

    assert md.DeviceMesh is tp_fusion.DeviceMesh and md.shard_tensor is tp_fusion.shard_tensor


# --- output layouts (nvFuser's allocation domains) -----------------------------------------------


def _bshe(t):
    """[B, H, S, E] values laid out in memory as [B, S, H, E]."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def test_sdpa_outputs_follow_their_operands_layout():
    b, h, s, e = 2, 3, 5, 8
    with FusionDefinition() as fd:
        q, k, v, grad = (fd.define_tensor([b, h, s, e], contiguity=True, stride_order=[3, 1, 2, 0]) for _ in range(4))
        attn, lse, seed, offset = fd.ops.sdpfa_fwd(q, k, v, is_causal=True)
        grads = fd.ops.sdpfa_bwd(grad, q, k, v, attn, lse, 0.0, True, seed, offset, None)
        for t in (attn, lse, *grads):
            fd.add_output(t)
    ref = [torch.randn(b, h, s, e, requires_grad=True) for _ in range(3)]
    g = torch.randn(b, h, s, e)
    want = torch.nn.functional.scaled_dot_product_attention(*ref, is_causal=True)
    want.backward(g)
    out, lse_out, *got = fd.execute([_bshe(t.detach()) for t in (*ref, g)])
    for actual, expected in zip((out, *got), (want, *(t.grad for t in ref))):
        assert actual.transpose(1, 2).is_contiguous()
        torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)
    assert lse_out.is_contiguous()  # as nvFuser: the logsumexp is [B, H, S] whatever the query's layout


def test_stride_order_output_keeps_its_layout_and_never_aliases_an_input():
    with FusionDefinition() as fd:
        x = fd.define_tensor([2, 3, 4])
        fd.add_output(fd.ops.stride_order(x, [0, 2, 1]))
        fd.add_output(fd.ops.stride_order(fd.ops.neg(x), [2, 1, 0]))
    a = torch.randn(2, 3, 4)
    laid_out = a.permute(1, 2, 0).contiguous().permute(2, 0, 1)  # already in stride_order [0, 2, 1]
    ordered, negated = fd.execute([laid_out])
    assert ordered.stride() == (1, 8, 2) and ordered.data_ptr() != laid_out.data_ptr()
    torch.testing.assert_close(ordered, a)
    assert negated.is_contiguous()
    torch.testing.assert_close(negated, -a)


def _alloc_fusion(order, contiguity=True, split=False):
    """x [4, 6, 2] -> y = x * 2; y's allocation domain lists its loop axes in ``order``."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 6, 2])
        y = fd.ops.mul(x, 2.0)
        fd.add_output(y)
        if split:
            y.set_device_mesh(DeviceMesh([0]))
            y.outer_split(1, 1).axis(1).parallelize(ParallelType.mesh_x)  # [4, x{1}, 6, 2]
            y.outer_split(2, 3)  # [4, x{1}, 3, 2, 2]
        y.set_allocation_domain([y.axis(i) for i in order], contiguity)
    return fd, y


@pytest.mark.parametrize("order, split, strides", [
    ((1, 0, 2), False, (2, 8, 1)),  # [6, 4, 2] in memory
    ((2, 0, 1), False, (6, 1, 24)),
    ((2, 3, 1, 0, 4), True, (2, 8, 1)),  # the pieces of dim 1 adjacent, the device axis anywhere
    ((0, 1, 2, 3, 4), True, (12, 2, 1)),
])
def test_allocation_domain_of_an_output(order, split, strides):
    fd, y = _alloc_fusion(order, split=split)
    t = torch.randn(4, 6, 2)
    (out,) = fd.execute([t])
    assert out.stride() == strides
    torch.testing.assert_close(out, t * 2)


@pytest.mark.parametrize("order, match", [
    ((2, 0, 1, 3, 4), "splits dim 1 around other dims"),
    ((0, 1, 3, 2, 4), "inner piece first"),
    ((0, 2, 3, 4), "every loop axis once"),
])
def test_allocation_domain_that_has_no_strides(order, match):
    with pytest.raises(tp_fusion.ShardingError, match=match):
        _alloc_fusion(order, split=True)


def test_allocation_domain_arguments():
    with FusionDefinition() as fd:
        x, z = fd.define_tensor([2, 3]), fd.define_tensor([2, 3])
        fd.add_output(fd.ops.add(x, z))
    with pytest.raises(tp_fusion.ShardingError, match="this tensor's loop axes"):
        x.set_allocation_domain([z.axis(1), z.axis(0)], True)
    with pytest.raises(tp_fusion.ShardingError, match="new_contiguity must be a bool"):
        x.set_allocation_domain([x.axis(1), x.axis(0)], [True, True])


def test_allocation_domain_of_an_input_is_checked():
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 6])
        fd.add_output(fd.ops.neg(x))
        x.set_allocation_domain([x.axis(1), x.axis(0)], True)  # column-major
    assert x.stride_order == (0, 1) and x.contiguity == (True, True)
    t = torch.randn(6, 4).t()
    torch.testing.assert_close(fd.execute([t])[0], -t)
    with pytest.raises(InputError, match=r"stride_order \[0, 1\].*dim 1 must have a larger stride than dim 0"):
        fd.execute([t.contiguous()])
    with pytest.raises(InputError, match="dim 0 is declared contiguous, so its stride must be 1, got 2"):
        fd.execute([torch.randn(6, 8).t()[::2]])


def test_from_pytorch_declares_the_tensors_layout():
    """nvFuser's fd.from_pytorch / define_tensor(sizes=, strides=): dtype and layout from a tensor, extents
    symbolic unless static_sizes (1 stays 1); tv.shape(), tv.size(i) and tv.is_tensor() as nvFuser spells them."""
    z = torch.randn(4, 2, 6)[:, :, :3].permute(1, 2, 0)  # strides [6, 1, 12]
    e = torch.randn(5, 1, 3, dtype=torch.float64).expand(5, 16, 3)  # an expanded dim
    c = torch.randn(3, 1, 4)
    with FusionDefinition() as fd:
        a, b, d = fd.from_pytorch(z), fd.from_pytorch(e), fd.from_pytorch(c, static_sizes=True)
        for t in (a, b, d):
            fd.add_output(fd.ops.neg(t))
    assert a.shape == (-1, -1, -1) and a.contiguity == (True, False, True) and a.stride_order == (1, 0, 2)
    assert all(isinstance(e, SymbolicSize) for e in a.shape()) and d.shape() == [3, 1, 4]
    # the expanded dim keeps its place in the order (row-major, as nvFuser's): no permuted layout for it
    assert b.dtype is DataType.Double and b.contiguity == (True, None, True) and b.stride_order is None
    assert d.shape == (3, 1, 4) and d.contiguity == (True, None, True) and d.stride_order is None
    assert isinstance(a.size(0), SymbolicSize) and d.size(2) == 4 and a.is_tensor()
    for got, want in zip(fd.execute([z, e, c]), (-z, -e, -c)):
        torch.testing.assert_close(got, want)
    with pytest.raises(InputError, match="dim 2 must have a larger stride than dim 0"):
        fd.execute([z.contiguous(), e, c])  # row-major: not the declared layout


@pytest.mark.parametrize("sizes,strides,contiguity,stride_order", [
    ([2, 1, 3, 1, 4, 3], [12, 4, 4, 4, 1, 0], [True, None, True, None, True, None], [5, 4, 3, 2, 1, 0]),
    ([2, 3, 1, 5, 4], [28, 4, 14, 0, 1], [False, None, True, None, True], [4, 2, 3, 1, 0]),
    ([2, 2, 1, 2, 4, 2], [2, 32, 1, 8, 0, 4], [False, True, True, False, None, None], [2, 5, 0, 4, 1, 3]),
    ([2, 1, 3, 1, 4], [24, 4, 8, 4, 2], [True, True, None, None, False], [4, 2, 3, 1, 0]),
    ([2, 2, 2, 2], [8, 4, 0, 2], [True, True, None, False], [3, 2, 1, 0]),
])
def test_compute_tensor_descriptor_as_nvfusers(sizes, strides, contiguity, stride_order):
    """nvFuser's compute_tensor_descriptor (cases of its test_compute_tensor_descriptor): dims ordered by stride,
    a stride-0 dim at its logical place, the contiguity in that order; from_pytorch declares the same."""
    assert tp_fusion.compute_tensor_descriptor(sizes, strides) == (contiguity, stride_order)
    t = torch.randn(sum(s * (e - 1) for s, e in zip(strides, sizes)) + 1).as_strided(sizes, strides)
    with FusionDefinition() as fd:
        x = fd.from_pytorch(t)
        fd.add_output(x)
        fd.add_output(fd.ops.neg(x))
    order = None if stride_order == list(range(len(sizes) - 1, -1, -1)) else tuple(stride_order)
    assert x.contiguity == tuple(contiguity) and x.stride_order == order
    same, negated = fd.execute([t])
    torch.testing.assert_close(same, t)
    torch.testing.assert_close(negated, -t)
    with pytest.raises(DefinitionError, match="differ in length"):
        tp_fusion.compute_tensor_descriptor(sizes, strides[1:])


def test_shape_called_gives_symbolic_sizes():
    """``tv.shape()`` as a shape argument binds each symbolic extent at execute (it was -1, which
    broadcast_in_dim read as "keep the input's extent" and slice as "from the end": [2, 1, 4] and [2, 3, 2] came
    back, no error); where an op takes only ints, a clear error."""
    with FusionDefinition() as fd:
        x, y = fd.define_tensor([-1, -1, -1]), fd.define_tensor([-1, 1, -1], contiguity=[True, None, True])
        fd.add_output(fd.ops.broadcast_in_dim(y, x.shape(), [0, 1, 2]))
        fd.add_output(fd.ops.slice(x, [0, 0, 1], x.shape()))
        with pytest.raises(DefinitionError, match="pad_widths must be a list of ints"):
            fd.ops.pad(x, [0, x.shape()[2]])
    a, b = torch.randn(2, 3, 4), torch.randn(2, 1, 4)
    wide, sliced = fd.execute([a, b])
    torch.testing.assert_close(wide, b.expand(2, 3, 4))
    torch.testing.assert_close(sliced, a[:, :, 1:])


def test_scalar_arithmetic_folds_into_a_scalar():
    """nvFuser's ops on scalars alone (``mul(s, s)``, ``cast(s, Int)``, a define_scalar ``full`` value) give a
    scalar now, typed where an operand is, as torch types 0-d tensors."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([3])
        two, f32 = fd.define_scalar(2.0), fd.define_scalar(1.0, DataType.Float)
        product = fd.ops.mul(two, fd.define_scalar(3))
        step = fd.ops.nextafter(f32, fd.define_scalar(2.0, DataType.Float))
        whole = fd.ops.cast(fd.define_scalar(3.7), DataType.Int)
        fd.add_output(fd.ops.mul(x, product))
        fd.add_output(fd.ops.full([2], fd.define_scalar(1.5, DataType.Double), DataType.Float))
    # a define_scalar without a dtype is of its number's (nvFuser's: a float a Double); plain numbers stay untyped
    assert (product.value, product.dtype) == (6.0, DataType.Double) and fd.ops.add(2, 3) == Const(5)
    assert (step.value, step.dtype) == (torch.nextafter(torch.tensor(1.0), torch.tensor(2.0)).item(), DataType.Float)
    assert (whole.value, whole.dtype) == (3, DataType.Int)
    scaled, filled = fd.execute([torch.ones(3)])
    torch.testing.assert_close(scaled, torch.full((3,), 6.0))
    torch.testing.assert_close(filled, torch.full((2,), 1.5))
