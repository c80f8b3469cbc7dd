"""benchmarks/tp_mlp.py's report of the issue's goals, on made-up timings (no GPU needed)."""

import pytest

tp_mlp = pytest.importorskip("benchmarks.tp_mlp")


def _row(tp_fusion_rounds, best=10.0, seq=11.0, async_tp=12.5):
    rounds = {"tp_fusion": tp_fusion_rounds, "best_compute": [best], "nccl_sequential": [seq],
              "async_tp": [async_tp]}
    ms = {name: sorted(r)[len(r) // 2] for name, r in rounds.items()}
    return {"mode": "sp", "tokens": 2048, "hidden": 8192, "ffn": 28672, "ms": ms, "ms_rounds": rounds}


def test_goals_are_checked_on_the_medians():
    assert tp_mlp.goals([_row([10.1, 10.15, 10.2])]) == [
        "ok   sp 2048,8192,28672 tp_fusion/best_compute 1.015 (goal <= 1.02)",
        "ok   sp 2048,8192,28672 tp_fusion/async_tp 0.812 (goal <= 0.97)",
        "ok   sp 2048,8192,28672 tp_fusion/sequential 0.923 (goal <= 1.0)"]


def test_a_miss_with_rounds_spread_wide_says_so():
    lines = tp_mlp.goals([_row([10.1, 11.9, 11.8, 10.15, 12.0])])
    assert lines[0] == ("MISS sp 2048,8192,28672 tp_fusion/best_compute 1.180 (goal <= 1.02; tp_fusion's rounds "
                        "spread 1.19x, the fastest 10.100 ms)")
    assert lines[2] == "MISS sp 2048,8192,28672 tp_fusion/sequential 1.073 (goal <= 1.0; tp_fusion's rounds " \
                       "spread 1.19x, the fastest 10.100 ms)"
    assert lines[1].startswith("ok   ") and "spread" not in lines[1]
