"""Which plans tuning may capture as a CUDA graph (``tuning._graphable``). The capture itself runs on
GPUs (tests/gpu); here the conditions that do not need one: a random draw whose seed the host picks
per call must stay eager, since a replay would repeat the draw."""

from __future__ import annotations

import pytest
import torch

from tp_fusion import DataType, FusionDefinition
from tp_fusion.runtime import graphs, tuning


def _dropout_like(seeded: bool):
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 8], dtype=DataType.Float)
        seed = {"rng_seed": 7, "rng_offset": 0} if seeded else {}
        fd.add_output(fd.ops.mul(x, fd.ops.rand_like(x, **seed)))
    return fd.compile([[4, 8]], device="cuda")


@pytest.fixture
def gpu_tuning(monkeypatch):
    """Tuning as it decides on a CUDA + NCCL job (its device and backend checks pass)."""
    monkeypatch.setattr(tuning, "_measures", lambda program: True)


def test_unseeded_draws_are_never_captured(gpu_tuning):
    assert tuning._graphable(_dropout_like(seeded=True))
    assert not tuning._graphable(_dropout_like(seeded=False))


def test_graphs_are_on_unless_turned_off(gpu_tuning, monkeypatch):
    assert graphs.enabled()
    monkeypatch.setenv("TP_FUSION_CUDA_GRAPHS", "0")
    assert not graphs.enabled() and not tuning._graphable(_dropout_like(seeded=True))


def test_draws_differ_per_call_without_a_seed():
    """The property the rule above protects, on the CPU."""
    with FusionDefinition() as f:
        x = f.define_tensor([4, 8], dtype=DataType.Float)
        f.add_output(f.ops.rand_like(x))
    a, b = f.execute([torch.ones(4, 8)])[0], f.execute([torch.ones(4, 8)])[0]
    assert not torch.equal(a, b)
