"""The pattern for a test on every rank: the ``multidevice_test`` fixture from ``tp_fusion.testing``.

``python -m pytest tests/nvfuser/test_fixture_smoke.py`` runs it on spawned gloo ranks at world sizes
1, 2 and 4; ``torchrun --nproc_per_node=2 -m pytest tests/nvfuser/test_fixture_smoke.py`` on torchrun's.
"""

import pytest
import torch

import tp_fusion as nvfuser
from tp_fusion import DataType, FusionDefinition


@pytest.mark.mpi
def test_sizes_and_ranks(multidevice_test):
    assert 0 <= multidevice_test.rank < multidevice_test.size
    assert 0 <= multidevice_test.local_rank < multidevice_test.local_size


@pytest.mark.mpi
def test_pointwise_on_sharded_rows(multidevice_test):
    d = multidevice_test.size
    mesh = nvfuser.multidevice.DeviceMesh(torch.arange(d))
    with FusionDefinition() as fd:
        inp_tv = fd.define_tensor([-1, 4], dtype=DataType.Float)
        out_tv = fd.ops.add(fd.ops.relu(inp_tv), inp_tv)
        fd.add_output(out_tv)
        for tv in (inp_tv, out_tv):
            tv.set_device_mesh(mesh)
        for tv in (inp_tv, out_tv):
            tv.outer_split(0, d)
            tv.axis(0).parallelize(nvfuser.ParallelType.mesh_x)

    inp_ref = torch.randn(d * 2, 4)  # identical on every rank: the fixture seeds torch
    out_ref = inp_ref.relu() + inp_ref

    inp = multidevice_test.shard_tensor(inp_ref, inp_tv)
    (out,) = fd.execute([inp])
    torch.testing.assert_close(out.cpu(), multidevice_test.shard_tensor(out_ref, out_tv).cpu())
    assert fd.plan.collectives() == []


@pytest.mark.mpi
def test_needs_an_even_world(multidevice_test):
    if multidevice_test.size % 2:
        pytest.skip("needs an even number of ranks")
    mesh = nvfuser.multidevice.DeviceMesh(torch.arange(multidevice_test.size))
    full = torch.arange(multidevice_test.size * 3.0).reshape(-1, 3)
    shard = multidevice_test.shard_tensor_1d(full, 0, mesh)
    torch.testing.assert_close(shard.cpu(), full[multidevice_test.rank : multidevice_test.rank + 1])
    assert shard.device == torch.device(multidevice_test.device)  # on the rank's device (CUDA under NCCL)
