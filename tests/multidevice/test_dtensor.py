"""execute_with_dtensors on gloo ranks: DTensor inputs annotate the fusion, outputs come back as DTensors."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard
from tp_fusion.sharding.sharding import Shard as TPShard

import tp_fusion
from tp_fusion import DataType, DeviceMesh, FusionDefinition, ParallelType, ShardingError
from tp_fusion.errors import UnevenShardError, UnsupportedPlacementError

T, H = 8, 4


def _mlp_fusion(t: int = T, h: int = H) -> FusionDefinition:
    """The MLP math only: no schedule (the DTensors annotate the inputs)."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([t, h])
        w1 = fd.define_tensor([4 * h, h])
        b1 = fd.define_tensor([4 * h])
        w2 = fd.define_tensor([h, 4 * h])
        b2 = fd.define_tensor([h])
        z = fd.ops.linear(fd.ops.gelu(fd.ops.linear(x, w1, b1), approximate="tanh"), w2, b2)
        fd.add_output(z)
    return fd


def _full_inputs(t: int = T, h: int = H) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g, dtype=torch.float32) for s in ([t, h], [4 * h, h], [4 * h], [h, 4 * h], [h])]


def _reference(x, w1, b1, w2, b2) -> torch.Tensor:
    return F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2, b2)


def _check_1d(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    full = _full_inputs()
    want = _reference(*full)
    # Megatron TP: replicated activations, column- then row-parallel weights.
    tp = [Replicate()], [Shard(0)], [Shard(0)], [Shard(1)], [Replicate()]
    fd = _mlp_fusion()
    dts = [distribute_tensor(t, mesh, p) for t, p in zip(full, tp)]
    (z,) = tp_fusion.execute_with_dtensors(fd, dts)
    assert isinstance(z, DTensor) and z.device_mesh is mesh
    assert tuple(z.placements) == (Replicate(),) and tuple(z.shape) == (T, H)
    assert fd.plan.collectives() == ["allreduce"]
    torch.testing.assert_close(z.full_tensor(), want)
    torch.testing.assert_close(z.to_local(), want)
    # The inputs are annotated now, as if scheduled by hand.
    w1 = fd.fusion.tensor(fd.fusion.inputs[1])
    assert w1.sharding.axis_sharded_on(ParallelType.mesh_x) == 0 and w1.sharding.mesh == DeviceMesh(range(world))

    # Same fd, new placements (sequence parallel): our own annotations are replaced.
    sp = [Shard(0)], [Shard(0)], [Shard(0)], [Shard(1)], [Replicate()]
    (z,) = tp_fusion.execute_with_dtensors(fd, [distribute_tensor(t, mesh, p) for t, p in zip(full, sp)])
    assert tuple(z.placements) == tuple(Shard(d) if d >= 0 else Replicate() for d in
                                        [fd.output_shardings()[0].axis_sharded_on(ParallelType.mesh_x)])
    assert "allgather" in fd.plan.collectives()
    torch.testing.assert_close(z.full_tensor(), want)

    # A plain tensor passes through as this rank's local input (here: a replicated bias).
    fd2 = _mlp_fusion()
    mixed = [distribute_tensor(t, mesh, p) for t, p in zip(full[:4], tp[:4])] + [full[4]]
    (z2,) = tp_fusion.execute_with_dtensors(fd2, mixed)
    torch.testing.assert_close(z2.full_tensor(), want)

    # DTensors handed to execute (not execute_with_dtensors) are a clear error, scheduled fusion or not
    # (before: a raw storage error, or an InputError about the wrong local extent).
    # Also where a plain tensor of the DTensor's global shape has a plan already (an unscheduled fusion
    # executed on whole tensors; before: a raw storage error).
    cached = _mlp_fusion()
    cached.execute(full)
    for fusion in (fd2, _mlp_fusion(), cached):
        with pytest.raises(tp_fusion.InputError, match=r"input T0 is a DTensor; .*execute_with_dtensors"):
            fusion.execute([distribute_tensor(t, mesh, p) for t, p in zip(full, tp)])

    # A hand-written schedule that disagrees with the DTensor is an error, not overwritten.
    fd3 = _mlp_fusion()
    w1_tv = tp_fusion.TensorView(fd3, fd3.fusion.inputs[1])
    w1_tv.set_device_mesh(DeviceMesh(range(world)))  # replicated, but the DTensor is Shard(0)
    with pytest.raises(ShardingError, match="scheduled as"):
        tp_fusion.execute_with_dtensors(fd3, [distribute_tensor(t, mesh, p) for t, p in zip(full, tp)])

    # Unsupported placements: the same clear error on every rank, nothing hangs.
    partial = [distribute_tensor(t, mesh, p) for t, p in zip(full, tp)]
    partial[0] = DTensor.from_local(full[0] / world, mesh, [Partial()], run_check=False)
    with pytest.raises(UnsupportedPlacementError, match=r"mesh axis 0 holds .*Partial.*redistribute"):
        tp_fusion.execute_with_dtensors(_mlp_fusion(), partial)
    odd = _full_inputs(t=T + 1)
    uneven = [distribute_tensor(t, mesh, p) for t, p in zip(odd, sp)]  # 9 tokens on 2 ranks
    with pytest.raises(UnevenShardError, match=r"dim 0 \(extent 9\) across 2 devices"):
        tp_fusion.execute_with_dtensors(_mlp_fusion(t=T + 1), uneven)
    assert isinstance(UnsupportedPlacementError("x"), NotImplementedError)
    # A mesh listing its ranks out of order: torch places shards by sorted rank, so no wrong data.
    from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh

    reversed_mesh = TorchDeviceMesh(mesh.device_type, list(range(world))[::-1])
    backwards = [distribute_tensor(t, reversed_mesh, p) for t, p in zip(full, tp)]
    with pytest.raises(UnsupportedPlacementError, match=r"mesh axis 0 out of increasing order"):
        tp_fusion.execute_with_dtensors(_mlp_fusion(), backwards)

    # A strided output (the inner piece of a split on mesh_x) comes back as DTensor's _StridedShard.
    with FusionDefinition() as fd4:
        a = fd4.define_tensor([T, H])
        out = fd4.ops.set(a)
        fd4.add_output(out)
        out.set_device_mesh(DeviceMesh(range(world)))
        out.inner_split(0, world)
        out.axis(1).parallelize(ParallelType.mesh_x)
    (s,) = tp_fusion.execute_with_dtensors(fd4, [distribute_tensor(full[0], mesh, [Replicate()])])
    assert tuple(s.placements) == (_StridedShard(0, split_factor=T // world),)
    torch.testing.assert_close(s.to_local(), full[0].reshape(T // world, world, H)[:, rank])
    torch.testing.assert_close(s.full_tensor(), full[0])
    # One DTensor alone is the list of it, as for fd.execute (before: its rows were taken as the inputs).
    (s1,) = tp_fusion.execute_with_dtensors(fd4, distribute_tensor(full[0], mesh, [Shard(0)]))
    torch.testing.assert_close(s1.full_tensor(), full[0])
    assert isinstance(UnevenShardError("x"), ValueError)
    with pytest.raises(tp_fusion.InputError, match="GLOBAL shape"):
        tp_fusion.execute_with_dtensors(_mlp_fusion(t=2 * T), [distribute_tensor(t, mesh, p)
                                                                for t, p in zip(full, tp)])


def _check_2d(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (2, world // 2))  # axis 0: data parallel (mesh_y), axis 1: TP (mesh_x)
    full = _full_inputs()
    dp_tp = ([Shard(0), Replicate()], [Replicate(), Shard(0)], [Replicate(), Shard(0)],
             [Replicate(), Shard(1)], [Replicate(), Replicate()])
    fd = _mlp_fusion()
    (z,) = tp_fusion.execute_with_dtensors(fd, [distribute_tensor(t, mesh, p) for t, p in zip(full, dp_tp)])
    assert tuple(z.placements) == (Shard(0), Replicate())
    assert fd.plan.collectives() == ["allreduce"]
    x = fd.fusion.tensor(fd.fusion.inputs[0])
    assert x.sharding.axis_sharded_on(ParallelType.mesh_y) == 0  # DTensor mesh dim 0 = mesh_y
    assert x.sharding.axis_sharded_on(ParallelType.mesh_x) == -1
    want = _reference(*full)
    torch.testing.assert_close(z.full_tensor(), want)
    torch.testing.assert_close(z.to_local(), want.chunk(2)[mesh.get_coordinate()[0]])

    # Two dims sharded on the two mesh axes; the output keeps the tokens sharded on mesh_y.
    both = ([Shard(0), Shard(1)], [Replicate(), Replicate()], [Replicate(), Replicate()],
            [Replicate(), Replicate()], [Replicate(), Replicate()])
    (z,) = tp_fusion.execute_with_dtensors(_mlp_fusion(), [distribute_tensor(t, mesh, p)
                                                            for t, p in zip(full, both)])
    assert not any(p.is_partial() for p in z.placements)
    torch.testing.assert_close(z.full_tensor(), want)

    # One dim on both mesh axes: DTensor's left-to-right Shard(0), Shard(0), and FSDP2+TP's strided
    # shard (mesh_x takes the outer piece, mesh_y the one inside it) are two device pieces of dim 0.
    for placements, outers in (([Shard(0), Shard(0)], (1, 2)), ([_StridedShard(0, split_factor=world // 2), Shard(0)],
                                                                (world // 2, 1))):
        nested = [distribute_tensor(t, mesh, p) for t, p in zip(full, dp_tp)]
        nested[0] = distribute_tensor(full[0], mesh, placements)
        fd2 = _mlp_fusion()
        (z,) = tp_fusion.execute_with_dtensors(fd2, nested)
        assert fd2.fusion.tensor(fd2.fusion.inputs[0]).sharding.placements == tuple(TPShard(0, o) for o in outers)
        torch.testing.assert_close(z.full_tensor(), want)


@pytest.mark.ranks(2)
def test_dtensor_1d_mesh(multidevice_test):
    _check_1d(multidevice_test.rank, multidevice_test.size)


@pytest.mark.ranks(4)
def test_dtensor_2d_mesh(multidevice_test):
    _check_2d(multidevice_test.rank, multidevice_test.size)


@pytest.mark.ranks(4)
def test_inputs_that_differ_between_ranks_name_both_meshes_alike(multidevice_test):
    """A DTensor on a submesh (mesh_2d["tp"]) is on another mesh on each row: every rank raises, printing
    its mesh and the other rank's as DeviceMeshes (the other's was a raw tuple "((2, 3), (2,))")."""
    rank = multidevice_test.rank
    mesh_2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with FusionDefinition() as fd:
        fd.add_output(fd.ops.relu(fd.define_tensor([4, 4])))
    mine, theirs, other = ("[0, 1]", "[2, 3]", 2) if rank < 2 else ("[2, 3]", "[0, 1]", 0)
    with pytest.raises(UnsupportedPlacementError, match=(
            rf"input 0 is a DTensor on mesh DeviceMesh\({re.escape(mine)}\) on rank {rank} but a DTensor on mesh "
            rf"DeviceMesh\({re.escape(theirs)}\) on rank {other}; a submesh such as mesh_2d\['tp'\] differs")):
        tp_fusion.execute_with_dtensors(fd, [distribute_tensor(torch.ones(4, 4), mesh_2d["tp"], [Replicate()])])
    # A DTensor on some ranks (made without communicating) and a plain tensor on another.
    whole, dtensor = init_device_mesh("cpu", (4,)), "a DTensor on mesh DeviceMesh([0, 1, 2, 3])"
    x = torch.ones(4, 4) if rank == 3 else DTensor.from_local(torch.ones(4, 4), whole, [Replicate()], run_check=False)
    mine, theirs, other = ("a plain tensor", dtensor, 0) if rank == 3 else (dtensor, "a plain tensor", 3)
    with pytest.raises(UnsupportedPlacementError, match=(
            rf"input 0 is {re.escape(mine)} on rank {rank} but {re.escape(theirs)} on rank {other}; pass a DTensor "
            r"for it on every rank or on none$")):
        tp_fusion.execute_with_dtensors(fd, [x])


def test_dtype_mismatch_names_the_input():
    with FusionDefinition() as fd:
        fd.add_output(fd.ops.neg(fd.define_tensor([2], dtype=DataType.Double)))
    with pytest.raises(tp_fusion.InputError, match="no input is a DTensor|dtype"):
        tp_fusion.execute_with_dtensors(fd, [torch.zeros(2)])
