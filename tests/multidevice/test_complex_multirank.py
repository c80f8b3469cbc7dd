"""Sharded complex tensors on spawned gloo ranks: they shard as any other, and the collectives carry them as
real views (``tp_fusion.runtime.dist._wire``), against torch computed on the full tensors."""

from __future__ import annotations

import pytest
import torch
from conftest import shard

from tp_fusion import DataType, DeviceMesh, FusionDefinition, ParallelType

X = ParallelType.mesh_x


def _crand(seed: int, *shape, dtype=torch.complex128) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


@pytest.mark.ranks(2)
@pytest.mark.parametrize("dt", [DataType.ComplexFloat, DataType.ComplexDouble])
def test_sharded_complex_pointwise_and_reduction_over_the_sharded_dim(multidevice_test, dt):
    """x [4n, 6] sharded on rows: y = exp(x) * (2 - 1j) + w stays sharded; its sum over the sharded rows is a
    pending sum, allreduced (replicated output) and reduce-scattered (output sharded on its columns); real and
    imag of y are gathered (replicated outputs)."""
    n = multidevice_test.size
    mesh = DeviceMesh(range(n))
    with FusionDefinition() as fd:
        x = fd.define_tensor([4 * n, 6], dtype=dt)
        w = fd.define_tensor([6], dtype=dt)
        y = fd.ops.add(fd.ops.mul(fd.ops.exp(x), 2 - 1j), w)
        total = fd.ops.sum(y, [0])
        scattered = fd.ops.sum(fd.ops.mul(y, y), [0])
        re, im = fd.ops.real(y), fd.ops.imag(y)
        for tv in (y, total, scattered, re, im):
            fd.add_output(tv)
        shard(x, mesh, {0: X})
        shard(y, mesh, {0: X})
        w.set_device_mesh(mesh)
        total.set_device_mesh(mesh)
        shard(scattered, mesh, {0: X})
        re.set_device_mesh(mesh)
        im.set_device_mesh(mesh)
    full_x, full_w = _crand(1, 4 * n, 6, dtype=dt.torch), _crand(2, 6, dtype=dt.torch)
    outs = fd.execute([multidevice_test.shard_tensor(full_x, x), multidevice_test.shard_tensor(full_w, w)])
    full_y = full_x.exp() * (2 - 1j) + full_w
    want = [full_y, full_y.sum(0), (full_y * full_y).sum(0), full_y.real, full_y.imag]
    for got, ref, tv in zip(outs, want, (y, total, scattered, re, im)):
        assert got.dtype == ref.dtype
        torch.testing.assert_close(got, multidevice_test.shard_tensor(ref, tv))
    assert outs[0].dtype == dt.torch and outs[3].dtype == (torch.float32 if dt == DataType.ComplexFloat
                                                            else torch.float64)
    collectives = fd.plan.collectives()
    assert "allreduce" in collectives and "reduce_scatter" in collectives and "allgather" in collectives, \
        str(fd.plan)


@pytest.mark.ranks(2)
def test_complex_tensors_move_between_meshes(multidevice_test):
    """gather (gloo has no complex gather: the real view travels), reduce and scatter of complex tensors."""
    n = multidevice_test.size
    mesh, one = DeviceMesh(range(n)), DeviceMesh([n - 1])
    dt = DataType.ComplexFloat
    with FusionDefinition() as gathering:
        x = gathering.define_tensor([2 * n, 3], dtype=dt)
        z = gathering.ops.set(x)
        gathering.add_output(z)
        shard(x, mesh, {0: X})
        shard(z, one)
    with FusionDefinition() as reducing:
        a = reducing.define_tensor([4 * n, 3], dtype=dt)
        s = reducing.ops.sum(a, [0])
        r = reducing.ops.set(s)
        reducing.add_output(r)
        shard(a, mesh, {0: X})
        s.set_device_mesh(mesh)
        s.outer_split(0, n)  # r{4n} (the loop's first axis) on mesh_x: a pending sum
        s.axis(0).parallelize(X)
        shard(r, one)
    with FusionDefinition() as scattering:
        b = scattering.define_tensor([3, 2 * n], dtype=dt)
        c = scattering.ops.set(b)
        scattering.add_output(c)
        shard(b, one)
        shard(c, mesh, {1: X})
    for fd, tv, out_tv, full, ref, collective in (
            (gathering, x, z, _crand(3, 2 * n, 3, dtype=dt.torch), lambda t: t, "gather"),
            (reducing, a, r, _crand(4, 4 * n, 3, dtype=dt.torch), lambda t: t.sum(0), "reduce"),
            (scattering, b, c, _crand(5, 3, 2 * n, dtype=dt.torch), lambda t: t, "scatter")):
        (got,) = fd.execute([multidevice_test.shard_tensor(full, tv)])
        torch.testing.assert_close(got, multidevice_test.shard_tensor(ref(full), out_tv))
        assert fd.plan.collectives() == [collective], str(fd.plan)


@pytest.mark.ranks(2)
def test_a_complex_prod_over_the_sharded_dim_gathers_it(multidevice_test):
    """The collectives combine complex values by sums only: a prod over a sharded dim gathers the dim (where a
    real prod would leave a pending product)."""
    n = multidevice_test.size
    mesh = DeviceMesh(range(n))
    with FusionDefinition() as fd:
        x = fd.define_tensor([4 * n, 3], dtype=DataType.ComplexDouble)
        p = fd.ops.prod(x, [0])
        fd.add_output(p)
        shard(x, mesh, {0: X})
        p.set_device_mesh(mesh)
    full = _crand(6, 4 * n, 3)
    (got,) = fd.execute([multidevice_test.shard_tensor(full, x)])
    torch.testing.assert_close(got, full.prod(0))
    assert fd.plan.collectives() == ["allgather"], str(fd.plan)
