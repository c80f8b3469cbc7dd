"""``native_layer_norm`` and ``native_layer_norm_backward`` with their rows sharded, on gloo ranks.

Rows (the non-normalized dims) are free: y, mean, rstd and grad_x keep the row shard with no
communication. grad_weight and grad_bias are sums over the rows, so each rank holds a partial sum,
summed by one allreduce each for the replicated outputs. Checked against torch's autograd of
``F.layer_norm`` on the full tensors.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import shard
from tp_fusion.sharding.sharding import PARTIAL_SUM, REPLICATE, Shard

from tp_fusion import DataType, DeviceMesh, FusionDefinition, ParallelType

X = ParallelType.mesh_x
T, S, H = 4, 6, 8  # rows [T, S], normalized [H]
EPS = 1e-5


def _layer_norm_fusion(mesh: DeviceMesh, row_dim: int):
    """Forward and backward of a layer norm over [T, S, H] in one fusion: inputs x, w, b, grad_y (x and
    grad_y sharded on ``row_dim``, w and b replicated); outputs y, mean, rstd, grad_x, grad_w, grad_b."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([T, S, H], dtype=DataType.Double)
        w, b = fd.define_tensor([H], dtype=DataType.Double), fd.define_tensor([H], dtype=DataType.Double)
        g = fd.define_tensor([T, S, H], dtype=DataType.Double)
        y, mean, rstd = fd.ops.native_layer_norm(x, [H], w, b, eps=EPS)
        gx, gw, gb = fd.ops.native_layer_norm_backward(g, x, [H], mean, rstd, w, b)
        for tv in (y, mean, rstd, gx, gw, gb):
            fd.add_output(tv)
        for tv in (x, g):
            shard(tv, mesh, {row_dim: X})
        for tv in (w, b, gw, gb):
            shard(tv, mesh)
    return fd, (x, w, b, g)


def _reference(full):
    x, w, b, g = (t.clone().requires_grad_(i < 3) for i, t in enumerate(full))
    y = F.layer_norm(x, [H], w, b, EPS)
    y.backward(g)
    var, mean = torch.var_mean(full[0], -1, correction=0, keepdim=True)
    return y.detach(), mean, torch.rsqrt(var + EPS), x.grad, w.grad, b.grad


@pytest.mark.ranks(2, 4)
@pytest.mark.parametrize("row_dim", [0, 1])
def test_sharded_rows_layer_norm_backward(multidevice_test, row_dim):
    d = multidevice_test.size
    if (T, S)[row_dim] % d:
        pytest.skip(f"{(T, S)[row_dim]} rows do not split over {d} ranks")
    mesh = DeviceMesh(range(d))
    fd, tvs = _layer_norm_fusion(mesh, row_dim)
    full = [torch.randn(tv.shape, dtype=torch.float64) for tv in tvs]
    outs = fd.execute([multidevice_test.shard_tensor(t, tv) for t, tv in zip(full, tvs)])
    want = _reference(full)

    plan = fd.plan
    # The backward's parameter gradients come out partial (a sum per rank over its rows) ...
    (op,) = [op for op in plan.fusion.ops if op.kind == "native_layer_norm_backward"]
    placements = [plan.fusion.tensor(o).sharding.placements[0] for o in op.outputs]
    assert placements == [Shard(row_dim), PARTIAL_SUM, PARTIAL_SUM], str(plan)
    # ... and one allreduce each sums them; y, mean, rstd and grad_x need no communication.
    assert plan.collectives() == ["allreduce", "allreduce"], str(plan)
    for got, w, s in zip(outs, want, fd.output_shardings()):
        torch.testing.assert_close(got, multidevice_test.shard_tensor(w, s), rtol=1e-10, atol=1e-10)
    assert [s.placements[0] for s in fd.output_shardings()] == [Shard(row_dim)] * 4 + [REPLICATE] * 2


@pytest.mark.ranks(2, 4)
@pytest.mark.parametrize("dtype", [DataType.Double, DataType.BFloat16])
def test_sharded_normalized_dim_runs_as_its_parts(multidevice_test, dtype):
    """x and grad_y sharded on the normalized dim (a full-width QK-norm after a column-parallel linear): both ops
    run as their parts, so each row's mean and sum of squares (forward) and the two row means of the backward
    are allreduced, [T, S] values each, where the ops whole gathered x and grad_y [T, S, H]. bf16 is computed in
    float32, as aten does."""
    d = multidevice_test.size
    mesh = DeviceMesh(range(d))
    with FusionDefinition() as fd:
        x, g = fd.define_tensor([T, S, H], dtype=dtype), fd.define_tensor([T, S, H], dtype=dtype)
        w, b = fd.define_tensor([H], dtype=dtype), fd.define_tensor([H], dtype=dtype)
        y, mean, rstd = fd.ops.native_layer_norm(x, [H], w, b, eps=EPS)
        for tv in (y, *fd.ops.native_layer_norm_backward(g, x, [H], mean, rstd, w, b)):
            fd.add_output(tv)
        for tv in (x, g, w, b):
            shard(tv, mesh, {tv.ndim - 1: X})
    full = [torch.randn(tv.shape, dtype=torch.float64).to(dtype.torch) for tv in (x, g, w, b)]
    outs = fd.execute([multidevice_test.shard_tensor(t, tv) for t, tv in zip(full, (x, g, w, b))])
    xr, wr, br = (full[i].double().requires_grad_() for i in (0, 2, 3))
    yr = F.layer_norm(xr, [H], wr, br, EPS)
    yr.backward(full[1].double())
    tol = 1e-10 if dtype is DataType.Double else 2e-2
    for got, want, s in zip(outs, (yr, xr.grad, wr.grad, br.grad), fd.output_shardings()):
        want = multidevice_test.shard_tensor(want.detach().to(dtype.torch), s)
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    assert "allgather" not in fd.plan.collectives() and fd.plan.collectives().count("allreduce") >= 4, str(fd.plan)
