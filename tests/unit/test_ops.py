"""Every op of the registry (``tp_fusion.ops``) run through ``fd.execute`` on one process, against torch computed here.

Fusions without meshes need no process group. Each test checks values, output dtype and shape.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from tp_fusion import DataType, DefinitionError, FusionDefinition, InputError
from tp_fusion import ops as _ops

DTYPES = [(torch.float32, DataType.Float), (torch.bfloat16, DataType.BFloat16)]
DTYPE_IDS = ["f32", "bf16"]


def _rand(seed: int, *shape, dtype=torch.float32, positive: bool = False) -> torch.Tensor:
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)
    if positive:
        x = x.abs() + 0.5
    return x.to(dtype)


def _run(build, inputs: list[torch.Tensor]) -> tuple[FusionDefinition, list[torch.Tensor]]:
    """Define a fusion whose inputs have the shapes/dtypes of ``inputs``, run it, and check that
    the inputs were not modified."""
    clones = [x.clone() for x in inputs]
    with FusionDefinition() as fd:
        tvs = [fd.define_tensor(list(x.shape), dtype=DataType.from_torch(x.dtype)) for x in inputs]
        outs = build(fd, *tvs)
        for o in outs if isinstance(outs, (tuple, list)) else (outs,):
            fd.add_output(o)
    got = fd.execute(inputs)
    for x, c in zip(inputs, clones):
        torch.testing.assert_close(x, c, rtol=0, atol=0)
    return fd, got


def _check(got: torch.Tensor, want: torch.Tensor, **tol) -> None:
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    assert got.shape == want.shape, (got.shape, want.shape)
    torch.testing.assert_close(got, want, **tol)


# --- pointwise -------------------------------------------------------------------------------

# name -> (torch reference, the inputs' domain: None, "positive", "unit" (-1, 1) or "ge1" [1, ...))
UNARY = {
    "neg": (torch.neg, None),
    "abs": (torch.abs, None),
    "exp": (torch.exp, None),
    "log": (torch.log, "positive"),
    "tanh": (torch.tanh, None),
    "sigmoid": (torch.sigmoid, None),
    "relu": (torch.relu, None),
    "silu": (F.silu, None),
    "sqrt": (torch.sqrt, "positive"),
    "rsqrt": (torch.rsqrt, "positive"),
    "reciprocal": (torch.reciprocal, "positive"),
} | {name: (getattr(torch, name), None) for name in (
    "asinh", "atan", "cos", "cosh", "sin", "sinh", "tan", "exp2", "expm1", "erf", "erfc", "ceil", "floor", "frac",
    "round", "trunc", "sign", "signbit", "isfinite", "isinf", "isnan", "isneginf", "isposinf", "logical_not")} | {
    name: (getattr(torch, name), "positive") for name in ("log10", "log1p", "log2", "lgamma")} | {
    name: (getattr(torch, name), "unit") for name in ("acos", "asin", "atanh", "erfinv")} | {
    "acosh": (torch.acosh, "ge1")}


def _in_domain(x: torch.Tensor, domain: str | None) -> torch.Tensor:
    if domain == "positive":
        return x.abs() + 0.5
    if domain == "unit":
        return torch.tanh(x) * 0.9
    if domain == "ge1":
        return x.abs() + 1
    return x


@pytest.mark.parametrize("dtype,dt", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", sorted(UNARY))
def test_unary(name, dtype, dt):
    ref, domain = UNARY[name]
    x = _in_domain(_rand(1, 3, 5, dtype=dtype), domain)
    fd, (out,) = _run(lambda fd, a: getattr(fd.ops, name)(a), [x])
    want = ref(x)
    assert fd.fusion.tensor(fd.fusion.outputs[0]).dtype is DataType.from_torch(want.dtype)
    _check(out, want)


def test_bitwise_not_of_ints_and_bools():
    i, b = torch.arange(-3, 3, dtype=torch.int32), torch.tensor([True, False])
    _, (oi, ob) = _run(lambda fd, x, y: (fd.ops.bitwise_not(x), fd.ops.bitwise_not(y)), [i, b])
    _check(oi, torch.bitwise_not(i))
    _check(ob, torch.bitwise_not(b))


def test_an_op_torch_refuses_for_a_dtype_is_a_definition_error():
    with FusionDefinition() as fd:
        x = fd.define_tensor([3], dtype=DataType.Float)
        with pytest.raises(DefinitionError, match="bitwise_not: cannot apply to T0 f32"):
            fd.ops.bitwise_not(x)


BINARY = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div,
    "pow": torch.pow, "maximum": torch.maximum, "minimum": torch.minimum,
    "atan2": torch.atan2, "fmod": torch.fmod, "remainder": torch.remainder, "nextafter": torch.nextafter,
    "truediv": torch.true_divide, "mod": torch.fmod,  # nvFuser's names of torch's div and fmod
}
_DIVIDES = ("div", "truediv", "fmod", "mod", "remainder")
_TENSORS_ONLY = ("maximum", "minimum", "atan2", "nextafter")  # torch takes no Python number for either operand


@pytest.mark.parametrize("dtype,dt", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", sorted(BINARY))
def test_binary_tensor_tensor(name, dtype, dt):
    a = _rand(1, 4, 6, dtype=dtype, positive=name == "pow")
    b = _rand(2, 4, 6, dtype=dtype)
    if name in _DIVIDES:
        b = b.sign() * (b.abs() + 0.5)  # away from zero
    _, (out,) = _run(lambda fd, x, y: getattr(fd.ops, name)(x, y), [a, b])
    _check(out, BINARY[name](a, b))


@pytest.mark.parametrize("dtype,dt", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", sorted(BINARY))
def test_binary_broadcasts_from_the_right(name, dtype, dt):
    a = _rand(1, 2, 3, 4, dtype=dtype, positive=True)
    b = _rand(2, 3, 1, dtype=dtype, positive=True)  # aligned from the right: [_, 3, 1] against [2, 3, 4]
    _, (ab, ba) = _run(lambda fd, x, y: (getattr(fd.ops, name)(x, y), getattr(fd.ops, name)(y, x)), [a, b])
    _check(ab, BINARY[name](a, b))
    _check(ba, BINARY[name](b, a))
    assert ab.shape == (2, 3, 4)


@pytest.mark.parametrize("dtype,dt", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", sorted(BINARY))
def test_binary_with_python_numbers(name, dtype, dt):
    a = _rand(3, 5, dtype=dtype, positive=True)

    def ref(x, y):  # where torch takes no Python number, a 0-dim tensor promotes alike
        if name in _TENSORS_ONLY or not isinstance(x, torch.Tensor):
            x, y = (v if isinstance(v, torch.Tensor) else torch.tensor(v) for v in (x, y))
        return BINARY[name](x, y)

    def build(fd, x):
        return getattr(fd.ops, name)(x, 2.5), getattr(fd.ops, name)(1.5, x), getattr(fd.ops, name)(x, 3)
    _, (o1, o2, o3) = _run(build, [a])
    _check(o1, ref(a, 2.5))
    _check(o2, ref(1.5, a))
    _check(o3, ref(a, 3))
    assert o1.dtype == o2.dtype == o3.dtype == dtype


COMPARISONS = {name: getattr(torch, name) for name in ("lt", "le", "gt", "ge", "eq", "ne")}


@pytest.mark.parametrize("dtype,dt", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", sorted(COMPARISONS))
def test_comparisons(name, dtype, dt):
    a = _rand(1, 4, 6, dtype=dtype).round()
    b = _rand(2, 6, dtype=dtype).round()  # rounded: some elements are equal
    _, (ab, a_num, num_a) = _run(lambda fd, x, y: (getattr(fd.ops, name)(x, y), getattr(fd.ops, name)(x, 0.0),
                                                  getattr(fd.ops, name)(0.5, x)), [a, b])
    _check(ab, COMPARISONS[name](a, b))
    _check(a_num, COMPARISONS[name](a, 0.0))
    _check(num_a, COMPARISONS[name](torch.tensor(0.5, dtype=dtype), a))
    assert ab.dtype == torch.bool


def test_unary_ops_fold_scalars():
    """nvFuser applies unary ops to scalar Vals too (``fd.ops.reciprocal(fd.define_scalar(e))``)."""
    a = _rand(3, 4)

    def build(fd, x):
        return fd.ops.mul(x, fd.ops.reciprocal(fd.define_scalar(8.0, dtype=DataType.Double))), \
            fd.ops.add(x, fd.ops.neg(3))
    _, (o1, o2) = _run(build, [a])
    _check(o1, a / 8)
    _check(o2, a - 3)


@pytest.mark.parametrize("dtype,dt", DTYPES, ids=DTYPE_IDS)
def test_define_scalar_operands(dtype, dt):
    a = _rand(4, 3, 4, dtype=dtype)

    def build(fd, x):
        s = fd.define_scalar(0.25)
        i = fd.define_scalar(3, dtype=DataType.Int)
        f = fd.define_scalar(2, dtype=DataType.Double)  # value becomes 2.0
        return fd.ops.add(fd.ops.mul(x, s), i), fd.ops.sub(f, x)
    _, (o1, o2) = _run(build, [a])
    _check(o1, a * 0.25 + 3)
    _check(o2, 2.0 - a)


def test_type_promotion():
    i64 = torch.arange(6, dtype=torch.int64).reshape(2, 3)
    i32 = torch.arange(3, dtype=torch.int32)
    f32 = _rand(5, 2, 3)
    bf = _rand(6, 3, dtype=torch.bfloat16)

    def build(fd, a, b, c, d):
        return (fd.ops.mul(a, 2.5),     # int tensor * float -> float32
                fd.ops.add(a, b),       # i64 + i32 -> i64
                fd.ops.mul(b, 2),       # i32 * int -> i32
                fd.ops.div(a, 4),       # true division -> float32
                fd.ops.add(c, d),       # f32 + bf16 -> f32
                fd.ops.mul(d, a),       # bf16 * int tensor -> bf16
                fd.ops.add(b, True),    # i32 + bool -> i32
                # a 0-d tensor and a number: the tensor's dtype where the number's kind is no higher
                # (bf16[] * 3.0 came out float32 before round 19)
                fd.ops.mul(fd.ops.sum(d, [0]), 3.0),    # bf16[] * float -> bf16
                fd.ops.sub(2.0, fd.ops.sum(d, [0])),    # float - bf16[] -> bf16
                fd.ops.mul(fd.ops.sum(b, [0]), 2.5))    # i64[] * float -> float32
    fd, outs = _run(build, [i64, i32, f32, bf])
    wants = [i64 * 2.5, i64 + i32, i32 * 2, torch.div(i64, 4), f32 + bf, bf * i64, i32 + True,
             bf.sum() * 3.0, 2.0 - bf.sum(), i32.sum() * 2.5]
    assert [o.dtype for o in outs] == [torch.float32, torch.int64, torch.int32, torch.float32,
                                       torch.float32, torch.bfloat16, torch.int32,
                                       torch.bfloat16, torch.bfloat16, torch.float32]
    for got, want in zip(outs, wants):
        _check(got, want)
    # the recorded output dtypes agree with what ran
    assert [fd.fusion.tensor(o).dtype.torch for o in fd.fusion.outputs] == [o.dtype for o in outs]


@pytest.mark.parametrize("dtype,dt", DTYPES, ids=DTYPE_IDS)
def test_where(dtype, dt):
    c = _rand(1, 4, 5) > 0
    a, b = _rand(2, 4, 5, dtype=dtype), _rand(3, 5, dtype=dtype)  # b broadcasts
    _, (o1, o2, o3) = _run(lambda fd, c, a, b: (fd.ops.where(c, a, b), fd.ops.where(c, a, 0.0),
                                                fd.ops.where(c, 1.0, -1.0)), [c, a, b])
    _check(o1, torch.where(c, a, b))
    _check(o2, torch.where(c, a, 0.0))
    _check(o3, torch.where(c, 1.0, -1.0))
    assert o3.dtype == torch.float32


@pytest.mark.parametrize("dtype,dt", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu(approximate, dtype, dt):
    x = _rand(7, 4, 8, dtype=dtype) * 3
    _, (out,) = _run(lambda fd, a: fd.ops.gelu(a, approximate=approximate), [x])
    _check(out, F.gelu(x, approximate=approximate))


def test_gelu_approximations_differ():
    x = torch.linspace(-3, 3, 101, dtype=torch.float64)
    _, (exact, tanh) = _run(lambda fd, a: (fd.ops.gelu(a), fd.ops.gelu(a, approximate="tanh")), [x])
    _check(exact, 0.5 * x * (1 + torch.erf(x / 2 ** 0.5)))
    _check(tanh, 0.5 * x * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (x + 0.044715 * x ** 3))))
    assert not torch.equal(exact, tanh)


@pytest.mark.parametrize("dtype,dt", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("target", [DataType.Float, DataType.Double, DataType.Half, DataType.BFloat16,
                                    DataType.Int, DataType.Int32, DataType.Bool])
def test_cast(target, dtype, dt):
    x = _rand(8, 3, 4, dtype=dtype) * 10
    _, (out,) = _run(lambda fd, a: fd.ops.cast(a, target), [x])
    _check(out, x.to(target.torch))


# --- reductions ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,dt", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("dims,keepdim", [([0], False), ([1, 2], False), ([-1], True), ([0, 2], True)])
def test_sum_mean_amax(dims, keepdim, dtype, dt):
    x = _rand(9, 3, 4, 5, dtype=dtype)
    _, (s, m, a) = _run(lambda fd, t: (fd.ops.sum(t, dims, keepdim=keepdim), fd.ops.mean(t, dims, keepdim=keepdim),
                                       fd.ops.amax(t, dims, keepdim=keepdim)), [x])
    _check(s, torch.sum(x, dim=dims, keepdim=keepdim))
    _check(m, torch.mean(x, dim=dims, keepdim=keepdim))
    _check(a, torch.amax(x, dim=dims, keepdim=keepdim))


@pytest.mark.parametrize("dtype,dt", DTYPES, ids=DTYPE_IDS)
def test_reduction_dtype_and_int_dim(dtype, dt):
    x = _rand(10, 4, 6, dtype=dtype)
    _, (s, m) = _run(lambda fd, t: (fd.ops.sum(t, 1, dtype=DataType.Double),
                                    fd.ops.mean(t, 0, dtype=DataType.Float)), [x])
    _check(s, torch.sum(x, dim=1, dtype=torch.float64))
    _check(m, torch.mean(x, dim=0, dtype=torch.float32))


def test_sum_of_ints():
    x = torch.arange(12, dtype=torch.int32).reshape(3, 4)
    _, (s,) = _run(lambda fd, t: fd.ops.sum(t, [0]), [x])
    _check(s, torch.sum(x, dim=0))  # torch promotes an int32 sum to int64
    assert s.dtype == torch.int64


@pytest.mark.parametrize("dtype,dt", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("correction", [0, 1])
@pytest.mark.parametrize("keepdim", [False, True])
def test_var_mean(correction, keepdim, dtype, dt):
    x = _rand(11, 4, 6, 3, dtype=dtype)

    def build(fd, t):
        v, m = fd.ops.var_mean(t, [0, 2], correction=correction, keepdim=keepdim)
        return m, v  # outputs in add_output order, not op output order
    _, (m, v) = _run(build, [x])
    want_v, want_m = torch.var_mean(x, dim=[0, 2], correction=correction, keepdim=keepdim)
    _check(v, want_v)
    _check(m, want_m)


def test_var_mean_default_correction_is_one():
    x = _rand(12, 5, 7)
    _, (v, m) = _run(lambda fd, t: fd.ops.var_mean(t, [1]), [x])
    _check(v, x.var(dim=1, unbiased=True))
    _check(m, x.mean(dim=1))


@pytest.mark.parametrize("dtype,dt", DTYPES, ids=DTYPE_IDS)
def test_welford(dtype, dt):
    """nvFuser's welford -> (avg, var_sum, n): var_sum / n is the biased variance (nvFuser's test_welford)."""
    x = _rand(13, 4, 6, 3, dtype=dtype)

    def build(fd, t):
        _, last_sum, last_n = fd.ops.welford(t, 2)
        return (*fd.ops.welford(t, [0, -1]), fd.ops.div(last_sum, last_n))
    _, (avg, var_sum, n, var) = _run(build, [x])
    want_var, want_avg = torch.var_mean(x, dim=[0, 2], correction=0)
    _check(avg, want_avg)
    _check(var_sum, want_var * 12, **({"rtol": 2e-2, "atol": 5e-2} if dtype == torch.bfloat16 else {}))
    _check(n, torch.full((6,), 12))
    _check(var, torch.var(x, dim=2, correction=0))
    with FusionDefinition() as fd:
        with pytest.raises(DefinitionError, match="welford: give at least one dim"):
            fd.ops.welford(fd.define_tensor([2, 3]), [])


# --- matrix ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,dt", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("bias", [False, True])
def test_linear(bias, dtype, dt):
    x, w, b = _rand(13, 2, 3, 8, dtype=dtype), _rand(14, 5, 8, dtype=dtype), _rand(15, 5, dtype=dtype)
    inputs = [x, w, b] if bias else [x, w]
    _, (out,) = _run(lambda fd, *t: fd.ops.linear(*t), inputs)
    _check(out, F.linear(*inputs))
    assert out.shape == (2, 3, 5)


@pytest.mark.parametrize("x_shape", [(8,), (5, 8), (2, 3, 8)])
def test_linear_of_a_1d_weight_drops_the_out_dim(x_shape):
    """torch's F.linear takes a weight [in] (no bias): the result drops the out dim."""
    x, w = _rand(18, *x_shape), _rand(19, 8)
    _, (out,) = _run(lambda fd, *t: fd.ops.linear(*t), [x, w])
    _check(out, F.linear(x, w))
    with FusionDefinition() as fd:
        t, v, b = fd.define_tensor([5, 8]), fd.define_tensor([8]), fd.define_tensor([])
        with pytest.raises(DefinitionError, match="1-D weight .* takes no bias"):
            fd.ops.linear(t, v, b)
        with pytest.raises(DefinitionError, match="must have a dim"):
            fd.ops.linear(t, b)


@pytest.mark.parametrize("dtype,dt", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("sa,sb", [((4, 6), (6, 3)), ((2, 4, 6), (6, 3)), ((2, 4, 6), (1, 6, 3)),
                                   ((6,), (6, 3)), ((4, 6), (6,))])
def test_matmul(sa, sb, dtype, dt):
    a, b = _rand(16, *sa, dtype=dtype), _rand(17, *sb, dtype=dtype)
    _, (out,) = _run(lambda fd, x, y: fd.ops.matmul(x, y), [a, b])
    _check(out, torch.matmul(a, b))


def _logical_split_linear(x, w, b=None):
    """nvFuser's reference for a weight [*lead, out, in]: one linear on the flattened weight, then the
    leading dims moved first."""
    lead, (out, k) = w.shape[:-2], w.shape[-2:]
    y = F.linear(x, w.reshape(-1, k), None if b is None else b.reshape(-1))
    y = y.reshape(*x.shape[:-1], *lead, out)
    return y.permute(*range(x.ndim - 1, x.ndim - 1 + len(lead)), *range(x.ndim - 1), y.ndim - 1)


@pytest.mark.parametrize("dtype,dt", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("x_shape,lead", [((2, 3, 8), (4,)), ((5, 8), (2, 3)), ((8,), (3,))])
def test_linear_weight_with_leading_dims(x_shape, lead, bias, dtype, dt):
    """nvFuser's logical-split linear: w[*lead, out, in], b[*lead, out] -> [*lead, ..., out]."""
    x, w, b = _rand(40, *x_shape, dtype=dtype), _rand(41, *lead, 5, 8, dtype=dtype), _rand(42, *lead, 5, dtype=dtype)
    inputs = [x, w, b] if bias else [x, w]
    fd, (out,) = _run(lambda fd, *t: fd.ops.linear(*t), inputs)
    assert out.shape == (*lead, *x_shape[:-1], 5)
    tol = {"rtol": 2e-2, "atol": 2e-2} if dtype is torch.bfloat16 else {}
    _check(out, _logical_split_linear(*inputs).contiguous(), **tol)


def _grouped_mm_reference(mat1, mat2, offsets):
    ends = offsets.tolist()
    sizes = [end - start for start, end in zip([0, *ends[:-1]], ends)]
    return torch.cat([a @ w for a, w in zip(mat1.split(sizes), mat2.unbind())])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64],
                         ids=["f32", "bf16", "f16", "f64"])
@pytest.mark.parametrize("offsets_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
def test_grouped_mm(dtype, offsets_dtype):
    """Row group i of mat1 (rows offsets[i-1]:offsets[i], an empty group among them) times mat2[i]."""
    mat1, mat2 = _rand(43, 24, 16, dtype=dtype), _rand(44, 4, 16, 8, dtype=dtype)
    offsets = torch.tensor([5, 5, 13, 24], dtype=offsets_dtype)
    fd, (out,) = _run(lambda fd, a, w, o: fd.ops.grouped_mm(a, w, o), [mat1, mat2, offsets])
    assert fd.fusion.tensor(fd.fusion.outputs[0]).shape == (24, 8)
    _check(out, _grouped_mm_reference(mat1, mat2, offsets))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("groups", [(0, 1), (2, 3), (1, 3), (0, 2, 3)], ids=["first", "last", "apart", "runs"])
def test_grouped_mm_of_some_groups_is_their_rows(dtype, groups):
    """A rank holding some groups' weights (``groups_local``, consecutive or not, the empty group among them)
    gives the rows of those groups and zeros for the others: summed over ranks holding each group once, the
    whole result."""
    mat1, mat2 = _rand(45, 24, 16, dtype=dtype), _rand(46, 4, 16, 8, dtype=dtype)
    offsets = torch.tensor([5, 5, 13, 24], dtype=torch.int32)
    got = _ops.OPS["grouped_mm"].impl(mat1, mat2[list(groups)], offsets, groups_local=groups)
    held = torch.zeros(24, 1, dtype=torch.bool)
    for g in groups:
        held[([0, 5, 5, 13][g]):[5, 5, 13, 24][g]] = True
    _check(got, _grouped_mm_reference(mat1, mat2, offsets).masked_fill(~held, 0))


@pytest.mark.parametrize("dtype,k,aten", [(torch.bfloat16, 16, True), (torch.float32, 16, True),
                                          (torch.float64, 16, False), (torch.float32, 6, False)],
                         ids=["bf16", "f32", "f64", "f32_k6"])
def test_grouped_mm_runs_aten_where_it_takes_the_operands(monkeypatch, dtype, k, aten):
    """torch._grouped_mm for bf16, fp16 and fp32 with 16-byte aligned strides; a matmul per group for
    other dtypes and strides (k = 6 floats is a 24-byte row), with the same values."""
    calls = []
    real = torch._grouped_mm

    def spy(*args, **kwargs):
        calls.append(args[0].dtype)
        return real(*args, **kwargs)
    monkeypatch.setattr(torch, "_grouped_mm", spy)
    mat1, mat2 = _rand(45, 12, k, dtype=dtype), _rand(46, 3, k, 8, dtype=dtype)
    offsets = torch.tensor([3, 7, 12], dtype=torch.int32)
    _, (out,) = _run(lambda fd, a, w, o: fd.ops.grouped_mm(a, w, o), [mat1, mat2, offsets])
    _check(out, _grouped_mm_reference(mat1, mat2, offsets))
    assert calls == ([dtype] if aten else [])


def test_grouped_mm_of_a_transposed_weight():
    """The ports' mat2: a permuted [g, n, k] weight, [g, k, n] with k contiguous."""
    mat1, w = _rand(47, 10, 16), _rand(48, 2, 8, 16)
    offsets = torch.tensor([4, 10], dtype=torch.int32)
    _, (out,) = _run(lambda fd, a, b, o: fd.ops.grouped_mm(a, fd.ops.permute(b, [0, 2, 1]), o), [mat1, w, offsets])
    _check(out, _grouped_mm_reference(mat1, w.transpose(1, 2), offsets))


# --- shape ops -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,dt", DTYPES, ids=DTYPE_IDS)
def test_reshape(dtype, dt):
    x = _rand(18, 4, 6, dtype=dtype)
    _, (o1, o2, o3) = _run(lambda fd, t: (fd.ops.reshape(t, [2, 12]), fd.ops.reshape(t, [-1, 3]),
                                          fd.ops.reshape(t, [24])), [x])
    _check(o1, x.reshape(2, 12))
    _check(o2, x.reshape(-1, 3))
    _check(o3, x.reshape(24))


@pytest.mark.parametrize("dtype,dt", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("dims", [(1, 0, 2), (2, 0, 1), (-1, 0, 1), (0, 1, 2)])
def test_permute(dims, dtype, dt):
    x = _rand(19, 2, 3, 4, dtype=dtype)
    _, (out,) = _run(lambda fd, t: fd.ops.permute(t, dims), [x])
    _check(out, x.permute(dims))


def test_transpose_and_stride_order():
    a = _rand(1, 2, 3, 4)

    def build(fd, x):
        return fd.ops.transpose(x, 0, -1), fd.ops.stride_order(x, [0, 2, 1])
    fd, (t, ordered) = _run(build, [a])
    _check(t, a.transpose(0, 2))
    _check(ordered, a)  # the values; the layout (dim 0 fastest) holds inside the fusion
    (inside,) = fd.fusion.ops[1:]
    laid_out = _ops.OPS["stride_order"].impl(a, **dict(inside.attrs))
    assert laid_out.stride() == (1, 8, 2)


def test_nvfuser_slice_and_cat_keywords():
    a = _rand(1, 4, 6)

    def build(fd, x):
        left = fd.ops.slice(x, [0, 0], [4, 3], strides=[1, 1], manual_normalization=0)
        right = fd.ops.slice(x, [0, 3], [4, 6], manual_normalization=True)
        return fd.ops.cat([right, left], dim=1, manual_padding=0)
    _, (out,) = _run(build, [a])
    _check(out, torch.cat([a[:, 3:], a[:, :3]], 1))
    with FusionDefinition() as fd, pytest.raises(DefinitionError, match="manual_padding"):
        x = fd.define_tensor([4, 6])
        fd.ops.cat([x, x], 0, manual_padding=True)


@pytest.mark.parametrize("starts,ends,manual", [
    ([0, 0], [10, 8], False), ([-2, 1], [6, 8], False), ([0, -5], [-1, -2], False), ([4, 0], [2, 8], False),
    ([1, 2], [5, 7], True),
], ids=["end_past_extent", "negative_start", "negative_ends", "end_before_start", "manual"])
def test_slice_bounds_follow_python(starts, ends, manual):
    a = _rand(2, 6, 8)
    _, (out,) = _run(lambda fd, x: fd.ops.slice(x, starts, ends, manual_normalization=manual), [a])
    _check(out, a[starts[0]:ends[0], starts[1]:ends[1]])


@pytest.mark.parametrize("starts,ends,strides,counts", [
    ([0, 0, 0], [4, 4, 4], [1, 1, 1], "3 start_indices, 3 end_indices and 3 strides"),
    ([0, 0, 0], [4, 4], [1, 1], "3 start_indices, 2 end_indices and 2 strides"),
    ([0, 0], [4, 4, 4], [1, 1], "2 start_indices, 3 end_indices and 2 strides"),
    ([0, 0], [4, 4], [1, 1, 1], "2 start_indices, 2 end_indices and 3 strides"),
    ([0], [4], None, "1 start_indices and 1 end_indices")])
def test_slice_bounds_that_miss_a_dim_name_the_counts(starts, ends, strides, counts):
    """nvFuser's slice_error_checks cases: bounds that do not give one entry per dim are refused when recorded,
    the message saying how many dims the tensor has and how many entries each list given has."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([10, 10])
        with pytest.raises(DefinitionError, match=rf"one entry per dim of T0 f32\[10, 10\] \(2 dims\), got {counts}$"):
            fd.ops.slice(x, starts, ends, strides)


def test_manual_normalization_promises_bounds_in_range():
    with FusionDefinition() as fd, pytest.raises(DefinitionError, match=r"\[-2:6:1\] needs 0 <= start"):
        fd.ops.slice(fd.define_tensor([6, 8]), [-2, 0], [6, 8], manual_normalization=True)


@pytest.mark.parametrize("dtype,dt", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("in_shape,shape,bdims", [((3,), (2, 3), (1,)), ((3,), (3, 2), (0,)),
                                                  ((3, 1), (2, 3, 4), (1, 2)), ((2, 3), (2, 5, 3), (0, 2))])
def test_broadcast_in_dim(in_shape, shape, bdims, dtype, dt):
    x = _rand(20, *in_shape, dtype=dtype)
    _, (out,) = _run(lambda fd, t: fd.ops.broadcast_in_dim(t, shape, bdims), [x])
    view = [1] * len(shape)
    for i, d in enumerate(bdims):
        view[d] = in_shape[i]
    _check(out, x.reshape(view).expand(shape))


@pytest.mark.parametrize("dtype,dt", DTYPES, ids=DTYPE_IDS)
def test_squeeze_unsqueeze(dtype, dt):
    x = _rand(21, 1, 3, 1, 4, dtype=dtype)

    def build(fd, t):
        return (fd.ops.squeeze(t, [0, 2]), fd.ops.squeeze(t, 2), fd.ops.squeeze(t, [-2]),
                fd.ops.unsqueeze(t, 0), fd.ops.unsqueeze(t, -1), fd.ops.unsqueeze(t, 3))
    _, outs = _run(build, [x])
    wants = [x.squeeze((0, 2)), x.squeeze(2), x.squeeze(-2), x.unsqueeze(0), x.unsqueeze(-1), x.unsqueeze(3)]
    for got, want in zip(outs, wants):
        _check(got, want)


def test_squeeze_keeps_dims_not_of_extent_1_as_torch_does():
    x = _rand(0, 2, 1, 4)
    _, outs = _run(lambda fd, t: (fd.ops.squeeze(t, [0]), fd.ops.squeeze(t, [0, 1]), fd.ops.squeeze(t, -1)), [x])
    for got, want in zip(outs, [x.squeeze(0), x.squeeze((0, 1)), x.squeeze(-1)]):
        assert got.shape == want.shape
        _check(got, want)


def test_squeeze_of_a_symbolic_dim_is_checked_at_execute():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, 4])
        fd.add_output(fd.ops.squeeze(x, [0]))
    (y,) = fd.execute([_rand(0, 1, 4)])
    _check(y, _rand(0, 1, 4).squeeze(0))
    with pytest.raises(InputError, match=r"dims \[0\] of f32\[2, 4\] are not of extent 1"):
        fd.execute([_rand(0, 2, 4)])


def test_squeeze_expanded_removes_expanded_broadcasts():
    """nvFuser's ``squeeze_expanded``: a dim that expand/broadcast_in_dim made new or grew from 1 is removed
    (its values are alike along it); without the flag it is kept, as torch keeps dims of extent other than 1."""
    x = _rand(1, 3, 1, 4)

    def build(fd, t):
        e = fd.ops.expand(t, [2, 3, 5, 4])  # dim 0 new, dim 2 grown from 1
        b = fd.ops.broadcast_in_dim(t, [3, 1, 4, 6], [0, 1, 2])
        return (fd.ops.squeeze(e, [0, 2], squeeze_expanded=True), fd.ops.squeeze(e, [-2], squeeze_expanded=True),
                fd.ops.squeeze(b, [1, 3], squeeze_expanded=True), fd.ops.squeeze(e, [0, 2]))
    _, outs = _run(build, [x])
    for got, want in zip(outs, [x.squeeze(1), x.squeeze(1).expand(2, 3, 4), x.squeeze(1), x.expand(2, 3, 5, 4)]):
        _check(got, want)


def test_squeeze_expanded_refuses_a_dim_that_is_no_broadcast():
    with FusionDefinition() as fd:
        x = fd.define_tensor([3, 1, 4])
        y = fd.ops.exp(fd.ops.expand(x, [3, 5, 4]))  # no longer the broadcast's output
        for t, d in ((x, 0), (y, 1)):
            with pytest.raises(DefinitionError, match=f"squeeze: dim {d} of T{t.name} .* is no expanded broadcast"):
                fd.ops.squeeze(t, [d], squeeze_expanded=True)
        with pytest.raises(DefinitionError, match="squeeze_expanded must be True or False"):
            fd.ops.squeeze(x, [1], squeeze_expanded="yes")


@pytest.mark.parametrize("dtype,dt", DTYPES, ids=DTYPE_IDS)
def test_set_is_a_copy(dtype, dt):
    x = _rand(22, 3, 4, dtype=dtype)
    _, (out,) = _run(lambda fd, t: fd.ops.set(t), [x])
    _check(out, x)
    assert out.data_ptr() != x.data_ptr()
    out.add_(1)  # writing the output must not touch the input
    torch.testing.assert_close(x, _rand(22, 3, 4, dtype=dtype))


def test_output_that_is_an_input_or_a_view_of_one_is_not_aliased():
    x = _rand(23, 3, 4)
    keep = x.clone()
    with FusionDefinition() as fd:
        t = fd.define_tensor([3, 4])
        fd.add_output(t)
        fd.add_output(fd.ops.reshape(t, [12]))
        fd.add_output(fd.ops.permute(t, [1, 0]))
    a, b, c = fd.execute([x])
    _check(a, x)
    _check(b, x.reshape(12))
    _check(c, x.t())
    for o in (a, b, c):
        o.zero_()
    torch.testing.assert_close(x, keep, rtol=0, atol=0)


# --- normalization ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,dt", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("affine", ["none", "weight", "weight_bias"])
def test_layer_norm(affine, dtype, dt):
    x, w, b = _rand(24, 3, 4, 8, dtype=dtype), _rand(25, 8, dtype=dtype), _rand(26, 8, dtype=dtype)
    extra = {"none": [], "weight": [w], "weight_bias": [w, b]}[affine]

    def build(fd, t, *wb):
        return fd.ops.layer_norm(t, [8], *wb, eps=1e-3)
    _, (out,) = _run(build, [x, *extra])
    _check(out, F.layer_norm(x, [8], *extra, eps=1e-3))


def test_layer_norm_int_shape_and_default_eps():
    x = _rand(27, 4, 6, dtype=torch.float64)
    _, (o1, o2) = _run(lambda fd, t: (fd.ops.layer_norm(t, 6), fd.ops.layer_norm(t, [4, 6])), [x])
    m, v = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
    _check(o1, (x - m) / torch.sqrt(v + 1e-5))
    _check(o2, F.layer_norm(x, [4, 6]))


@pytest.mark.parametrize("dtype,dt", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_softmax(dim, dtype, dt):
    x = _rand(28, 3, 5, dtype=dtype) * 4
    _, (out,) = _run(lambda fd, t: fd.ops.softmax(t, dim), [x])
    _check(out, torch.softmax(x, dim))
    sums = out.float().sum(dim)
    torch.testing.assert_close(sums, torch.ones_like(sums), atol=2e-2, rtol=0)


# --- full ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dt", [DataType.Float, DataType.BFloat16, DataType.Int, DataType.Bool])
def test_full(dt):
    with FusionDefinition() as fd:
        fd.add_output(fd.ops.full([2, 3], 1.5 if dt.is_floating else 1, dt))
    (out,) = fd.execute([])
    _check(out, torch.full([2, 3], 1.5 if dt.is_floating else 1, dtype=dt.torch))


def test_full_combined_with_an_input():
    x = _rand(29, 2, 3, dtype=torch.bfloat16)
    _, (out,) = _run(lambda fd, t: fd.ops.add(t, fd.ops.full([3], 2.0, DataType.BFloat16)), [x])
    _check(out, x + torch.full([3], 2.0, dtype=torch.bfloat16))


# --- a composite fusion, outputs order, symbolic sizes -------------------------------------

@pytest.mark.parametrize("dtype,dt", DTYPES, ids=DTYPE_IDS)
def test_mlp_block_and_output_order(dtype, dt):
    x, w1, b1, w2 = (_rand(30, 6, 8, dtype=dtype), _rand(31, 16, 8, dtype=dtype) * 0.3,
                     _rand(32, 16, dtype=dtype), _rand(33, 8, 16, dtype=dtype) * 0.3)

    def build(fd, x, w1, b1, w2):
        h = fd.ops.gelu(fd.ops.linear(x, w1, b1), approximate="tanh")
        z = fd.ops.linear(h, w2)
        return z, h, fd.ops.sum(z, [0])
    _, (z, h, s) = _run(build, [x, w1, b1, w2])
    want_h = F.gelu(F.linear(x, w1, b1), approximate="tanh")
    want_z = F.linear(want_h, w2)
    _check(h, want_h)
    _check(z, want_z)
    _check(s, want_z.sum(0))


def test_symbolic_sizes_bind_at_execute_and_rebind():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, 8])
        w = fd.define_tensor([-1, 8])
        b = fd.define_tensor([-1])
        y = fd.ops.linear(x, w, b)
        r = fd.ops.relu(fd.ops.add(y, 1.0))
        fd.add_output(r)
        fd.add_output(fd.ops.sum(r, [0]))
        fd.add_output(fd.ops.reshape(x, [-1, 2, 4]))
    assert fd.fusion.tensor(r.name).shape == (-1, -1)
    defined = str(fd)
    for tokens, out_f in ((3, 5), (7, 2), (3, 5)):
        xi, wi, bi = _rand(tokens, tokens, 8), _rand(40 + out_f, out_f, 8), _rand(50, out_f)
        got_r, got_s, got_x = fd.execute([xi, wi, bi])
        want = torch.relu(F.linear(xi, wi, bi) + 1.0)
        _check(got_r, want)
        _check(got_s, want.sum(0))
        _check(got_x, xi.reshape(-1, 2, 4))
        assert str(fd) == defined  # executing does not alter the definition
    assert fd.plan is not None


def test_symbolic_sizes_in_reductions_and_broadcast_in_dim():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, 4], dtype=DataType.BFloat16)
        v, m = fd.ops.var_mean(x, [0])
        fd.add_output(m)
        fd.add_output(v)
        fd.add_output(fd.ops.broadcast_in_dim(x, [2, -1, 4], [1, 2]))
        fd.add_output(fd.ops.mean(x, [0]))
    for n in (3, 6):
        xi = _rand(n, n, 4, dtype=torch.bfloat16)
        m, v, bc, mean = fd.execute([xi])
        want_v, want_m = torch.var_mean(xi, dim=[0])
        _check(m, want_m)
        _check(v, want_v)
        _check(bc, xi.expand(2, n, 4))
        _check(mean, xi.mean(0))


def test_symbolic_extents_must_agree_at_execute():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, 8])
        y = fd.define_tensor([-1, 8])
        fd.add_output(fd.ops.add(x, y))
    (out,) = fd.execute([_rand(1, 3, 8), _rand(2, 3, 8)])
    _check(out, _rand(1, 3, 8) + _rand(2, 3, 8))
    with pytest.raises(InputError, match=r"add: .*T0 f32\[3, 8\], T1 f32\[5, 8\]"):
        fd.execute([_rand(1, 3, 8), _rand(2, 5, 8)])


def test_an_output_added_after_execute_is_picked_up():
    xi = _rand(1, 2, 3)
    with FusionDefinition() as fd:
        x = fd.define_tensor([2, 3])
        fd.add_output(fd.ops.neg(x))
        _check(fd.execute([xi])[0], -xi)
        fd.add_output(fd.ops.exp(x))  # a new output after execute must be picked up
    a, b = fd.execute([xi])
    _check(a, -xi)
    _check(b, xi.exp())


# --- property test: broadcasting binary ops --------------------------------------------------

@st.composite
def _broadcast_pair(draw):
    out = draw(st.lists(st.integers(1, 4), min_size=1, max_size=4))

    def operand():
        n = draw(st.integers(0, len(out)))
        return [draw(st.sampled_from([1, e])) for e in out[len(out) - n:]]
    return operand(), operand()


@settings(max_examples=40, deadline=None)
@given(shapes=_broadcast_pair(), name=st.sampled_from(["add", "sub", "mul", "maximum", "minimum"]),
       swap_dtype=st.booleans())
def test_property_broadcasting_binary_ops(shapes, name, swap_dtype):
    sa, sb = shapes
    if not sa and not sb:
        sa = [1]
    if not sa:
        sa, sb = sb, sa
    a = _rand(1, *sa)
    b = _rand(2, *sb, dtype=torch.bfloat16 if swap_dtype else torch.float32) if sb else None
    if b is None:
        _, (out,) = _run(lambda fd, x: getattr(fd.ops, name)(x, 0.5), [a])
        _check(out, BINARY[name](a, torch.tensor(0.5)))
    else:
        _, (out,) = _run(lambda fd, x, y: getattr(fd.ops, name)(x, y), [a, b])
        _check(out, BINARY[name](a, b))


@pytest.mark.parametrize("dtype,value", [(DataType.Double, 0.044715), (DataType.BFloat16, 0.044715),
                                         (DataType.Int, 0.5), (DataType.Float, 3), (DataType.Int, 3)])
def test_python_numbers_act_as_in_torch(dtype, value):
    """A number operand gives torch's result dtype and keeps its precision (bitwise torch's values)."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([4], dtype=dtype)
        for out in (fd.ops.mul(x, value), fd.ops.sub(value, x), fd.ops.div(x, value)):
            fd.add_output(out)
    t = (torch.randn(4, generator=torch.Generator().manual_seed(0)) * 10).to(dtype.torch)
    for got, want in zip(fd.execute([t]), (t * value, value - t, t / value)):
        assert got.dtype == want.dtype and torch.equal(got, want), (got, want)


# --- nvFuser's other ops ---------------------------------------------------------------------

INTEGER_BINARY = {name: getattr(torch, name) for name in (
    "gcd", "bitwise_and", "bitwise_or", "bitwise_xor", "bitwise_left_shift", "bitwise_right_shift", "logical_and",
    "logical_or", "logical_xor")}


@pytest.mark.parametrize("name", sorted(INTEGER_BINARY))
def test_integer_binary(name):
    a = torch.randint(-20, 20, (4, 6), generator=torch.Generator().manual_seed(0))
    b = torch.randint(0, 5, (6,), generator=torch.Generator().manual_seed(1), dtype=torch.int32)
    _, (ab, a3) = _run(lambda fd, x, y: (getattr(fd.ops, name)(x, y), getattr(fd.ops, name)(x, 3)), [a, b])
    _check(ab, INTEGER_BINARY[name](a, b))
    _check(a3, INTEGER_BINARY[name](a, torch.tensor(3)))


def _unsigned_right_shift(a: torch.Tensor, s) -> torch.Tensor:
    """A logical right shift of each value's two's-complement bits, in Python integers."""
    bits = torch.iinfo(a.dtype).bits
    shifts = torch.as_tensor(s).expand(a.shape).tolist() if torch.is_tensor(s) else [s] * a.numel()
    out = [(v % 2 ** bits) >> n if n < bits else 0 for v, n in zip(a.flatten().tolist(), shifts)]
    return torch.tensor([v - 2 ** bits if v >= 2 ** (bits - 1) else v for v in out], dtype=a.dtype).reshape(a.shape)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
def test_logical_right_shift(dtype):
    """nvFuser's logical_right_shift: zeros shifted in from the left, also for negative values; a shift of the
    width or more gives 0 (nvFuser's test_right_shift_logical values)."""
    a = torch.tensor([-1, -2147483648, 1073741824, -64463884, -65968277, 4042311, -98914167, 5526216], dtype=dtype)
    bits = torch.iinfo(dtype).bits
    s = torch.tensor([0, 1, 3, bits - 1, bits, bits + 5, 7, 2], dtype=dtype)
    _, (by3, by_each, wide) = _run(lambda fd, x, y: (fd.ops.logical_right_shift(x, 3), fd.ops.logical_right_shift(
        x, y), fd.ops.logical_right_shift(x, bits)), [a, s])
    _check(by3, _unsigned_right_shift(a, 3))
    _check(by_each, _unsigned_right_shift(a, s))
    _check(wide, torch.zeros_like(a))
    if dtype == torch.int32:
        assert by3.tolist() == [536870911, 268435456, 134217728, 528812926, 528624877, 505288, 524506641, 690777]


def test_logical_right_shift_of_floats_is_refused():
    with FusionDefinition() as fd:
        x = fd.define_tensor([3])
        with pytest.raises(DefinitionError, match="logical_right_shift: cannot apply"):
            fd.ops.logical_right_shift(x, 1)


@pytest.mark.parametrize("dtype,dt", DTYPES, ids=DTYPE_IDS)
def test_ternary_ops(dtype, dt):
    a, b, c = (_rand(40 + i, 4, 6, dtype=dtype) for i in range(3))
    w = _rand(43, 6, dtype=dtype).sigmoid()

    def build(fd, x, y, z, v):
        return (fd.ops.lerp(x, y, v), fd.ops.lerp(x, y, 0.25), fd.ops.lerp(x, 2.0, v), fd.ops.addcmul(x, y, z, 0.5),
                fd.ops.addcmul(x, y, 3.0), fd.ops.clamp(x, -0.5, 0.5), fd.ops.clamp(x, max=0.25),
                fd.ops.threshold(x, 0.1, -2.0))
    _, outs = _run(build, [a, b, c, w])
    two = torch.tensor(2.0, dtype=dtype)
    want = [torch.lerp(a, b, w), torch.lerp(a, b, 0.25), torch.lerp(a, two.expand(4, 6), w),
            torch.addcmul(a, b, c, value=0.5), torch.addcmul(a, b, torch.tensor(3.0, dtype=dtype)),
            a.clamp(-0.5, 0.5), a.clamp(max=0.25), F.threshold(a, 0.1, -2.0)]
    for got, ref in zip(outs, want):
        _check(got, ref)


def test_clamp_needs_a_bound_and_takes_numbers():
    with FusionDefinition() as fd:
        x = fd.define_tensor([3])
        with pytest.raises(DefinitionError, match="clamp: give min, max or both"):
            fd.ops.clamp(x)
        with pytest.raises(DefinitionError, match="clamp: min must be a Python number"):
            fd.ops.clamp(x, x, 1.0)


@pytest.mark.parametrize("dtype,dt", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("dims,keepdim", [([0], False), ([1, 2], False), (-1, True), (None, False), (None, True)])
def test_max_min_prod_var(dims, keepdim, dtype, dt):
    x = _rand(44, 3, 4, 5, dtype=dtype)
    every = (0, 1, 2) if dims is None else dims
    _, (mx, mn, am, p, v) = _run(lambda fd, t: (
        fd.ops.max(t, dims, keepdim), fd.ops.min(t, dims, keepdim=keepdim), fd.ops.amin(t, dims, keepdim=keepdim),
        fd.ops.prod(t, dims, keepdim), fd.ops.var(t, dims, correction=0, keepdim=keepdim)), [x])
    _check(mx, torch.amax(x, every, keepdim))
    _check(mn, torch.amin(x, every, keepdim))
    _check(am, torch.amin(x, every, keepdim))
    want = x
    for d in sorted([every] if isinstance(every, int) else every, reverse=True):
        want = want.prod(d, keepdim=keepdim)
    _check(p, want)
    _check(v, torch.var(x, every, correction=0, keepdim=keepdim))


def test_reductions_over_every_dim():
    """dims None or empty: every dim, as torch (``x.sum([])`` is the sum of every element)."""
    x = _rand(45, 3, 4)
    _, outs = _run(lambda fd, t: (fd.ops.sum(t), fd.ops.mean(t, dtype=DataType.Double), fd.ops.sum(t, []),
                                  fd.ops.max(t, []), fd.ops.mean(t, ()), fd.ops.var(t, [])), [x])
    for got, want in zip(outs, (x.sum(), x.mean(dtype=torch.float64), x.sum([]), x.amax([]), x.mean(()),
                                torch.var(x, []))):
        _check(got, want)
    with FusionDefinition() as fd:
        t = fd.define_tensor([3, 4])
        with pytest.raises(DefinitionError, match="max: the result has the dtype of T0 f32"):
            fd.ops.max(t, [0], dtype=DataType.Double)


@pytest.mark.parametrize("dtype,dt", DTYPES, ids=DTYPE_IDS)
def test_scans(dtype, dt):
    x = _rand(46, 3, 5, dtype=dtype)
    _, outs = _run(lambda fd, t: (fd.ops.cumsum(t, 1), fd.ops.cumprod(t, 0), fd.ops.cummax(t, -1),
                                  fd.ops.cummin(t, 1), fd.ops.cumsum(t, 0, init=2.0), fd.ops.cummax(t, 1, 0.0)), [x])
    want = [x.cumsum(1), x.cumprod(0), torch.cummax(x, -1).values, torch.cummin(x, 1).values, x.cumsum(0) + 2.0,
            torch.cummax(x, 1).values.clamp_min(0.0)]
    for got, ref in zip(outs, want):
        _check(got, ref)


@pytest.mark.parametrize("dtype,dt", DTYPES, ids=DTYPE_IDS)
def test_pad_triu_expand_select(dtype, dt):
    x = _rand(47, 2, 3, 4, dtype=dtype)
    _, outs = _run(lambda fd, t: (
        fd.ops.pad(t, [1, 2]), fd.ops.pad(t, (0, 1, 2, 0), 1.5), fd.ops.pad(t, [-1, 1, 0, 0, 1, 1]),
        fd.ops.triu(t), fd.ops.triu(t, -1), fd.ops.expand(fd.ops.slice(t, [0, 0, 0], [2, 1, 4]), [5, 2, 3, -1]),
        fd.ops.select(t, 2, 1), fd.ops.select(t, -1, 0)), [x])
    want = [F.pad(x, [1, 2]), F.pad(x, [0, 1, 2, 0], value=1.5), F.pad(x, [-1, 1, 0, 0, 1, 1]), torch.triu(x),
            torch.triu(x, -1), x[:, :1].expand(5, 2, 3, 4), x.select(1, 2), x.select(0, -1)]
    for got, ref in zip(outs, want):
        _check(got, ref)


def test_pad_and_select_check_their_arguments():
    with FusionDefinition() as fd:
        t = fd.define_tensor([2, 3])
        with pytest.raises(DefinitionError, match=r"pad: pad_widths \[1, 2, 3\] must hold \(before, after\) pairs"):
            fd.ops.pad(t, [1, 2, 3])
        with pytest.raises(DefinitionError, match="crop dim 1 of f32"):
            fd.ops.pad(t, [-2, -2])
        with pytest.raises(DefinitionError, match="select: index 3 is out of range for dim 1"):
            fd.ops.select(t, 3, 1)
        with pytest.raises(DefinitionError, match="expand: shape"):
            fd.ops.expand(t, [3])


@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32], ids=["i64", "i32"])
def test_index_select_and_embedding(index_dtype):
    x = _rand(48, 5, 6)
    index = torch.tensor([4, 0, 0, 2], dtype=index_dtype)
    tokens = torch.tensor([[1, 4], [3, 3], [0, 2]], dtype=index_dtype)
    weight = _rand(49, 5, 8) * 3
    saved = weight.clone()
    _, outs = _run(lambda fd, t, i, tok, w: (
        fd.ops.index_select(t, i, 1), fd.ops.index_select(t, i, 0), fd.ops.embedding_fwd(tok, w),
        fd.ops.embedding_fwd(tok, w, padding_idx=3), fd.ops.embedding_fwd(tok, w, None, 1.0, 1.0)),
        [x, index, tokens, weight])
    want = [x.index_select(1, index), x.index_select(0, index), F.embedding(tokens, weight),
            F.embedding(tokens, weight, padding_idx=3),
            F.embedding(tokens, weight.clone(), max_norm=1.0, norm_type=1.0)]
    for got, ref in zip(outs, want):
        _check(got, ref)
    assert torch.equal(weight, saved), "max_norm must not renormalize the weight input in place"


def test_index_select_of_a_0d_index_keeps_the_dim():
    """A 0-d index selects one row and keeps the dim (extent 1), as torch and nvFuser do."""
    x, index = _rand(50, 8, 16), torch.tensor(2)
    _, outs = _run(lambda fd, t, i: (fd.ops.index_select(t, i, 0), fd.ops.index_select(t, i, -1)), [x, index])
    _check(outs[0], x.index_select(0, index))
    _check(outs[1], x.index_select(1, index))


def test_a_lookup_in_a_piece_of_the_vocabulary():
    """A rank holding global rows 1 and 3 of 4 (``rows_local``: each global row's local one, -1 elsewhere)
    returns those rows and zeros for the others; an index out of range fails as F.embedding's does, a
    negative one too (it must neither wrap round the table nor name another index)."""
    table, weight = torch.tensor([-1, 0, -1, 1]), _rand(51, 2, 3)
    got = _ops.OPS["embedding_fwd"].impl(torch.tensor([[1, 0], [3, 2]]), weight, rows_local=table)
    _check(got, torch.stack([torch.stack([weight[0], torch.zeros(3)]), torch.stack([weight[1], torch.zeros(3)])]))
    for bad in ([4], [-1]):
        with pytest.raises(IndexError, match="index out of range in self"):  # F.embedding's own error
            _ops.OPS["embedding_fwd"].impl(torch.tensor(bad), weight, rows_local=table)


@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32], ids=["i64", "i32"])
def test_take_along_axis_gather_scatter_topk_argsort(index_dtype):
    x = _rand(52, 4, 6)
    along = torch.tensor([[5, 0], [1, 2], [0, 4], [2, 3]], dtype=index_dtype)  # distinct per row: scatter is exact
    rows = torch.tensor([[3, 0, 1, 1, 2, 0], [0, 2, 3, 1, 0, 2]], dtype=index_dtype)  # a prefix of x's rows
    _, outs = _run(lambda fd, t, a, r: (
        fd.ops.take_along_axis(t, a, 1), fd.ops.gather(t, r, 0), fd.ops.gather(t, a, 1),
        fd.ops.scatter(t, a, fd.ops.neg(fd.ops.slice(t, [0, 0], [4, 2])), 1), fd.ops.scatter(t, r, -1.5, 0),
        *fd.ops.topk(t, 3, sorted=True), *fd.ops.topk(t, 2, 0, largest=False, sorted=True),
        fd.ops.argsort(t, 0, descending=True), fd.ops.argsort(t, stable=True)), [x, along, rows])
    a, r = along.long(), rows.long()
    want = [torch.gather(x, 1, a), torch.gather(x, 0, r), torch.gather(x, 1, a),
            torch.scatter(x, 1, a, -x[:, :2]), torch.scatter(x, 0, r, -1.5),
            *torch.topk(x, 3), *torch.topk(x, 2, 0, largest=False), x.argsort(0, descending=True), x.argsort(-1)]
    for got, ref in zip(outs, want):
        _check(got, ref)


def test_scatter_from_a_src_of_symbolic_extents():
    """A symbolic extent (-1) of src is checked when bound, not taken as shorter than the index."""
    x, index, src = _rand(53, 4, 6), torch.tensor([[0, 5, 2]] * 4), _rand(54, 4, 3)
    with FusionDefinition() as fd:
        t, i, s = fd.define_tensor([4, 6]), fd.define_tensor([4, 3], dtype=DataType.Int), fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.scatter(t, i, s, 1))
    _check(fd.execute([x, index, src])[0], torch.scatter(x, 1, index, src))


@pytest.mark.parametrize("index_dtype", [DataType.Int, DataType.Int32])
def test_index_put_accumulate_as_nvfuser_tests_it(index_dtype):
    """nvFuser's opinfo: acc [vocab, hidden] plus value [seq, hidden] at rows index [seq] (repeats sum)."""
    acc, value = _rand(55, 64, 12), _rand(56, 30, 12)
    index = torch.randint(0, 64, (30,), generator=torch.Generator().manual_seed(0), dtype=index_dtype.torch)
    with FusionDefinition() as fd:
        a, i, v = fd.define_tensor([64, 12]), fd.define_tensor([30], dtype=index_dtype), fd.define_tensor([30, 12])
        fd.add_output(fd.ops.index_put_accumulate(a, i, v))
    _check(fd.execute([acc, index, value])[0], torch.index_put(acc, [index], value, accumulate=True))
    with FusionDefinition() as bad:
        a, i, v = bad.define_tensor([64, 12]), bad.define_tensor([30], dtype=DataType.Int), bad.define_tensor([30, 8])
        with pytest.raises(DefinitionError,
                           match=r"T2 f32\[30, 8\]: value f32\[30, 8\] must be \[len\(index\), \*acc.shape"):
            bad.ops.index_put_accumulate(a, i, v)
        with pytest.raises(DefinitionError, match="index T0 f32.* must be an Int or Int32 tensor"):
            bad.ops.index_put_accumulate(a, a, v)
        with pytest.raises(DefinitionError, match="must have the dtype of acc"):
            bad.ops.index_put_accumulate(a, i, bad.ops.cast(bad.ops.pad(v, [0, 4]), DataType.Double))


@pytest.mark.parametrize("build,match", [
    (lambda fd, t, i: fd.ops.take_along_axis(t, i, 0), r"take_along_axis: dim 1 of index T1 i64\[2, 3\] must equal "
                                                        r"that of arg T0 f32\[4, 6\] \(only dim 0 may differ\)"),
    (lambda fd, t, i: fd.ops.gather(t, fd.ops.cast(i, DataType.Float), 0), "must be an Int or Int32 tensor"),
    (lambda fd, t, i: fd.ops.gather(t, fd.ops.pad(i, [0, 5]), 0), r"dim 1 of index .* must not exceed that of x"),
    (lambda fd, t, i: fd.ops.scatter(t, i, "a", 0),
     r"scatter: expected a TensorView for src \(a TensorView, a Python number or a define_scalar\), got 'a'"),
    (lambda fd, t, i: fd.ops.topk(t, 7, 1), r"topk: k 7 is out of range for dim 1 of T0 f32\[4, 6\]"),
    (lambda fd, t, i: fd.ops.argsort(t, 2), "dim"),
])
def test_gather_scatter_topk_argsort_errors(build, match):
    with FusionDefinition() as fd:
        t, i = fd.define_tensor([4, 6]), fd.define_tensor([2, 3], dtype=DataType.Int)
        with pytest.raises(DefinitionError, match=match):
            build(fd, t, i)


def test_indices_must_be_integers():
    with FusionDefinition() as fd:
        t, f = fd.define_tensor([5, 6]), fd.define_tensor([4])
        with pytest.raises(DefinitionError, match="index_select: index T1 f32.4. must be an Int or Int32 tensor"):
            fd.ops.index_select(t, f, 0)
        with pytest.raises(DefinitionError, match="embedding_fwd: input T1 f32.4. must be an Int or Int32 tensor"):
            fd.ops.embedding_fwd(f, t)


def test_iota_normal_randn_like_and_segment_set():
    x = _rand(50, 4, 1000)
    with FusionDefinition() as fd:
        t = fd.define_tensor([4, 1000])
        fd.add_output(fd.ops.iota(5))
        fd.add_output(fd.ops.iota(4, 0.5, 0.25, DataType.Float))
        fd.add_output(fd.ops.normal(1.0, 2.0, [4, 1000], rng_seed=3, rng_offset=0, dtype=DataType.Double))
        fd.add_output(fd.ops.randn_like(t, rng_seed=3, rng_offset=0))
        fd.add_output(fd.ops.segment_set(t))
    i, f, n, r, s = fd.execute([x])
    _check(i, torch.arange(5))
    _check(f, torch.arange(4, dtype=torch.float32) * 0.25 + 0.5)
    assert n.dtype == torch.float64 and abs(n.mean() - 1) < 0.1 and abs(n.std() - 2) < 0.1
    assert r.shape == x.shape and r.dtype == x.dtype and abs(r.mean()) < 0.1 and abs(r.std() - 1) < 0.1
    again = fd.execute([x])
    _check(again[2], n)  # a seeded draw is a function of its seed and offset alone
    _check(s, x)
    assert s.data_ptr() != x.data_ptr()


@pytest.mark.parametrize("widths", [[-2, 0], [0, 0, -2, 1], [-1, -1, -1, -1], [-12, 0], [-6, -6]])
def test_pad_crops_with_negative_widths(widths):
    x = _rand(51, 12, 12)
    _, (out,) = _run(lambda fd, t: fd.ops.pad(t, widths), [x])
    _check(out, F.pad(x, widths))


def test_nvfusers_reduction_overloads_and_scalar_constants_in_lists():
    x = _rand(52, 3, 4)
    _, (s, p, m, r, f) = _run(lambda fd, t: (
        fd.ops.sum(t, dim=-1), fd.ops.prod(t, DataType.Double), fd.ops.max(t, dim=0, keepdim=True),
        fd.ops.reshape(t, [fd.define_scalar(2, dtype=DataType.Int), fd.define_scalar(6, dtype=DataType.Int)]),
        fd.ops.full([fd.define_scalar(2, dtype=DataType.Int)], 1.5, DataType.Float)), [x])
    _check(s, x.sum(-1))
    _check(p, x.prod(0, dtype=torch.float64).prod(0))
    _check(m, x.amax(0, keepdim=True))
    _check(r, x.reshape(2, 6))
    _check(f, torch.full([2], 1.5))


@pytest.mark.parametrize("call,match", [
    (lambda fd, t, i: fd.ops.cumsum(t, [0, 1]), "cumsum: dim must be an int, got \\[0, 1\\]"),
    (lambda fd, t, i: fd.ops.cumprod(t, None), "cumprod: dim must be an int, got None"),
    (lambda fd, t, i: fd.ops.pad(t, None), "pad: pad_widths must be a list of ints, got None"),
    (lambda fd, t, i: fd.ops.expand(t, None), "expand: shape must be a list"),
    (lambda fd, t, i: fd.ops.index_select(t, i, None), "index_select: dim must be an int"),
    (lambda fd, t, i: fd.ops.normal(0.0, 1.0, None), "normal: shape must be a list of ints"),
    (lambda fd, t, i: fd.ops.triu(t, 1.5), "triu: diagonal must be an int or a define_scalar, got 1.5"),
    (lambda fd, t, i: fd.ops.sum(t, [0], dim=1), "sum: give dims or dim, not both"),
    (lambda fd, t, i: fd.ops.iota(5, 1, 0.5, DataType.Int32), "iota: start 1 and step 0.5 must be whole numbers"),
    (lambda fd, t, i: fd.ops.max(fd.define_tensor([3, 0]), [1]), "max: cannot apply to T2 .*: dim 1 has extent 0"),
    (lambda fd, t, i: fd.ops.embedding_fwd(i, t, padding_idx=3), "padding_idx 3 is out of range for weight T0"),
])
def test_bad_arguments_of_nvfusers_ops_are_definition_errors(call, match):
    with FusionDefinition() as fd:
        t, i = fd.define_tensor([3, 4]), fd.define_tensor([2], dtype=DataType.Int)
        with pytest.raises(DefinitionError, match=match):
            call(fd, t, i)


def test_kernels_spell_out_their_views_for_tensors_without_elements():
    """torch infers no -1 extent in a tensor without elements: a linear of a [*lead, out, in] weight with
    ``out`` = 0, and a vocabulary-sharded ``index_put_accumulate`` of no ids, ran into that (found reading the
    kernels after the property tests' empty extents)."""
    x, w, b = torch.randn(3, 4), torch.randn(2, 0, 4), torch.randn(2, 0)
    assert _ops.OPS["linear"].impl(x, w, b).shape == (2, 3, 0)
    acc, rows_local = torch.randn(4, 5), torch.tensor([0, 1, -1, -1, 2, 3])  # this rank holds rows 0, 1, 4, 5
    out = _ops.OPS["index_put_accumulate"].impl(acc, torch.zeros(0, dtype=torch.int64), torch.zeros(0, 5),
                                                rows_local=rows_local)
    torch.testing.assert_close(out, acc)
