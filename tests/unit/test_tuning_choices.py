"""Choices tuning makes without timing them here (the timings run on GPUs: tests/gpu, benchmarks):
which plans may be captured as a CUDA graph (``tuning._graphable``: a random draw stays eager, since a
replay would repeat an unseeded draw and a seeded one's generator cannot be captured), and how measured GEMM+GELU
timings become a choice (the GELU leaves the GEMM's epilogue only when clearly faster)."""

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


def _plain():
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 8], dtype=DataType.Float)
        fd.add_output(fd.ops.mul(x, x))
    return fd.compile([[4, 8]], device="cuda")


def test_random_draws_are_never_captured(gpu_tuning):
    assert tuning._graphable(_plain())
    assert not tuning._graphable(_dropout_like(seeded=False))  # a replay would repeat the host's seed
    assert not tuning._graphable(_dropout_like(seeded=True))  # its generator is not the graph's


def test_graphs_are_on_unless_turned_off(gpu_tuning, monkeypatch):
    assert graphs.enabled()
    monkeypatch.setenv("TP_FUSION_CUDA_GRAPHS", "0")
    assert not graphs.enabled() and not tuning._graphable(_plain())


def test_draws_differ_per_call_without_a_seed():
    """The property the rule above protects, on the CPU."""
    with FusionDefinition() as f:
        x = f.define_tensor([4, 8], dtype=DataType.Float)
        f.add_output(f.ops.rand_like(x))
    a, b = f.execute([torch.ones(4, 8)])[0], f.execute([torch.ones(4, 8)])[0]
    assert not torch.equal(a, b)


def _mlp_program():
    with FusionDefinition() as fd:
        x, w1, b1, w2 = (fd.define_tensor(s) for s in ([4, 8], [16, 8], [16], [8, 16]))
        fd.add_output(fd.ops.linear(fd.ops.gelu(fd.ops.linear(x, w1, b1), approximate="tanh"), w2))
    return fd.compile([[4, 8], [16, 8], [16], [8, 16]])


@pytest.mark.parametrize("apart_ms, leaves", [(0.99, False), (0.97, True)])
def test_gelu_leaves_the_epilogue_only_when_clearly_faster(gpu_tuning, monkeypatch, apart_ms, leaves):
    monkeypatch.setattr(tuning, "_fastest", lambda runs, env, pg, device: {True: 1.0, False: apart_ms})
    monkeypatch.setattr(tuning, "_random_env", lambda program, *names: {})
    program = _mlp_program()
    apart, notes = tuning._choose_gelus(program)
    (gelu,) = [op.outputs[0] for op in program.fusion.ops if op.kind == "gelu"]
    assert apart == ({gelu} if leaves else set())
    assert notes == [f"segment 0 linear+gelu: GELU in the GEMM's epilogue 1.000 ms, apart {apart_ms:.3f} ms -> "
                     f"{'apart' if leaves else 'in the epilogue'}"]
