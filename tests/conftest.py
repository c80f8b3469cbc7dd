"""Helpers the test files share (``from conftest import ...``).

Tests that run on several ranks take the ``multidevice_test`` fixture (``tp_fusion.testing``): per
world size, one set of spawned gloo ranks runs all of them; ``@pytest.mark.ranks(2, 4)`` picks the
world sizes. Spawn ranks yourself (``run_on_ranks``) only where the spawn itself is under test.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from tp_fusion import DataType, DeviceMesh, FusionDefinition, ParallelType

ROOT = Path(__file__).resolve().parents[1]


def shard(tv, mesh, dims: dict | None = None) -> None:
    """Put ``tv`` on ``mesh`` and shard logical dim d on ``dims[d]`` (outer split, then parallelize)."""
    tv.set_device_mesh(mesh)
    for d, ptype in sorted((dims or {}).items(), reverse=True):  # right to left: loop indices stay valid
        i = next(i for i, ax in enumerate(tv._loop()) if ax.dim == d and not ax.reduction)  # past r{} axes
        tv.outer_split(i, mesh.shape[ptype.mesh_axis(mesh.ndim)])
        tv.axis(i).parallelize(ptype)


def rand(seed: int, *shape, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Seeded normal values, the same on every rank."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def overlapped_fusion(d: int):
    """(fd, x's TensorView) for the asynchronous-collective tests: colsum = the sum over x's sharded
    rows (an allreduce whose result is an output only); tanh(a) * 2 (work that needs no collective);
    x gathered (an allgather of an input) for a matmul with it."""
    mesh = DeviceMesh(range(d))
    with FusionDefinition() as fd:
        x = fd.define_tensor([4 * d, 8], dtype=DataType.Double)
        a = fd.define_tensor([6, 8], dtype=DataType.Double)
        colsum = fd.ops.sum(x, [0])
        h = fd.ops.mul(fd.ops.tanh(a), 2.0)
        gathered = fd.ops.set(x)
        out = fd.ops.matmul(gathered, fd.ops.permute(h, [1, 0]))
        fd.add_output(colsum)
        fd.add_output(out)
    for tv in (x, a, colsum, h, gathered, out):
        tv.set_device_mesh(mesh)
    x.outer_split(0, d)
    x.axis(0).parallelize(ParallelType.mesh_x)
    return fd, x


def user_env() -> dict[str, str]:
    """The environment of a user's shell: not under torchrun, the checkout importable."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return env


def run_python(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python *args`` from the repository root, as a user would run it; output captured as text."""
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=user_env(), capture_output=True, text=True,
                          timeout=timeout)
