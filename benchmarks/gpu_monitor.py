"""SM clock and power of the host's GPUs, sampled by ``nvidia-smi`` while a block of work runs.

The benchmarks' ``--power`` uses it to tell a slower schedule from a slower GPU: in timing loops the
H200s of ``nvidia-h200-x2`` ran the same GEMMs up to 16% slower than in one iteration after an idle
barrier (docs/performance.md, round 5), which reads as the 700 W power limit; logging the clocks and
the power next to each variant's timing confirms or drops that reading.

    with GpuMonitor() as monitor:
        run_the_work()
    monitor.summary()  # {gpu index: {"samples", "sm_mhz", "min_sm_mhz", "watts", "max_watts"}}

Without ``nvidia-smi`` (or on a driver that reports ``[N/A]``) the summary is empty: nothing fails.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import threading
from collections.abc import Callable

QUERY = "index,clocks.sm,power.draw"


class GpuMonitor:
    """Samples every ``interval_ms`` from ``__enter__`` to ``__exit__`` (one ``nvidia-smi`` process,
    read by a thread); ``summary()`` gives the means per GPU."""

    def __init__(self, interval_ms: int = 50, command: str = "nvidia-smi"):
        self.interval_ms, self.command = interval_ms, command
        self.samples: dict[int, list[tuple[float, float]]] = {}  # gpu index -> [(SM MHz, W)]
        self._proc: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None

    def __enter__(self) -> GpuMonitor:
        self.samples = {}
        exe = shutil.which(self.command)
        if exe is not None:
            self._proc = subprocess.Popen(
                [exe, f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", f"-lms={self.interval_ms}"],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            self._reader = threading.Thread(target=self._read, daemon=True)
            self._reader.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait()
            self._reader.join(timeout=5)
            self._proc = self._reader = None

    def _read(self) -> None:
        for line in self._proc.stdout:
            sample = parse_line(line)
            if sample is not None:
                gpu, mhz, watts = sample
                self.samples.setdefault(gpu, []).append((mhz, watts))

    def summary(self) -> dict[int, dict[str, float]]:
        """Per GPU index: the number of samples, mean and lowest SM clock (MHz), mean and highest power (W)."""
        out = {}
        for gpu, rows in sorted(self.samples.items()):
            mhz, watts = [r[0] for r in rows], [r[1] for r in rows]
            out[gpu] = {"samples": len(rows), "sm_mhz": statistics.fmean(mhz), "min_sm_mhz": min(mhz),
                        "watts": statistics.fmean(watts), "max_watts": max(watts)}
        return out


def sampled(timing: Callable[[], float], power: dict | None, name: str) -> float:
    """``timing()`` (a benchmark's timer); with ``power`` (a dict; None: no sampling), the GPUs' clock
    and power meanwhile are appended to ``power[name]`` as one ``GpuMonitor.summary()``."""
    if power is None:
        return timing()
    with GpuMonitor() as monitor:
        ms = timing()
    power.setdefault(name, []).append(monitor.summary())
    return ms


def power_means(summaries: list[dict]) -> dict[str, float] | None:
    """One variant's timings together: the mean of the GPUs' mean SM clock (MHz) and power (W), the
    lowest clock and the highest power seen, and the number of samples (None: no sample at all)."""
    gpus = [g for summary in summaries for g in summary.values()]
    if not gpus:
        return None
    return {"sm_mhz": statistics.fmean(g["sm_mhz"] for g in gpus), "min_sm_mhz": min(g["min_sm_mhz"] for g in gpus),
            "watts": statistics.fmean(g["watts"] for g in gpus), "max_watts": max(g["max_watts"] for g in gpus),
            "samples": sum(g["samples"] for g in gpus)}


def power_line(name: str, p: dict[str, float]) -> str:
    """A ``power_means`` entry as one line of a benchmark's table."""
    return (f"power: {name} {p['sm_mhz']:.0f} MHz (lowest {p['min_sm_mhz']:.0f}), {p['watts']:.0f} W "
            f"(highest {p['max_watts']:.0f}), {p['samples']} samples")


def parse_line(line: str) -> tuple[int, float, float] | None:
    """``"0, 1980, 651.32"`` -> (0, 1980.0, 651.32); None for a line that does not parse (``[N/A]``)."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != 3:
        return None
    try:
        return int(parts[0]), float(parts[1]), float(parts[2])
    except ValueError:
        return None
