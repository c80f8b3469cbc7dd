"""DTensor interop on NCCL and the --profile timeline with CUDA kernels, on 2 GPUs.

Run on a machine with at least 2 GPUs:  python -m pytest tests/gpu/test_ecosystem_gpu.py
(the tests start their own 2 ranks with torchrun; they skip without CUDA or with fewer than 2 GPUs).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                reason="needs 2 CUDA GPUs")


def _torchrun(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", *args]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc


def test_dtensor_on_nccl():
    proc = _torchrun(__file__)
    assert "dtensor nccl OK" in proc.stdout


def test_profile_shows_cuda_streams(tmp_path):
    from tp_fusion import profiling

    out = tmp_path / "prof"
    proc = _torchrun("examples/tp_mlp.py", "--mode", "sp", "--dtype", "bf16", "--tokens", "2048", "--hidden",
                     "1024", "--explain", "--profile", str(out))
    assert "Plan summary" in proc.stdout
    for r in range(2):
        events = json.loads((out / f"trace_rank{r}.json").read_text())["traceEvents"]
        assert any(e.get("cat") == "kernel" for e in events)
        bars = profiling.iteration_bars(out / f"trace_rank{r}.json", r)
        assert any(b.comm for b in bars) and any(not b.comm for b in bars)
        assert {b.row.split(" ", 2)[2] for b in bars} >= {"compute (main stream)"}
        assert all(b.row.split(" ", 2)[2].startswith(profiling.LANES) for b in bars)
        report = profiling.rank_report(out / f"trace_rank{r}.json", r)
        assert report.compute > 0 and report.comm > 0 and 0 <= report.overlap_efficiency <= 1
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (out / "timeline.png").stat().st_size > 0


def _dtensor_main() -> None:
    """Under torchrun: the TP MLP with DTensor weights on NCCL, against the full torch result."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import tp_fusion
    from tp_fusion import DataType, FusionDefinition
    from tp_fusion.launch import init_from_env
    from tp_fusion.runtime import dist

    device = init_from_env()
    try:
        world = dist.world_size()
        mesh = init_device_mesh("cuda", (world,))
        t, h = 256, 128
        g = torch.Generator(device).manual_seed(0)
        full = [(torch.randn(s, generator=g, device=device) * k).to(torch.bfloat16)
                for s, k in (([t, h], 1.0), ([4 * h, h], h ** -0.5), ([h, 4 * h], (4 * h) ** -0.5))]
        with FusionDefinition() as fd:
            x, w1, w2 = (fd.define_tensor(list(f.shape), dtype=DataType.BFloat16) for f in full)
            fd.add_output(fd.ops.linear(fd.ops.gelu(fd.ops.linear(x, w1), approximate="tanh"), w2))
        for placements in (([Replicate()], [Shard(0)], [Shard(1)]), ([Shard(0)], [Shard(0)], [Shard(1)])):
            dts = [distribute_tensor(f, mesh, p) for f, p in zip(full, placements)]
            (z,) = tp_fusion.execute_with_dtensors(fd, dts)
            want = F.linear(F.gelu(F.linear(full[0].float(), full[1].float()), approximate="tanh"),
                            full[2].float())
            torch.testing.assert_close(z.full_tensor().float(), want, atol=3e-2, rtol=3e-2)
            assert not any(p.is_partial() for p in z.placements)
        if dist.rank() == 0:
            print("dtensor nccl OK", fd.plan.collectives(), z.placements)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    _dtensor_main()
