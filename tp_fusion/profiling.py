"""Profile a few iterations, measure where the time goes, and draw one iteration per rank.

``profile_iterations(step, trace_path)`` runs ``step()`` a few times under ``torch.profiler`` (each
iteration wrapped in a ``record_function(ITERATION)`` marker, CUDA synchronized inside it) and
writes a Chrome trace (open it in ``chrome://tracing`` or https://ui.perfetto.dev).

``rank_report(trace, rank)`` reads the LAST marked iteration of one rank's trace and measures, on
the GPU when the trace has GPU events (else on the CPU threads): the busy time of compute and of
communication (unions of their intervals), the *exposed* communication (communication while no
compute runs), the overlap efficiency (the share of communication hidden under compute), and the
gaps on the compute streams (no compute kernel running on any of them). ``format_report`` prints those
per rank.

``kernel_table(bars)`` lists the iteration's GPU work by kernel (count, total time, share), the
longest first; ``describe(traces)`` gives the per-rank report and rank 0's kernel table together.

``plot_timeline(traces, png)`` draws the same iteration per rank as horizontal bars, one row per
lane named by what it carries: the segments (``record_function`` labels such as
``tp_fusion::allgather_linear[fused]``), the main and second compute streams, NCCL, and the copy
engine (a stream that runs copies and no kernels: symmetric-memory pushes). Each rank's time axis
starts at its own iteration marker (clocks of different hosts need not agree).

An event is communication when its name matches ``COMM_PATTERN`` (NCCL and gloo kernels and calls,
c10d ops, peer-to-peer copies, symmetric-memory ops) or when it is a copy on a copy-only stream;
everything else is compute. matplotlib is imported only by ``plot_timeline``.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

ITERATION = "tp_fusion_iteration"
COMM_PATTERN = re.compile(
    r"nccl|gloo|c10d|record_param_comms|all_?gather|reduce_?scatter|all_?reduce|all_?to_?all|broadcast"
    r"|\bsend\b|\brecv\b|isend|irecv|ptop|p2p|symm_mem|cross_device|multimem", re.IGNORECASE)
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
SEGMENT_CATEGORIES = ("gpu_user_annotation", "user_annotation")
SKIP_CATEGORIES = ("Trace", "python_function", "cuda_runtime", "cuda_driver", "ac2g", "overhead")
LANES = ("segments", "compute (main stream)", "compute (second stream)", "NCCL", "copy engine",
         "main thread", "worker thread")


def profile_iterations(step: Callable[[], object], trace_path: str | Path, iterations: int = 3,
                       warmup: int = 1, before_each: Callable[[], object] | None = None) -> Path:
    """Run ``step`` ``warmup`` times, then ``iterations`` times under torch.profiler; write the
    Chrome trace to ``trace_path`` (its folder is created) and return the path. ``before_each`` runs
    before every marked iteration, outside it (e.g. a barrier, so that ranks start together)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    for _ in range(warmup):
        step()
    if cuda:
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(iterations):
            if before_each is not None:
                before_each()
                if cuda:
                    torch.cuda.synchronize()
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
    row: str  # "rank 0 compute (main stream)": the rank, then the lane (one of LANES, maybe numbered)
    start_ms: float  # from the start of the iteration
    duration_ms: float
    name: str
    comm: bool

    @property
    def end_ms(self) -> float:
        return self.start_ms + self.duration_ms


def is_communication(name: str) -> bool:
    """aten ops are compute (``aten::broadcast_to`` is no broadcast); the rest by ``COMM_PATTERN``."""
    return not name.startswith("aten::") and COMM_PATTERN.search(name) is not None


def _is_segment(e: dict) -> bool:
    return e.get("cat") in SEGMENT_CATEGORIES and str(e.get("name", "")).startswith("tp_fusion::")


def iteration_bars(trace_path: str | Path, rank: int) -> list[Bar]:
    """The events of the last marked iteration of one rank's trace, as bars (ms from its start), in
    rows named by lane: ``segments`` (tp_fusion's ``record_function`` labels), then for a GPU trace
    the streams by role, for a CPU trace the threads."""
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
    inside = [e for e in spans if float(e["ts"]) + float(e["dur"]) >= t0 and float(e["ts"]) <= t1]
    gpu = any(e.get("cat") in GPU_CATEGORIES for e in inside)
    segment_cat = "gpu_user_annotation" if gpu else "user_annotation"
    bars = _merged_segments([e for e in inside if _is_segment(e) and e.get("cat") == segment_cat], t0, rank)
    work = [e for e in inside if (e.get("cat") in GPU_CATEGORIES if gpu else
                                  e.get("cat") not in SKIP_CATEGORIES + SEGMENT_CATEGORIES
                                  and e.get("name") != ITERATION and not str(e.get("name")).startswith("ProfilerStep"))]
    lanes = _gpu_lanes(work) if gpu else _cpu_lanes(work, marks[-1].get("tid") if marks else None)
    for e in work:
        name = str(e.get("name", ""))
        lane = lanes[e.get("tid")]
        comm = is_communication(name) or lane == "copy engine"
        bars.append(Bar(f"rank {rank} {lane}", (float(e["ts"]) - t0) / 1e3, float(e["dur"]) / 1e3, name, comm))
    return bars


def _merged_segments(events: list[dict], t0: float, rank: int) -> list[Bar]:
    """One bar per segment: kineto copies a label onto every stream it launched on; overlapping copies
    of one label merge."""
    bars: list[Bar] = []
    for e in sorted(events, key=lambda e: float(e["ts"])):
        start, end, name = (float(e["ts"]) - t0) / 1e3, (float(e["ts"]) + float(e["dur"]) - t0) / 1e3, str(e["name"])
        same = next((i for i in range(len(bars) - 1, -1, -1) if bars[i].name == name), None)
        if same is not None and start <= bars[same].end_ms:
            b = bars[same]
            bars[same] = Bar(b.row, b.start_ms, max(b.end_ms, end) - b.start_ms, name, False)
        else:
            bars.append(Bar(f"rank {rank} segments", start, end - start, name, False))
    return bars


def _gpu_lanes(events: list[dict]) -> dict:
    """Stream id -> lane: NCCL (only NCCL kernels), copy engine (copies and no kernels), else compute;
    the compute stream with the most kernel time is the main one."""
    kernel_ms, nccl_only, copies_only = defaultdict(float), {}, {}
    for e in events:
        tid, name, kernel = e.get("tid"), str(e.get("name", "")), e.get("cat") == "kernel"
        if kernel:
            kernel_ms[tid] += float(e["dur"])
        nccl_only[tid] = nccl_only.get(tid, True) and kernel and is_communication(name)
        copies_only[tid] = copies_only.get(tid, True) and not kernel
    lanes = {tid: "NCCL" for tid, only in nccl_only.items() if only}
    lanes.update({tid: "copy engine" for tid, only in copies_only.items() if only})
    compute = sorted((t for t in nccl_only if t not in lanes), key=lambda t: -kernel_ms[t])
    for i, tid in enumerate(compute):
        lanes[tid] = "compute (main stream)" if i == 0 else "compute (second stream)" + (f" {i}" if i > 1 else "")
    return _number_duplicates(lanes)


def _cpu_lanes(events: list[dict], main_tid) -> dict:
    lanes = {e.get("tid"): "main thread" if e.get("tid") == main_tid else "worker thread" for e in events}
    return _number_duplicates(lanes)


def _number_duplicates(lanes: dict) -> dict:
    """Two streams of one role become "NCCL" and "NCCL 2", in order of their ids."""
    seen: dict[str, int] = defaultdict(int)
    out = {}
    for tid in sorted(lanes, key=str):
        seen[lanes[tid]] += 1
        out[tid] = lanes[tid] + (f" {seen[lanes[tid]]}" if seen[lanes[tid]] > 1 else "")
    return out


# --------------------------------------------------------------------------------------------------
# Where the time goes
# --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RankReport:
    """One rank's iteration (ms): ``span`` from its first to its last GPU (or CPU) event; ``compute``
    and ``comm`` the time when any compute (communication) runs; ``exposed_comm`` the time when
    communication runs and no compute; ``gaps`` the intervals (start, length) within the span when no
    compute runs on any compute stream (idle, or waiting on communication), longest first."""

    rank: int
    span: float
    compute: float
    comm: float
    exposed_comm: float
    gaps: tuple[tuple[float, float], ...]

    @property
    def overlap_efficiency(self) -> float:
        """The share of communication time hidden under compute (1 when there is no communication)."""
        return 1.0 - self.exposed_comm / self.comm if self.comm > 0 else 1.0

    @property
    def idle(self) -> float:
        return sum(length for _, length in self.gaps)


def _union(intervals) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _length(intervals) -> float:
    return sum(b - a for a, b in intervals)


def _minus(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The parts of the (merged) intervals ``a`` outside the (merged) intervals ``b``."""
    out, j = [], 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k, cur = j, start
        while k < len(b) and b[k][0] < end:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < end:
            out.append((cur, end))
    return out


def report_from_bars(bars: Sequence[Bar], rank: int, min_gap_ms: float = 0.002) -> RankReport:
    """The ``RankReport`` of one rank's bars (``iteration_bars``); gaps shorter than ``min_gap_ms`` are
    launch jitter and not counted."""
    work = [b for b in bars if not b.row.endswith(" segments")]
    if not work:
        return RankReport(rank, 0.0, 0.0, 0.0, 0.0, ())
    compute = _union((b.start_ms, b.end_ms) for b in work if not b.comm)
    comm = _union((b.start_ms, b.end_ms) for b in work if b.comm)
    span = max(b.end_ms for b in work) - min(b.start_ms for b in work)
    first, last = min(b.start_ms for b in work), max(b.end_ms for b in work)
    holes = _minus([(first, last)], compute)
    gaps = tuple(sorted(((a, b - a) for a, b in holes if b - a >= min_gap_ms), key=lambda g: -g[1]))
    return RankReport(rank, span, _length(compute), _length(comm), _length(_minus(comm, compute)), gaps)


def rank_report(trace_path: str | Path, rank: int, min_gap_ms: float = 0.002) -> RankReport:
    """The ``RankReport`` of the last marked iteration of one rank's trace."""
    return report_from_bars(iteration_bars(trace_path, rank), rank, min_gap_ms)


def format_report(reports: Sequence[RankReport], top_gaps: int = 3) -> str:
    """One line per rank: span, compute, communication, exposed communication, overlap efficiency,
    compute gaps (count, total, the longest with their start)."""
    lines = ["rank  span ms  compute ms  comm ms  exposed comm ms  overlap eff.  gaps with no compute running"]
    for r in reports:
        longest = ", ".join(f"{length:.3f} at {start:.3f}" for start, length in r.gaps[:top_gaps])
        lines.append(f"{r.rank:>4} {r.span:8.3f} {r.compute:11.3f} {r.comm:8.3f} {r.exposed_comm:16.3f} "
                     f"{r.overlap_efficiency:12.1%}  {len(r.gaps)} gaps, {r.idle:.3f} ms"
                     + (f" (longest: {longest})" if longest else ""))
    return "\n".join(lines)


def kernel_table(bars: Sequence[Bar], top: int = 12) -> str:
    """The GPU work of one rank's iteration (``iteration_bars``) grouped by kernel name, longest total
    first: count, total ms, share of the span, and its lane; the rest summed on one line. It says
    which kernels a gap over the best compute is made of (an extra pass, a slow GEMM, a copy)."""
    work = [b for b in bars if not b.row.endswith(" segments")]
    if not work:
        return "(no GPU work in the iteration)"
    span = max(b.end_ms for b in work) - min(b.start_ms for b in work)
    groups: dict[str, list[Bar]] = defaultdict(list)
    for b in work:
        groups[b.name].append(b)
    ranked = sorted(groups.items(), key=lambda kv: -sum(b.duration_ms for b in kv[1]))
    lines = ["   count  total ms  share  lane                      kernel"]
    for name, group in ranked[:top]:
        total = sum(b.duration_ms for b in group)
        lane = group[0].row.split(" ", 2)[2]
        lines.append(f"{len(group):8d} {total:9.3f} {total / span:6.1%}  {lane:25.25s} {name[:90]}")
    rest = [b for _, group in ranked[top:] for b in group]
    if rest:
        total = sum(b.duration_ms for b in rest)
        lines.append(f"{len(rest):8d} {total:9.3f} {total / span:6.1%}  {'':25s} ({len(ranked) - top} other kernels)")
    return "\n".join(lines)


def describe(trace_paths: Sequence[str | Path], top: int = 16) -> str:
    """Where one profiled iteration's time goes, from every rank's trace (``trace_paths[r]`` is rank
    ``r``): the per-rank report (``format_report``), then rank 0's GPU work by kernel (``kernel_table``)."""
    bars = [iteration_bars(t, r) for r, t in enumerate(trace_paths)]  # each trace read once
    reports = [report_from_bars(b, r) for r, b in enumerate(bars)]
    return "\n".join([format_report(reports), "rank 0 by kernel:", kernel_table(bars[0], top=top)])


def plot_timeline(trace_paths: Sequence[str | Path], png_path: str | Path, title: str | None = None) -> Path:
    """Draw the last marked iteration of each rank's trace (``trace_paths[r]`` is rank ``r``) as a
    timeline PNG with each rank's report under it; returns its path. Raises ImportError with an
    install hint without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as e:
        raise ImportError("plot_timeline needs matplotlib: pip install matplotlib "
                          "(or pip install -e \".[plot]\" in a tp_fusion checkout)") from e

    per_rank = [iteration_bars(p, r) for r, p in enumerate(trace_paths)]
    bars = [b for rank_bars in per_rank for b in rank_bars]

    def order(row: str):
        rank, lane = row.split(" ", 2)[1:]
        base = next((i for i, name in enumerate(LANES) if lane.startswith(name)), len(LANES))
        return int(rank), base, lane

    rows = sorted({b.row for b in bars}, key=order)
    colors = {False: "#4C72B0", True: "#DD8452"}
    fig, ax = plt.subplots(figsize=(13, 1.6 + 0.45 * max(len(rows), 1) + 0.22 * len(per_rank)))
    for i, row in enumerate(rows):
        mine = [b for b in bars if b.row == row]
        segments = row.endswith(" segments")
        ax.broken_barh([(b.start_ms, max(b.duration_ms, 1e-4)) for b in mine], (i - 0.4, 0.8),
                       facecolors=["#BBBBBB" if segments else colors[b.comm] for b in mine], alpha=0.85,
                       edgecolor="white" if segments else "none", linewidth=0.5)
        for b in mine if segments else ():
            ax.text(b.start_ms + b.duration_ms / 2, i, b.name.removeprefix("tp_fusion::"), ha="center",
                    va="center", fontsize=6, clip_on=True)
    ax.set_yticks(range(len(rows)), rows)
    ax.invert_yaxis()
    ax.set_xlabel("ms from the start of the iteration (each rank on its own clock)")
    ax.set_title(title or "one iteration per rank: compute and communication", loc="left")
    ax.legend(handles=[Patch(color=colors[False], label="compute"), Patch(color=colors[True], label="communication")],
              loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=2, fontsize=8, frameon=False)
    ax.set_xlim(left=0)
    ax.grid(axis="x", alpha=0.3)
    report = format_report([report_from_bars(b, r) for r, b in enumerate(per_rank)], top_gaps=2)
    fig.text(0.01, 0.01, report, family="monospace", fontsize=7, va="bottom")
    fig.tight_layout(rect=(0, 0.04 + 0.03 * len(per_rank), 1, 1))
    path = Path(png_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
