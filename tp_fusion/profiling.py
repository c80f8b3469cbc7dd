"""Profile a few iterations with torch.profiler and draw one iteration as a per-rank timeline.

``profile_iterations(step, trace_path)`` runs ``step()`` a few times under ``torch.profiler`` (each
iteration wrapped in a ``record_function(ITERATION)`` marker, CUDA synchronized inside it) and
writes a Chrome trace (open it in ``chrome://tracing`` or https://ui.perfetto.dev).
``plot_timeline(traces, png)`` reads one trace per rank and draws the LAST marked iteration of each
as horizontal bars: one row per (rank, thread or CUDA stream, compute|communication), so overlap
of communication with compute shows as bars stacked at the same time. Each rank's time axis starts
at its own iteration marker (clocks of different hosts need not agree).

When a trace holds GPU events (kernels, memcpy, memset), only those are drawn for that rank (the
CPU rows would show launches, not work); otherwise the CPU threads are. An event counts as
communication when its name matches ``COMM_PATTERN`` (NCCL and gloo kernels and calls, c10d ops,
peer-to-peer copies, symmetric-memory ops); everything else is compute.

matplotlib is imported only by ``plot_timeline``; install it with ``pip install -e ".[plot]"``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

ITERATION = "tp_fusion_iteration"
COMM_PATTERN = re.compile(
    r"nccl|gloo|c10d|record_param_comms|all_?gather|reduce_?scatter|all_?reduce|all_?to_?all|broadcast"
    r"|\bsend\b|\brecv\b|isend|irecv|ptop|p2p|symm_mem|cross_device|multimem", re.IGNORECASE)
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
SKIP_CATEGORIES = ("Trace", "python_function", "cuda_runtime", "cuda_driver", "ac2g", "overhead",
                   "gpu_user_annotation")


def profile_iterations(step: Callable[[], object], trace_path: str | Path, iterations: int = 3,
                       warmup: int = 1) -> Path:
    """Run ``step`` ``warmup`` times, then ``iterations`` times under torch.profiler; write the
    Chrome trace to ``trace_path`` (its folder is created) and return the path."""
    from torch.profiler import ProfilerActivity, profile, record_function

    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    for _ in range(warmup):
        step()
    if cuda:
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(iterations):
            with record_function(ITERATION):
                step()
                if cuda:
                    torch.cuda.synchronize()
    path = Path(trace_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
    return path


@dataclass(frozen=True)
class Bar:
    row: str  # e.g. "rank 0 stream 7 comm"
    start_ms: float  # from the start of the iteration
    duration_ms: float
    name: str
    comm: bool


def is_communication(name: str) -> bool:
    """aten ops are compute (``aten::broadcast_to`` is no broadcast); the rest by ``COMM_PATTERN``."""
    return not name.startswith("aten::") and COMM_PATTERN.search(name) is not None


def iteration_bars(trace_path: str | Path, rank: int) -> list[Bar]:
    """The events of the last marked iteration of one rank's trace, as bars (ms from its start)."""
    events = json.loads(Path(trace_path).read_text())["traceEvents"]
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    # The CPU-side marker (kineto also copies it onto the GPU stream as a gpu_user_annotation that
    # spans only the kernels); the CUDA synchronize inside it keeps the iteration's kernels within it.
    marks = [e for e in spans if e.get("name") == ITERATION and e.get("cat") != "gpu_user_annotation"]
    if marks:
        mark = max(marks, key=lambda e: float(e["ts"]))
        t0, t1 = float(mark["ts"]), float(mark["ts"]) + float(mark["dur"])
    else:  # no marker: the whole trace
        t0 = min((float(e["ts"]) for e in spans), default=0.0)
        t1 = max((float(e["ts"]) + float(e["dur"]) for e in spans), default=0.0)
    gpu = any(e.get("cat") in GPU_CATEGORIES for e in spans)
    main_tid = marks[-1].get("tid") if marks else None
    bars = []
    for e in spans:
        cat, name = e.get("cat", ""), str(e.get("name", ""))
        if name == ITERATION or name.startswith("ProfilerStep") or cat in SKIP_CATEGORIES:
            continue
        if gpu and cat not in GPU_CATEGORIES:
            continue
        ts, dur = float(e["ts"]), float(e["dur"])
        if ts + dur < t0 or ts > t1:
            continue
        comm = is_communication(name)
        tid = e.get("tid")
        lane = f"stream {tid}" if gpu else "main thread" if tid == main_tid else f"thread {tid}"
        row = f"rank {rank} {lane} {'comm' if comm else 'compute'}"
        bars.append(Bar(row, (ts - t0) / 1000.0, dur / 1000.0, name, comm))
    return bars


def plot_timeline(trace_paths: Sequence[str | Path], png_path: str | Path, title: str | None = None) -> Path:
    """Draw the last marked iteration of each rank's trace (``trace_paths[r]`` is rank ``r``) as a
    timeline PNG; returns its path. Raises ImportError with an install hint without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as e:
        raise ImportError("plot_timeline needs matplotlib: pip install matplotlib "
                          "(or pip install -e \".[plot]\" in a tp_fusion checkout)") from e

    bars = [b for r, p in enumerate(trace_paths) for b in iteration_bars(p, r)]
    rows: list[str] = []
    for b in sorted(bars, key=lambda b: (int(b.row.split()[1]), b.row)):
        if b.row not in rows:
            rows.append(b.row)
    colors = {False: "#4C72B0", True: "#DD8452"}
    fig, ax = plt.subplots(figsize=(12, 1.0 + 0.45 * max(len(rows), 1)))
    for i, row in enumerate(rows):
        mine = [b for b in bars if b.row == row]
        ax.broken_barh([(b.start_ms, max(b.duration_ms, 1e-4)) for b in mine], (i - 0.4, 0.8),
                       facecolors=[colors[b.comm] for b in mine], alpha=0.85, linewidth=0)
    ax.set_yticks(range(len(rows)), rows)
    ax.invert_yaxis()
    ax.set_xlabel("ms from the start of the iteration (each rank on its own clock)")
    ax.set_title(title or "one iteration per rank: compute and communication", loc="left")
    ax.legend(handles=[Patch(color=colors[False], label="compute"), Patch(color=colors[True], label="communication")],
              loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=2, fontsize=8, frameon=False)
    ax.set_xlim(left=0)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    path = Path(png_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
