"""Every measured choice of a program, made in one step when it is compiled.

``tune(program, runner, inputs)`` decides, the same way on every rank:
- for each fused segment, ``fused`` (the overlapped kernel) or ``sequential`` (one collective and
  one GEMM): ``sequential`` where the segment's group spans hosts (symmetric memory maps peers over
  NVLink, so it needs one host; decided on every backend, so a CPU run shows a GPU job's plan); else
  on CUDA under NCCL both are timed on this segment's own operand shapes, bias and epilogue included
  (what actually runs), and the group takes the max over its ranks; elsewhere (gloo, CPU) ``fused``,
  so the decomposition is what CI exercises;
- whether the whole program replays as a CUDA graph: timed against eager launches where it can be
  captured (CUDA, NCCL, no symmetric-memory segment, meshes spanning the world).
The choices and why they were made are recorded in the program (``str(fd.plan)`` shows them); the kernels
take the mode they are given and never decide. ``TP_FUSION_TUNE=0`` skips the timings: fused
segments on one host run ``fused`` and nothing is captured. ``TP_FUSION_CUDA_GRAPHS=1`` turns graphs on (off by
default, see ``graphs.enabled``).
"""

from __future__ import annotations

import dataclasses
import math
import os
import warnings

import torch
from tp_fusion.sharding.reshard import Collective

from tp_fusion.program import FUSED, SEQUENTIAL, FusedGemm, Program, local_shape
from tp_fusion.runtime import dist, graphs, symm
from tp_fusion.runtime.runner import Runner, _fused

TIMED_ITERS, WARMUP, ROUNDS = 8, 2, 3


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


def _measures(program: Program) -> bool:
    return (program.device.type == "cuda" and dist.is_initialized() and dist.backend() == "nccl"
            and os.environ.get("TP_FUSION_TUNE", "1") != "0")


def _random_env(f: FusedGemm, program: Program) -> dict[int, torch.Tensor]:
    """Random operands of the segment's local shapes (a rank's own data is not needed to time it)."""
    gen = torch.Generator(program.device).manual_seed(0)
    env = {}
    for name in (f.x, f.weight, f.bias):
        if name is not None:
            t = program.fusion.tensor(name)
            shape = local_shape(program.fusion, name)
            env[name] = torch.randn(shape, dtype=t.dtype.torch, device=program.device, generator=gen) / math.sqrt(
                shape[-1])
    return env


def _choose_mode(i: int, program: Program, hosts: list[str]) -> tuple[str, str]:
    """(mode, why) for fused segment ``i``, whose group's ranks are on ``hosts``."""
    seg = program.segments[i]
    f = seg.fused
    if f.runs_here and len(hosts) > 1:
        return SEQUENTIAL, (f"segment {i} {seg.note}: group {list(f.group)} spans hosts {', '.join(hosts)}; "
                            f"symmetric memory needs one host -> {SEQUENTIAL} ({dist.backend()} collectives)")
    if f.runs_here and f.collective is Collective.ALLREDUCE and \
            math.prod(local_shape(program.fusion, f.x)[:-1]) % len(f.group):
        return SEQUENTIAL, ""  # rows that do not split over the ranks: nothing to pipeline
    if not _measures(program) or not f.runs_here:
        return FUSED, ""
    if symm.driver() is None:
        return SEQUENTIAL, f"segment {i} {seg.note}: no symmetric-memory path on this machine -> {SEQUENTIAL}"
    env = _random_env(f, program)
    runs = {mode: _fused(dataclasses.replace(f, mode=mode), program) for mode in (FUSED, SEQUENTIAL)}
    rounds = {mode: [] for mode in runs}
    for _ in range(ROUNDS):  # interleaved: clock drift hits both modes alike
        for mode, run in runs.items():
            rounds[mode].append(time_ms(lambda run=run: run(dict(env)), TIMED_ITERS, WARMUP))
    fused_ms, sequential_ms = slowest([min(rounds[FUSED]), min(rounds[SEQUENTIAL])], dist.group(f.group),
                                      program.device)
    mode = FUSED if fused_ms <= sequential_ms else SEQUENTIAL
    return mode, f"segment {i} {seg.note}: fused {fused_ms:.3f} ms, sequential {sequential_ms:.3f} ms -> {mode}"


def _graphable(program: Program) -> bool:
    """The same answer on every rank: CUDA with NCCL, no segment on the symmetric-memory path,
    every mesh spanning the whole world, and no random draw without a seed (its seed is drawn on
    the host per call, which a replay would freeze)."""
    world = set(range(dist.world_size()))
    return (_measures(program) and graphs.enabled()
            and all(seg.fused is None or seg.fused.mode != FUSED for seg in program.segments)
            and all(t.sharding is None or set(t.sharding.mesh.devices) == world for t in program.fusion.tensors)
            and not any(op.kind == "uniform" and op.attr("rng_seed") is None for op in program.fusion.ops))


def _capture_if_faster(runner: Runner, inputs: list[torch.Tensor]) -> tuple[graphs.GraphedRun | None, str]:
    """Capture the runner's plan and keep the graph if every rank captured it and replaying is faster
    than launching eagerly on every rank (collective: every rank of the world calls it, with the same
    plan). The ranks agree that all captured before anything runs again: a rank left eager while its
    peers replay would pair collectives wrongly. Returns the graph (or None) and a note."""
    try:
        graphed = graphs.GraphedRun(lambda xs: runner.run_eager(xs, report_faults=False), inputs)
    except Exception as e:  # not capturable on this rank (no peer is told: the agreement below is)
        graphed = None
        warnings.warn(f"tp_fusion: this rank could not capture the plan as a CUDA graph, so every rank runs it "
                      f"eagerly: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", stacklevel=2)
    (not_captured,) = slowest([float(graphed is None)], None, inputs[0].device)
    if not_captured:
        if graphed is not None:
            graphed.release()
        return None, "cuda graph: a rank could not capture the plan -> eager"
    eager_ms, graph_ms = slowest([time_ms(lambda: runner.run_eager(inputs), TIMED_ITERS, WARMUP),
                                  time_ms(lambda: graphed.replay(inputs), TIMED_ITERS, WARMUP)],
                                 None, inputs[0].device)
    keep = graph_ms < eager_ms
    if not keep:
        graphed.release()
    return (graphed if keep else None), f"cuda graph {graph_ms:.3f} ms, eager {eager_ms:.3f} ms -> " \
                                        f"{'graph' if keep else 'eager'}"


def tune(program: Program, runner: Runner, inputs: list[torch.Tensor]) -> tuple[Program, Runner]:
    """The program with its measured choices recorded, and a runner for it (collective: every rank
    of the world calls it for the same program)."""
    fused = [i for i, seg in enumerate(program.segments) if seg.fused is not None]
    hosts = symm.hosts_spanned([program.segments[i].fused.group for i in fused]) if fused else []
    modes, notes = {}, []
    for i, seg_hosts in zip(fused, hosts):
        modes[i], note = _choose_mode(i, program, seg_hosts)
        if note:
            notes.append(note)
    tuned = program.with_choices(modes, cuda_graph=False, notes=tuple(notes))
    runner = Runner(tuned)
    if _graphable(tuned):
        with torch.no_grad():
            graphed, note = _capture_if_faster(runner, inputs)
        tuned = tuned.with_choices({}, cuda_graph=graphed is not None, notes=(*tuned.notes, note))
        runner.program, runner.graph = tuned, graphed
    return tuned, runner
