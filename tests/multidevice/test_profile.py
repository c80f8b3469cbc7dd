"""examples/tp_mlp.py --profile DIR on 2 CPU ranks: a Chrome trace per rank and a timeline PNG."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

from tp_fusion import profiling

ROOT = Path(__file__).resolve().parents[2]


def test_profile_writes_traces_and_timeline(tmp_path):
    out = tmp_path / "prof"
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "tp_mlp.py"), "--mode", "sp", "--explain",
                           "--profile", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Plan summary" in proc.stdout and "allgather (mesh_x, n=2)" in proc.stdout
    assert "rank 0 by kernel:" in proc.stdout and "exposed comm ms" in proc.stdout  # profiling.describe
    for r in range(2):
        trace = json.loads((out / f"trace_rank{r}.json").read_text())
        names = {e.get("name") for e in trace["traceEvents"]}
        assert profiling.ITERATION in names
        bars = profiling.iteration_bars(out / f"trace_rank{r}.json", r)
        assert any(b.comm for b in bars) and any(not b.comm for b in bars)
        assert all(b.row.startswith(f"rank {r} ") for b in bars)
    if importlib.util.find_spec("matplotlib") is not None:
        png = out / "timeline.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"wrote {png}" in proc.stdout
    else:
        assert "needs matplotlib" in proc.stderr


def test_communication_names():
    for name in ("gloo:send", "c10d::allreduce_", "ncclDevKernel_AllGather_RING_LL", "Memcpy PtoP (Device -> Device)",
                 "record_param_comms", "gloo:all_reduce"):
        assert profiling.is_communication(name), name
    for name in ("aten::addmm", "aten::broadcast_to", "aten::gelu", "sm90_xmma_gemm_bf16bf16", "aten::copy_"):
        assert not profiling.is_communication(name), name


def test_kernel_table_groups_by_name_longest_first():
    bars = [profiling.Bar("rank 0 segments", 0.0, 3.0, "tp_fusion::allgather_linear[fused]", False),
            profiling.Bar("rank 0 compute (main stream)", 0.0, 1.0, "gemm", False),
            profiling.Bar("rank 0 compute (main stream)", 1.0, 1.0, "gemm", False),
            profiling.Bar("rank 0 compute (main stream)", 2.0, 0.5, "add", False),
            profiling.Bar("rank 0 copy engine", 0.5, 0.25, "Memcpy DtoD", True)]
    rows = profiling.kernel_table(bars, top=2).splitlines()
    assert rows[1].split()[:4] == ["2", "2.000", "80.0%", "compute"] and rows[1].endswith("gemm")
    assert rows[2].split()[:3] == ["1", "0.500", "20.0%"] and rows[2].endswith("add")
    assert rows[3].split()[:3] == ["1", "0.250", "10.0%"] and rows[3].endswith("(1 other kernels)")
    assert len(rows) == 4  # the segment labels are no kernels
