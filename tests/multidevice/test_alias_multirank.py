"""Outputs aliased to sharded inputs (each rank writes its shard of the output, in the input's sharding,
into its shard of the input) and ``fd.validate`` on several ranks, on spawned gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import rand, shard

from tp_fusion import DataType, DeviceMesh, FusionDefinition, InputError, ParallelType, ValidationError

X = ParallelType.mesh_x
F64 = DataType.Double


def _accumulate(n: int):
    """acc += x @ w.T with x and w sharded on the contraction: the pending sum is written into acc's row
    shards (a reduce-scatter), and returned plainly as well."""
    mesh = DeviceMesh(range(n))
    with FusionDefinition() as fd:
        x, w = fd.define_tensor([4 * n, 4 * n], dtype=F64), fd.define_tensor([6, 4 * n], dtype=F64)
        acc = fd.define_tensor([4 * n, 6], dtype=F64)
        new = fd.ops.add(acc, fd.ops.linear(x, w))
        fd.add_output(new, alias_input=acc)
        fd.add_output(new)
        shard(x, mesh, {1: X})
        shard(w, mesh, {1: X})
        shard(acc, mesh, {0: X})
    return fd, (x, w, acc)


def test_an_aliased_output_is_written_into_the_shards_of_its_input(multidevice_test):
    n = multidevice_test.size
    fd, tvs = _accumulate(n)
    full = [rand(1, 4 * n, 4 * n), rand(2, 6, 4 * n), rand(3, 4 * n, 6)]
    local = [multidevice_test.shard_tensor(t, tv) for t, tv in zip(full, tvs)]
    acc = local[2]
    (plain,) = fd.execute(local)
    want = full[2] + F.linear(full[0], full[1])
    torch.testing.assert_close(acc, multidevice_test.shard_tensor(want, tvs[2]))
    assert fd.output_shardings() == [tvs[2].sharding]
    assert plain is acc  # the plan gives the plain output acc's sharding: as in nvFuser, it is acc itself
    if n > 1:
        assert "reduce_scatter" in fd.plan.collectives()


def test_an_aliased_output_is_brought_to_its_inputs_sharding(multidevice_test):
    """The result is made sharded on columns (from a column-sharded operand); the input it is written
    into is replicated: it is gathered for the write."""
    n = multidevice_test.size
    mesh = DeviceMesh(range(n))
    with FusionDefinition() as fd:
        a, b = fd.define_tensor([4, 2 * n], dtype=F64), fd.define_tensor([4, 2 * n], dtype=F64)
        fd.add_output(fd.ops.mul(fd.ops.exp(b), 2.0), alias_input=a)
        fd.add_output(fd.ops.neg(b))
        a.set_device_mesh(mesh)
        shard(b, mesh, {1: X})
    full_a, full_b = rand(4, 4, 2 * n), rand(5, 4, 2 * n)
    x = full_a.clone()
    (neg,) = fd.execute([x, multidevice_test.shard_tensor(full_b, b)])
    torch.testing.assert_close(x, full_b.exp() * 2)
    torch.testing.assert_close(neg, multidevice_test.shard_tensor(-full_b, b))
    if n > 1:
        assert fd.plan.collectives() == ["allgather"]


def test_validate_compares_each_ranks_shard_with_the_global_references(multidevice_test):
    n = multidevice_test.size
    fd, tvs = _accumulate(n)
    full = [rand(1, 4 * n, 4 * n), rand(2, 6, 4 * n), rand(3, 4 * n, 6)]
    want = full[2] + F.linear(full[0], full[1])
    local = [multidevice_test.shard_tensor(t, tv) for t, tv in zip(full, tvs)]
    if n > 1:  # the ops cannot be evaluated on shards: references are needed, on every rank alike
        with pytest.raises(InputError, match="pass reference_outputs"):
            fd.validate(local)
    (plain,) = fd.validate(local, [want])
    torch.testing.assert_close(local[2], multidevice_test.shard_tensor(want, tvs[2]))
    with pytest.raises(ValidationError, match=r"output 0 \(T\d+ f64\[\d+, 6\]\): max abs difference 1"):
        fd.validate([multidevice_test.shard_tensor(t, tv) for t, tv in zip(full, tvs)], [want + 1])


def test_an_aliased_output_updates_a_dtensor_in_place(multidevice_test):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import tp_fusion

    n = multidevice_test.size
    with FusionDefinition() as fd:
        w, g = fd.define_tensor([2 * n, 3], dtype=F64), fd.define_tensor([2 * n, 3], dtype=F64)
        fd.add_output(fd.ops.sub(w, fd.ops.mul(g, 0.1)), alias_input=w)  # an SGD step
        fd.add_output(fd.ops.sum(g, [0, 1]))
    full_w, full_g = rand(6, 2 * n, 3), rand(7, 2 * n, 3)
    mesh = init_device_mesh("cpu", (n,))
    dw = distribute_tensor(full_w, mesh, [Shard(0)])
    (total,) = tp_fusion.execute_with_dtensors(fd, [dw, distribute_tensor(full_g, mesh, [Shard(0)])])
    torch.testing.assert_close(dw.full_tensor(), full_w - 0.1 * full_g)
    torch.testing.assert_close(total.full_tensor(), full_g.sum())
