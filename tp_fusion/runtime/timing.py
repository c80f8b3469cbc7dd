"""Measured choices (fused vs sequential segments, CUDA graph vs eager plans) that every rank
makes alike: each rank times the candidates with CUDA events, then the ranks take the max."""

from __future__ import annotations

import torch

from tp_fusion.runtime import dist


def time_ms(fn, iters: int, warmup: int) -> float:
    """GPU milliseconds per call of ``fn`` (CUDA events around ``iters`` calls after ``warmup``)."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def slowest(values: list[float], pg, device) -> list[float]:
    """Each value's max over the ranks of ``pg`` (None: the world), in one tiny all_reduce."""
    t = torch.tensor(values, device=device)
    if dist.is_initialized():
        dist.all_reduce(t, pg, op="max")
    return t.tolist()
