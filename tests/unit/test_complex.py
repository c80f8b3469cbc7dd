"""Complex dtypes (``DataType.ComplexFloat``, ``DataType.ComplexDouble``) on one process, against torch computed
here: the dtypes' round trip with torch, complex tensors and scalars as operands, torch's promotion, ``real`` and
``imag``, reductions, and what stays refused (GEMMs, normalizations, sorting, a complex value where a real dtype
is asked)."""

from __future__ import annotations

import pytest
import torch

from tp_fusion import DataType, DefinitionError, FusionDefinition
from tp_fusion.runtime import dist

C64, C128 = DataType.ComplexFloat, DataType.ComplexDouble


def _crand(seed: int, *shape, dtype=torch.complex64) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _run(build, inputs: list) -> list[torch.Tensor]:
    """Define a fusion with an input of each tensor's shape and dtype (a number: a scalar input of its kind),
    run it, and check that the dtypes recorded are those that ran."""
    with FusionDefinition() as fd:
        tvs = [fd.define_tensor(list(x.shape), dtype=DataType.from_torch(x.dtype)) if isinstance(x, torch.Tensor)
               else fd.define_scalar(None, DataType.of_number(x)) for x in inputs]
        outs = build(fd, *tvs)
        for o in outs if isinstance(outs, (tuple, list)) else (outs,):
            fd.add_output(o)
    got = fd.execute(inputs)
    assert [fd.fusion.tensor(o).dtype.torch for o in fd.fusion.outputs] == [o.dtype for o in got]
    return got


def _check(got: torch.Tensor, want: torch.Tensor, **tol) -> None:
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    assert got.shape == want.shape, (got.shape, want.shape)
    torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("dt,torch_dtype,short", [(C64, torch.complex64, "c64"), (C128, torch.complex128, "c128")])
def test_complex_datatypes_round_trip_with_torch(dt, torch_dtype, short):
    assert dt.torch is torch_dtype and DataType.from_torch(torch_dtype) is dt and dt.short == short
    assert dt.is_complex and not dt.is_floating and dt.python_type is complex
    assert not DataType.Float.is_complex and DataType.of_number(1j) is C128
    with FusionDefinition() as fd:
        x = fd.define_tensor([2, -1], dtype=dt)
        fd.add_output(fd.ops.neg(x))
    assert x.dtype is dt and f"{short}[2, ?]" in str(fd)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_pointwise_ops_on_complex_tensors(dtype):
    x, y, r = _crand(1, 3, 4, dtype=dtype), _crand(2, 4, dtype=dtype), torch.randn(3, 4)
    got = _run(lambda fd, x, y, r: (fd.ops.add(x, y), fd.ops.mul(x, r), fd.ops.div(x, y), fd.ops.exp(x),
                                    fd.ops.rsqrt(x), fd.ops.sqrt(x), fd.ops.tanh(x), fd.ops.pow(x, 2),
                                    fd.ops.eq(x, x)), [x, y, r])
    want = [x + y, x * r, x / y, x.exp(), x.rsqrt(), x.sqrt(), x.tanh(), x ** 2, x == x]
    for g, w in zip(got, want):
        _check(g, w)


@pytest.mark.parametrize("dtype,real", [(torch.complex64, torch.float32), (torch.complex128, torch.float64)])
def test_real_imag_and_abs_give_the_matching_real_dtype(dtype, real):
    x = _crand(3, 5, 2, dtype=dtype)
    re, im, mag, twice = _run(lambda fd, x: (fd.ops.real(x), fd.ops.imag(x), fd.ops.abs(x),
                                             fd.ops.mul(fd.ops.real(x), 2.0)), [x])
    _check(re, x.real.contiguous())
    _check(im, x.imag.contiguous())
    _check(mag, x.abs())
    _check(twice, x.real * 2)
    assert re.dtype == im.dtype == mag.dtype == real
    assert re.data_ptr() != x.data_ptr()  # the output is no view into the input (torch's real is one)
    with pytest.raises(DefinitionError, match="imag: .*torch rejects operands f32.*imag is not implemented"):
        _run(lambda fd, x: fd.ops.imag(x), [torch.randn(3)])


def test_complex_python_scalars_as_operands_follow_torchs_promotion():
    x, f, i = _crand(4, 2, 3), torch.randn(2, 3), torch.arange(6, dtype=torch.int32).reshape(2, 3)
    got = _run(lambda fd, x, f, i: (fd.ops.mul(x, 3 + 0.5j), fd.ops.mul(x, fd.define_scalar(3 + 0.5j)),
                                    fd.ops.add(f, 1j), fd.ops.sub(i, 2j), fd.ops.mul(f, fd.define_scalar(2.0, C64))),
               [x, f, i])
    want = [x * (3 + 0.5j), x * (3 + 0.5j), f + 1j, i - 2j, f * (2 + 0j)]
    for g, w in zip(got, want):
        _check(g, w)
    assert got[0].dtype == torch.complex64  # a complex128 scalar does not widen a complex64 tensor


def test_complex_define_scalars():
    fd = FusionDefinition()
    assert fd.define_scalar(3 + 0.5j).dtype is C128
    assert fd.define_scalar(2.0, C64).value == 2 + 0j and fd.define_scalar(2.0, C64).dtype is C64
    assert fd.define_scalar(3, C128).value == 3 + 0j
    for dtype in (DataType.Float, DataType.Int, DataType.Bool):
        with pytest.raises(DefinitionError, match=r"define_scalar: \(1\+2j\) is complex; .* holds no complex number"):
            fd.define_scalar(1 + 2j, dtype)
    # folded as nvFuser computes scalars: a define_scalar is of its dtype
    assert fd.ops.mul(fd.define_scalar(2j), fd.define_scalar(3.0)).value == 6j
    assert fd.ops.abs(fd.define_scalar(3 + 4j)).value == 5.0
    assert fd.ops.real(fd.define_scalar(3 + 4j, C64)).dtype is DataType.Float


def test_where_over_complex():
    c = torch.tensor([True, False, True])
    x = _crand(5, 3)
    got = _run(lambda fd, c, x: (fd.ops.where(c, x, 0.0), fd.ops.where(c, fd.define_scalar(3 + 0j),
                                                                    fd.define_scalar(5.0)),
                                 fd.ops.where(c, fd.define_scalar(1j, C64), fd.define_scalar(2j, C64)),
                                 fd.ops.where(c, 1j, 2.0)), [c, x])
    _check(got[0], torch.where(c, x, 0.0))
    _check(got[1], torch.where(c, torch.tensor(3 + 0j, dtype=torch.complex128), 5.0))  # nvFuser's ComplexDouble
    _check(got[2], torch.where(c, 1j, 2j))
    _check(got[3], torch.where(c, 1j, 2.0))  # plain numbers: torch's dtype (complex64)


def test_complex_scalar_inputs():
    x = _crand(6, 4)
    got = _run(lambda fd, x, s: (fd.ops.mul(x, s), fd.ops.add(fd.ops.real(x), fd.ops.imag(s))), [x, 2 - 1j])
    _check(got[0], x * torch.tensor(2 - 1j, dtype=torch.complex128))
    _check(got[1], x.real + torch.tensor(2 - 1j, dtype=torch.complex128).imag)
    with FusionDefinition() as fd:
        s = fd.define_scalar(None, C64)
        fd.add_output(fd.ops.mul(fd.ops.full([2], 1.0, C64), s))
    _check(fd.execute([3.0])[0], torch.full((2,), 3 + 0j, dtype=torch.complex64))  # a real number fits a complex one


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_reductions_of_complex_tensors(dtype):
    x = _crand(7, 2, 32, dtype=dtype)
    dt = DataType.from_torch(dtype)
    got = _run(lambda fd, x: (fd.ops.sum(x, [-1], False, dt), fd.ops.sum(x, [0]), fd.ops.mean(x, [1]),
                              fd.ops.prod(x, [0]), fd.ops.var(x, [1]), fd.ops.cumsum(x, 1)), [x])
    want = [x.sum(-1), x.sum(0), x.mean(1), x.prod(0), x.var(1), x.cumsum(1)]
    for g, w in zip(got, want):
        _check(g, w)
    assert got[4].dtype == x.real.dtype  # var of complex values is real, as torch's


def test_complex_factories_and_casts():
    f = torch.randn(3)
    with pytest.warns(UserWarning, match="discards the imaginary part"):  # torch's, casting complex to real
        got = _run(lambda fd, f: (fd.ops.full([2, 2], 1 - 2j, C64), fd.ops.cast(f, C128),
                                  fd.ops.cast(fd.ops.cast(f, C64), DataType.Double)), [f])
    _check(got[0], torch.full((2, 2), 1 - 2j, dtype=torch.complex64))
    _check(got[1], f.to(torch.complex128))
    _check(got[2], f.double())
    with pytest.raises(DefinitionError, match=r"full: fill_value 1j is complex; dtype DataType.Float holds no"):
        _run(lambda fd, f: fd.ops.full([2], 1j, DataType.Float), [f])
    with pytest.raises(DefinitionError, match="iota: dtype DataType.ComplexFloat is complex"):
        _run(lambda fd, f: fd.ops.iota(3, dtype=C64), [f])


def test_shape_ops_on_complex_tensors():
    x = _crand(8, 2, 3)
    got = _run(lambda fd, x: (fd.ops.permute(x, [1, 0]), fd.ops.reshape(x, [6]), fd.ops.cat([x, x], 0),
                              fd.ops.pad(x, [1, 1], 0.0), fd.ops.slice(x, [0, 1], [2, 3])), [x])
    want = [x.T, x.reshape(6), torch.cat([x, x]), torch.nn.functional.pad(x, (1, 1)), x[:, 1:]]
    for g, w in zip(got, want):
        _check(g, w.contiguous())


@pytest.mark.parametrize("build,match", [
    (lambda fd, x, w: fd.ops.matmul(x, w), "matmul: .* are complex; tp_fusion's GEMMs and normalizations take real"),
    (lambda fd, x, w: fd.ops.linear(x, w), "linear: .* are complex; tp_fusion's GEMMs and normalizations take real"),
    (lambda fd, x, w: fd.ops.layer_norm(x, [4]), "layer_norm: .* are complex; tp_fusion's GEMMs and normalizations"),
    (lambda fd, x, w: fd.ops.topk(x, 2, 1)[0], "topk: .* complex numbers have no order"),
    (lambda fd, x, w: fd.ops.argsort(x, 1), "argsort: .* complex numbers have no order"),
    (lambda fd, x, w: fd.ops.max(x, [1]), "max: .*torch rejects operands c64"),
    (lambda fd, x, w: fd.ops.relu(x), "relu: .*torch rejects operands c64"),
    (lambda fd, x, w: fd.ops.softmax(x, 1), "softmax: .*torch rejects operands c64"),
])
def test_what_stays_refused_for_complex_tensors(build, match):
    with pytest.raises(DefinitionError, match=match):
        with FusionDefinition() as fd:
            x, w = fd.define_tensor([3, 4], dtype=C64), fd.define_tensor([4, 4], dtype=C64)
            fd.add_output(build(fd, x, w))


def test_validate_compares_complex_outputs_with_floating_tolerances():
    x = _crand(9, 4, 16)
    with FusionDefinition() as fd:
        t = fd.define_tensor([4, 16], dtype=C64)
        fd.add_output(fd.ops.sum(fd.ops.mul(t, 1 + 1j), [1]))
    fd.validate([x])
    fd.validate([x], [(x * (1 + 1j)).sum(1) + 1e-6])  # within Float's tolerance for a sum of 16 elements


def test_collectives_carry_complex_tensors_as_real_views_and_refuse_non_sums():
    x = _crand(10, 3)
    assert torch.equal(torch.view_as_complex(dist._wire(x)), x)
    assert dist._wire(x).data_ptr() == x.data_ptr()  # the same memory: a result written into it lands in x
    assert dist._wire(torch.ones(2)).dtype == torch.float32
    with pytest.raises(ValueError, match="a max of complex tensors across devices is not supported"):
        dist._wire(x, "max")
    with pytest.raises(ValueError, match="a prod of complex tensors across devices is not supported"):
        dist._wire(x, "prod")
