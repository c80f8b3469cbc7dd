"""benchmarks/gpu_monitor.py against a stand-in ``nvidia-smi`` (a script printing what the real one
prints with ``--format=csv,noheader,nounits``), and without one."""

from __future__ import annotations

import os
import stat
import sys
import time

from conftest import ROOT

sys.path.insert(0, str(ROOT))

from benchmarks.gpu_monitor import GpuMonitor, parse_line, power_line, power_means, sampled  # noqa: E402

FAKE = """#!/bin/sh
# Checks the query it is given, then prints two samples of two GPUs and a driver's [N/A].
case "$*" in *"--query-gpu=index,clocks.sm,power.draw"*"-lms=20"*) ;; *) echo "bad args: $*" >&2; exit 2;; esac
echo "0, 1980, 650.5"
echo "1, 1900, 640.0"
echo "0, 1700, 700.5"
echo "1, [N/A], [N/A]"
echo "1, 1800, 660.0"
exec sleep 30  # stays up like the real one, until the monitor stops it
"""


def test_summary_per_gpu_from_nvidia_smi_samples(tmp_path):
    fake = tmp_path / "nvidia-smi"
    fake.write_text(FAKE)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monitor = GpuMonitor(interval_ms=20, command=str(fake))
    with monitor:
        deadline = time.monotonic() + 5
        while sum(len(v) for v in monitor.samples.values()) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)  # until the reader has taken the four samples that parse
    summary = monitor.summary()
    assert summary == {
        0: {"samples": 2, "sm_mhz": 1840.0, "min_sm_mhz": 1700.0, "watts": 675.5, "max_watts": 700.5},
        1: {"samples": 2, "sm_mhz": 1850.0, "min_sm_mhz": 1800.0, "watts": 650.0, "max_watts": 660.0},
    }


def test_no_nvidia_smi_gives_an_empty_summary():
    with GpuMonitor(command="no-such-nvidia-smi") as monitor:
        pass
    assert monitor.summary() == {}


def test_parse_line():
    assert parse_line("3, 1755, 412.07\n") == (3, 1755.0, 412.07)
    assert parse_line("0, [N/A], [N/A]") is None
    assert parse_line("garbage") is None


def test_sampled_records_each_timing_and_power_means_joins_them(tmp_path, monkeypatch):
    """The benchmarks' --power: each timing of a variant adds the GPUs' summary (the timer itself
    needs a GPU, so a stand-in takes its place)."""
    fake = tmp_path / "nvidia-smi"
    fake.write_text(FAKE.replace("-lms=20", "-lms=50"))
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    power = {}
    assert sampled(lambda: time.sleep(0.5) or 1.25, power, "tp_fusion") == 1.25
    assert sampled(lambda: 2.5, None, "tp_fusion") == 2.5  # without --power: nothing sampled
    assert power["tp_fusion"][0][0]["samples"] == 2
    joined = power_means(power["tp_fusion"] * 2)
    assert joined == {"sm_mhz": 1845.0, "min_sm_mhz": 1700.0, "watts": 662.75, "max_watts": 700.5, "samples": 8}
    assert power_line("tp_fusion", joined) == ("power: tp_fusion 1845 MHz (lowest 1700), 663 W (highest 700), "
                                               "8 samples")
    assert power_means([{}, {}]) is None  # a timing too short for a sample
