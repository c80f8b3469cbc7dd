"""The fused aten norm and activation-gradient ops (``native_layer_norm``, ``native_layer_norm_backward``,
``gelu_backward``) run through ``fd.execute`` on one process, against torch: values, dtypes, shapes,
their sharding rules' candidates, and the errors they raise on bad operands."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tp_fusion.sharding.sharding import PARTIAL_SUM, REPLICATE, Shard

from tp_fusion import DataType, DefinitionError, FusionDefinition
from tp_fusion import ops as _ops

DTYPES = [(torch.float32, DataType.Float), (torch.bfloat16, DataType.BFloat16), (torch.float64, DataType.Double)]
DTYPE_IDS = ["f32", "bf16", "f64"]
TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.float64: {"rtol": 1e-10, "atol": 1e-10},
       torch.bfloat16: {"rtol": 2e-2, "atol": 2e-2}}
EPS = 1e-3


def _rand(seed: int, *shape, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32).to(dtype)


def _run(build, inputs: list[torch.Tensor]):
    """A fusion on inputs shaped and typed as ``inputs``; returns (fd, outputs)."""
    with FusionDefinition() as fd:
        tvs = [fd.define_tensor(list(x.shape), dtype=DataType.from_torch(x.dtype)) for x in inputs]
        outs = build(fd, *tvs)
        for o in outs if isinstance(outs, (tuple, list)) else (outs,):
            if o is not None:
                fd.add_output(o)
    return fd, fd.execute(inputs)


def _stats_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def _want_stats(x: torch.Tensor, ns) -> tuple[torch.Tensor, torch.Tensor]:
    """mean and rstd as aten's CUDA kernels give them (float32 math for half inputs)."""
    dims = tuple(range(x.ndim - len(ns), x.ndim))
    var, mean = torch.var_mean(x.to(_stats_dtype(x.dtype)), dims, correction=0, keepdim=True)
    return mean, torch.rsqrt(var + EPS)


def _check(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    assert got.shape == want.shape, (got.shape, want.shape)
    torch.testing.assert_close(got, want, **TOL[dtype])


# --- native_layer_norm ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,dt", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape,ns", [((3, 5, 8), [8]), ((3, 5, 8), [5, 8]), ((6, 16), [16])])
@pytest.mark.parametrize("affine", ["none", "weight", "both"])
def test_native_layer_norm(shape, ns, affine, dtype, dt):
    x = _rand(0, *shape, dtype=dtype)
    params = {"none": [], "weight": [1 + 0.1 * _rand(1, *ns, dtype=dtype)],
              "both": [1 + 0.1 * _rand(1, *ns, dtype=dtype), _rand(2, *ns, dtype=dtype)]}[affine]
    fd, (y, mean, rstd) = _run(lambda fd, t, *p: fd.ops.native_layer_norm(t, ns, *p, eps=EPS), [x, *params])
    # inferred types: y like x; mean/rstd [..., 1] per normalized dim, float32 for bf16 (as aten on CUDA)
    types = [fd.fusion.tensor(o) for o in fd.fusion.outputs]
    stats_shape = (*shape[:len(shape) - len(ns)], *(1 for _ in ns))
    assert [(t.shape, t.dtype) for t in types] == [(shape, dt), *[(stats_shape, _ops._stats_dtype(dt))] * 2]
    want_mean, want_rstd = _want_stats(x, ns)
    _check(mean, want_mean, dtype)
    _check(rstd, want_rstd, dtype)
    _check(y, F.layer_norm(x, ns, *params, eps=EPS), dtype)
    if dtype != torch.bfloat16:  # aten's own kernel, bit for bit (bf16 stats differ on the CPU: see the op)
        for got, want in zip((y, mean, rstd), torch.native_layer_norm(x, ns, *params, *[None] * (2 - len(params)),
                                                                      EPS)):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_native_layer_norm_matches_layer_norm_and_int_shape():
    x, w, b = _rand(0, 4, 10), _rand(1, 10), _rand(2, 10)
    _, (y, y_int, ln) = _run(lambda fd, t, tw, tb: (fd.ops.native_layer_norm(t, [10], tw, tb)[0],
                                                  fd.ops.native_layer_norm(t, 10, tw, tb)[0],
                                                  fd.ops.layer_norm(t, [10], tw, tb)), [x, w, b])
    torch.testing.assert_close(y, ln, rtol=0, atol=0)
    torch.testing.assert_close(y_int, ln, rtol=0, atol=0)


def test_layer_norm_of_symbolic_parameters_and_float32_parameters_of_half_inputs():
    """A weight and bias of symbolic extent ([-1], API.md: any number of -1) are checked once bound; a bf16
    input takes float32 parameters, as torch's mixed-precision layer norm (both refused when recorded before
    round 19)."""
    from tp_fusion import InputError

    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 10])
        w, b = fd.define_tensor([-1]), fd.define_tensor([-1])
        fd.add_output(fd.ops.layer_norm(x, 10, w, b))
    x, w, b = _rand(0, 4, 10), _rand(1, 10), _rand(2, 10)
    (y,) = fd.execute([x, w, b])
    torch.testing.assert_close(y, F.layer_norm(x, [10], w, b))
    with pytest.raises(InputError, match="normalized shape"):
        fd.execute([x, _rand(1, 9), _rand(2, 9)])
    xb = x.bfloat16()
    _, (y, y_native) = _run(lambda fd, t, tw, tb: (fd.ops.layer_norm(t, [10], tw, tb),
                                                   fd.ops.native_layer_norm(t, [10], tw, tb)[0]), [xb, w, b])
    for got in (y, y_native):
        _check(got, F.layer_norm(xb, [10], w, b), torch.bfloat16)
    with pytest.raises(DefinitionError, match="dtypes"):  # torch takes float32 parameters only
        _run(lambda fd, t, tw: fd.ops.layer_norm(t, [10], tw), [x, w.bfloat16()])


# --- native_layer_norm_backward ---------------------------------------------------------------


@pytest.mark.parametrize("dtype,dt", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape,ns", [((3, 5, 8), [8]), ((3, 5, 8), [5, 8]), ((6, 16), [16])])
def test_native_layer_norm_backward_matches_autograd(shape, ns, dtype, dt):
    x, g = _rand(0, *shape, dtype=dtype), _rand(3, *shape, dtype=dtype)
    w, b = 1 + 0.1 * _rand(1, *ns, dtype=dtype), _rand(2, *ns, dtype=dtype)

    def build(fd, tx, tw, tb, tg):
        _, mean, rstd = fd.ops.native_layer_norm(tx, ns, tw, tb, eps=EPS)
        return fd.ops.native_layer_norm_backward(tg, tx, ns, mean, rstd, tw, tb)
    fd, (gx, gw, gb) = _run(build, [x, w, b, g])
    assert [fd.fusion.tensor(o).shape for o in fd.fusion.outputs] == [shape, tuple(ns), tuple(ns)]
    assert {fd.fusion.tensor(o).dtype for o in fd.fusion.outputs} == {dt}
    # torch's autograd of F.layer_norm, in float64 for the half-precision dtypes
    ref = torch.float64 if dtype == torch.bfloat16 else dtype
    xr, wr, br = (t.to(ref).requires_grad_() for t in (x, w, b))
    F.layer_norm(xr, ns, wr, br, eps=EPS).backward(g.to(ref))
    for got, want in zip((gx, gw, gb), (xr.grad, wr.grad, br.grad)):
        _check(got, want.to(dtype), dtype)
    if dtype != torch.bfloat16:  # aten's kernel bit for bit
        _, mean, rstd = torch.native_layer_norm(x, ns, w, b, EPS)
        want = torch.ops.aten.native_layer_norm_backward(g, x, ns, mean, rstd, w, b, [True, True, True])
        for got, w_ in zip((gx, gw, gb), want):
            torch.testing.assert_close(got, w_, rtol=0, atol=0)


@pytest.mark.parametrize("affine", ["none", "weight", "bias"])
def test_native_layer_norm_backward_without_affine_gives_none(affine):
    x, g, p = _rand(0, 4, 8), _rand(3, 4, 8), 1 + 0.1 * _rand(1, 8)
    given = {"none": {}, "weight": {"weight": p}, "bias": {"bias": p}}[affine]
    got = {}

    def build(fd, tx, tg, *tp):
        params = dict(zip(given, tp))
        _, mean, rstd = fd.ops.native_layer_norm(tx, [8], **params, eps=EPS)
        grads = fd.ops.native_layer_norm_backward(tg, tx, [8], mean, rstd, **params)
        assert len(grads) == 3
        got.update(zip(("x", "weight", "bias"), grads))
        return grads
    _, outs = _run(build, [x, g, *given.values()])
    assert [k for k, v in got.items() if v is not None] == ["x", *given]
    xr = x.double().requires_grad_()
    pr = {k: v.double().requires_grad_() for k, v in given.items()}
    F.layer_norm(xr, [8], **pr, eps=EPS).backward(g.double())
    for o, want in zip(outs, (xr.grad, *(v.grad for v in pr.values()))):
        torch.testing.assert_close(o, want.float(), rtol=1e-5, atol=1e-5)


def test_native_layer_norm_backward_of_strided_statistics():
    """mean and rstd as a rank holds a strided shard of them (every other row, a non-contiguous view): aten's
    CPU kernel read them as if contiguous, so every row after the first was wrong."""
    x, g, w = _rand(0, 8, 8).double(), _rand(3, 8, 8).double(), 1 + 0.1 * _rand(1, 8).double()
    mean, rstd = x.mean(1, keepdim=True), torch.rsqrt(x.var(1, correction=0, keepdim=True) + EPS)
    rows = slice(1, None, 2)  # the inner piece of outer_split(0, 2) on the second rank
    impl = _ops.OPS["native_layer_norm_backward"].impl
    got = impl(g[rows], x[rows], mean[rows], rstd[rows], w, normalized_shape=[8], affine=("weight",))
    want = torch.ops.aten.native_layer_norm_backward(g[rows].contiguous(), x[rows].contiguous(), [8],
                                                     mean[rows].contiguous(), rstd[rows].contiguous(), w, None,
                                                     [True, True, False])
    for o, r in zip(got, want):
        torch.testing.assert_close(o, r)


# --- gelu_backward ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,dt", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_backward(approximate, dtype, dt):
    x, g = _rand(0, 4, 32, dtype=dtype), _rand(1, 4, 32, dtype=dtype)
    fd, (out,) = _run(lambda fd, tg, tx: fd.ops.gelu_backward(tg, tx, approximate=approximate), [g, x])
    assert fd.fusion.tensor(fd.fusion.outputs[0]).dtype is dt
    torch.testing.assert_close(out, torch.ops.aten.gelu_backward(g, x, approximate=approximate), rtol=0, atol=0)
    xr = x.double().requires_grad_()
    F.gelu(xr, approximate=approximate).backward(g.double())
    _check(out, xr.grad.to(dtype), dtype)


def test_gelu_backward_broadcasts_and_promotes():
    g, x = _rand(1, 4, 1).bfloat16(), _rand(0, 4, 6)
    fd, (out,) = _run(lambda fd, tg, tx: fd.ops.gelu_backward(tg, tx), [g, x])
    assert out.shape == (4, 6) and out.dtype == torch.float32
    torch.testing.assert_close(out, torch.ops.aten.gelu_backward(g.float().expand(4, 6), x), rtol=0, atol=0)


# --- sharding rules ---------------------------------------------------------------------------


def _candidates(build, shapes, dtype=DataType.Float, n=2):
    """The sharding rule's candidates of the last op ``build`` records, on a mesh axis of ``n``."""
    with FusionDefinition() as fd:
        tvs = [fd.define_tensor(s, dtype=dtype) for s in shapes]
        build(fd, *tvs)
    op = fd.fusion.ops[-1]
    return {(c.inputs, c.outputs) for c in _ops.OPS[op.kind].rule(op, fd.fusion, n)}


def test_native_layer_norm_rule_shards_rows_only():
    cands = _candidates(lambda fd, x, w, b: fd.ops.native_layer_norm(x, [8], w, b), [[4, 6, 8], [8], [8]])
    R = REPLICATE
    assert cands == {((R, R, R), (R, R, R)),
                     ((Shard(0), R, R), (Shard(0),) * 3),
                     ((Shard(1), R, R), (Shard(1),) * 3)}


def test_native_layer_norm_backward_rule_sums_parameter_gradients_over_sharded_rows():
    def build(fd, g, x, w, b):
        _, mean, rstd = fd.ops.native_layer_norm(x, [8], w, b)
        fd.ops.native_layer_norm_backward(g, x, [8], mean, rstd, w, b)
    cands = _candidates(build, [[4, 6, 8], [4, 6, 8], [8], [8]])
    R, P = REPLICATE, PARTIAL_SUM
    assert cands == {((R,) * 6, (R, R, R)),
                     ((Shard(0),) * 4 + (R, R), (Shard(0), P, P)),  # rows sharded: grad_w, grad_b partial
                     ((Shard(1),) * 4 + (R, R), (Shard(1), P, P)),
                     ((P,) + (R,) * 5, (P, P, P))}  # linear in grad_y


def test_gelu_backward_rule_is_pointwise_and_linear_in_grad():
    cands = _candidates(lambda fd, g, x: fd.ops.gelu_backward(g, x, approximate="tanh"), [[4, 6], [4, 6]])
    R, P = REPLICATE, PARTIAL_SUM
    assert cands == {((R, R), (R,)), ((Shard(0), Shard(0)), (Shard(0),)), ((Shard(1), Shard(1)), (Shard(1),)),
                     ((P, R), (P,))}


# --- errors -----------------------------------------------------------------------------------


def _define(build, shapes, dtypes=None):
    dtypes = dtypes or [DataType.Float] * len(shapes)
    with FusionDefinition() as fd:
        build(fd, *[fd.define_tensor(s, dtype=dt) for s, dt in zip(shapes, dtypes)])


def test_native_layer_norm_errors():
    with pytest.raises(DefinitionError, match="must be the trailing extents"):
        _define(lambda fd, x: fd.ops.native_layer_norm(x, [6]), [[4, 8]])
    with pytest.raises(DefinitionError, match="weight and bias must have the normalized shape"):
        _define(lambda fd, x, w: fd.ops.native_layer_norm(x, [8], w), [[4, 8], [4]])
    with pytest.raises(DefinitionError, match="different dtypes"):  # (bf16 with float32 parameters is torch's)
        _define(lambda fd, x, w: fd.ops.native_layer_norm(x, [8], w), [[4, 8], [8]],
                [DataType.Float, DataType.BFloat16])
    with pytest.raises(DefinitionError, match="normalized_shape must be a list of ints"):
        _define(lambda fd, x: fd.ops.native_layer_norm(x, [8.0]), [[4, 8]])
    with pytest.raises(DefinitionError, match="expected a TensorView for weight"):
        _define(lambda fd, x: fd.ops.native_layer_norm(x, [8], torch.ones(8)), [[4, 8]])


def test_native_layer_norm_backward_errors():
    def backward(g_shape=(4, 8), mean_shape=(4, 1), stats=DataType.Float, x_dtype=DataType.Float, g_dtype=None):
        def build(fd, g, x, mean, rstd):
            fd.ops.native_layer_norm_backward(g, x, [8], mean, rstd)
        _define(build, [list(g_shape), [4, 8], list(mean_shape), list(mean_shape)],
                [g_dtype or x_dtype, x_dtype, stats, stats])
    backward()  # well formed
    backward(x_dtype=DataType.BFloat16)  # float32 statistics for bf16 x
    with pytest.raises(DefinitionError, match=r"mean must be f32\[4, 1\]"):
        backward(mean_shape=(4, 8))
    with pytest.raises(DefinitionError, match=r"mean must be f32\[4, 1\], as native_layer_norm returns it"):
        backward(x_dtype=DataType.BFloat16, stats=DataType.BFloat16)
    with pytest.raises(DefinitionError, match="grad_y .* must have the shape and dtype of x"):
        backward(g_shape=(4, 4))
    with pytest.raises(DefinitionError, match="grad_y .* must have the shape and dtype of x"):
        backward(g_dtype=DataType.Double)
    with pytest.raises(DefinitionError, match="expected a TensorView for mean"):
        _define(lambda fd, g, x: fd.ops.native_layer_norm_backward(g, x, [8], 0.0, x), [[4, 8], [4, 8]])


def test_gelu_backward_errors():
    with pytest.raises(DefinitionError, match="approximate must be 'none' or 'tanh'"):
        _define(lambda fd, g, x: fd.ops.gelu_backward(g, x, approximate="erf"), [[4], [4]])
    with pytest.raises(DefinitionError, match="expected a TensorView for x"):
        _define(lambda fd, g: fd.ops.gelu_backward(g, 1.0), [[4]])
    with pytest.raises(DefinitionError, match="do not broadcast"):
        _define(lambda fd, g, x: fd.ops.gelu_backward(g, x), [[4, 3], [4, 5]])
