"""benchmarks/tp_mlp.py's report of the issue's goals, on made-up timings (no GPU needed)."""

import pytest

tp_mlp = pytest.importorskip("benchmarks.tp_mlp")


def _row(tp_fusion_rounds, best=10.0, seq=11.0, async_tp=12.5):
    rounds = {"tp_fusion": tp_fusion_rounds, "best_compute": [best], "nccl_sequential": [seq],
              "async_tp": [async_tp]}
    ms = {name: sorted(r)[len(r) // 2] for name, r in rounds.items()}
    spread = {name: max(r) / min(r) for name, r in rounds.items()}  # as time_rounds records it
    return {"mode": "sp", "tokens": 2048, "hidden": 8192, "ffn": 28672, "ms": ms, "ms_rounds": rounds,
            "spread": spread}


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


def test_time_rounds_settles_first_and_orders_each_call_apart(monkeypatch):
    """Before its rounds, ``time_rounds`` runs every variant untimed for its share of ``settle_ms``; each
    call (each shape) draws its own orders of the variants, so a place in the run that runs slow (the
    GPUs' power controller dips about once a second) does not fall on the same variant shape after shape."""
    import argparse

    events = []
    fns = {name: (lambda name=name: events.append(("run", name))) for name in "abcdef"}
    # 1 ms per call: a share of 30 ms / 6 variants is 5 calls.
    monkeypatch.setattr(tp_mlp.tuning, "calls_spanning", lambda fn, ms, pg, device: int(ms))
    monkeypatch.setattr(tp_mlp, "time_ms",
                        lambda fn, iters, warmup, min_ms, calls: events.append(("time", fn)) or 1.0)
    args = argparse.Namespace(rounds=4, settle_ms=30.0, iters=1, warmup=0, min_ms=0.0)

    orders = []
    for _ in range(2):
        events.clear()
        row = {"ms_rounds": {}}
        tp_mlp.time_rounds(row, fns, args)
        settling = events[:30]
        assert [e[1] for e in settling] == [name for name in "abcdef" for _ in range(5)]
        timed = [{v: k for k, v in fns.items()}[fn] for kind, fn in events[30:]]
        assert all(kind == "time" for kind, _ in events[30:]) and len(timed) == 24
        assert row["ms"] == dict.fromkeys("abcdef", 1.0) and row["spread"] == dict.fromkeys("abcdef", 1.0)
        orders.append([timed[k:k + 6] for k in range(0, 24, 6)])
    assert all(sorted(order) == list("abcdef") for order in orders[0] + orders[1])
    assert orders[0] != orders[1]

    args.settle_ms = 0.0
    events.clear()
    tp_mlp.time_rounds({"ms_rounds": {}}, fns, args)
    assert all(kind == "time" for kind, _ in events)
