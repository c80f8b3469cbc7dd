"""Every measured choice of a program, made in one step when it is compiled.

``tune(program, runner, inputs)`` decides, the same way on every rank:
- for each fused segment, ``fused`` (the overlapped kernel) or ``sequential`` (one collective and
  one GEMM): ``sequential`` where the segment's group spans hosts (symmetric memory maps peers over
  NVLink, so it needs one host; decided on every backend, so a CPU run shows a GPU job's plan); else
  on CUDA under NCCL both are timed on this segment's own operand shapes, bias and epilogue included
  (what actually runs), ``fused`` in each of its kernel variants (``KERNEL_VARIANTS``; the fastest
  is recorded as ``FusedGemm.tuning``), and the group takes the max over its ranks; a segment that timed faster
  ``sequential`` alone is timed ``fused`` within the whole plan too, and the faster plan is kept
  (``_fused_if_faster_in_plan``); elsewhere (gloo, CPU) ``fused``, so the decomposition is what CI
  exercises;
- for each linear+bias followed by a tanh-GELU (a fused segment's epilogue, or a pair in a compute
  segment, ``program.gelu_epilogues``): the GELU in the GEMM's cuBLASLt epilogue or as a pass apart,
  timed alike on CUDA under NCCL (the epilogue kernel is the slower one on some shapes);
- whether the whole program replays as CUDA graphs: timed against eager launches where it can be
  captured (CUDA, NCCL, meshes spanning the world, no random draw); a plan that keeps a fused
  segment is captured only where it runs under ``SMALL_PLAN_MS`` (bound by Python's launches). There
  the segments' eager timings mostly measured the host, so graphs of the plan with every segment
  sequential and with every timed segment fused are timed too, and the fastest is kept.
Before its first timing, tune keeps the GPUs busy for ``settle_ms()`` (``settle``), so that every timing
runs in the steady state the plan will run in, not in the power controller's transient after idle time
(skipped where the previous tune ended under ``SETTLE_AFTER_IDLE_S`` ago: programs compiled in a row).
The choices and why they were made are recorded in the program (``str(fd.plan)`` shows them); the kernels
take the mode they are given and never decide. ``TP_FUSION_TUNE=0`` skips the timings: fused
segments on one host run ``fused``, GELUs stay in their GEMM's epilogue and nothing is captured.
``TP_FUSION_CUDA_GRAPHS=0`` turns graphs off (``graphs.enabled``).
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
import warnings
from collections.abc import Callable, Iterable

import torch
from tp_fusion.sharding.reshard import Collective

from tp_fusion.ops import opdef, operand_types
from tp_fusion.program import FUSED, SEQUENTIAL, FusedGemm, Program, local_shape
from tp_fusion.runtime import dist, graphs, overlap, symm
from tp_fusion.runtime.runner import Runner, _epilogue, _fused, _gemm_gelu

TIMED_ITERS, WARMUP, ROUNDS = 8, 2, 3
MIN_MS = 20.0  # and each timing, and its warmup, spans at least this many ms: GPUs at their power limit run
#                a short timing at the clocks that the work before it left, not at its own
SETTLE_MS = 2000.0  # tune keeps the GPUs busy this long before its first timing: from idle (compiling) to
#                    full load, GPUs at their power cap boost above it, then pull their clocks down for a
#                    second or two (2x H200: 1245-1350 MHz against a steady 1450-1530), and timings there rank
#                    kernels by that transient, not by the steady state the plan runs in (H200: a Triton GEMM
#                    timed 0.84 ms right after its compile and 0.98 ms in the steady state, where cuBLAS's ran
#                    0.84; docs/performance.md, rounds 12 and 13). $TP_FUSION_TUNE_SETTLE_MS overrides it
#                    (0: no settling)
SETTLE_ENV = "TP_FUSION_TUNE_SETTLE_MS"
SETTLE_AFTER_IDLE_S = 1.0  # no settling where the previous tune ended less than this long ago (on every rank)
_tuned_at = -math.inf  # time.monotonic() at the end of this process's last tune on a GPU job
KERNEL_VARIANTS = {  # the fused kernels' knobs timed per segment: each was the fastest on some shapes of the
    #                  SP MLP on 2x H200, measured in the steady state (docs/performance.md, round 10)
    #                  (The allgather's second stream, ag_streams=2, is not timed: tuning's 20 ms timings of a
    #                  segment find it 5-10% faster on every shape, yet in the whole MLP's steady state three
    #                  runs put it 3% ahead or 3% behind one stream, shape by shape, with no side winning:
    #                  a choice tuning would make on a margin that does not carry over. docs/performance.md,
    #                  round 11.)
    Collective.ALLGATHER: (overlap.Tuning(),),
    Collective.REDUCE_SCATTER: (overlap.Tuning(), overlap.Tuning(rs_reduce="ring", rs_subchunks=2)),
    Collective.ALLREDUCE: (overlap.Tuning(),),
}
GELU_APART_GAIN = 0.98  # a GELU leaves its GEMM's epilogue only if that measures at least 2% faster (noise)
SMALL_PLAN_MS = 1.0  # a plan faster than this on the GPU is bound by Python's launches: graphs of it with its
#                      fused segments all sequential and all fused are timed too; a larger plan with a fused
#                      segment stays eager, as graphs did not replay it faster (2x H200, 2048x8192x28672: 1.538
#                      ms against 1.529 eager; 8192x4096x16384: 1.783 against 1.757) and each of its up to four
#                      captures costs compile time
EXECUTE_HOST_MS = 0.1  # a graph is kept if it replays faster than eager launches as timed here plus this: those
#                        timings leave out execute's own host time per call (agreement, guards: 0.08-0.11 ms on
#                        2x H200), which a replay hides under the GPU's work and eager launches of a small plan
#                        add to (SP 1024x4096x16384: a graph 0.276 ms against eager launches timed 0.249 ms,
#                        yet execute ran that plan eagerly in 0.358 ms; docs/performance.md, round 13)


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


def calls_spanning(fn, min_ms: float, pg, device) -> int:
    """How many calls of ``fn`` span ``min_ms`` (0 for none): from one timed call after an untimed one,
    max over the ranks of ``pg`` (None: the world), so that every rank makes as many (collective)."""
    if not min_ms:
        return 0
    (one,) = slowest([time_ms(fn, 1, 1)], pg, device)
    return math.ceil(min_ms / max(one, 1e-3))


def steady_ms(fn, iters: int, warmup: int, min_ms: float, pg, device, calls: int | None = None) -> float:
    """``time_ms``, max over the ranks of ``pg`` (None: the world), with the warmup and the timed calls
    each spanning at least ``min_ms`` (``calls_spanning``; ``calls``: its count, where the caller times
    ``fn`` in several rounds and counted once), the ranks starting the timed calls together (collective
    over ``pg``)."""
    if calls is None:
        calls = calls_spanning(fn, min_ms, pg, device)
    for _ in range(max(warmup, calls)):
        fn()
    slowest([0.0], pg, device)  # a barrier: its all_reduce follows the warmup on every rank's GPU
    (ms,) = slowest([time_ms(fn, max(iters, calls), 0)], pg, device)
    return ms


def settle_ms() -> float:
    """How long tune keeps the GPUs busy before its first timing (``SETTLE_MS``, or ``$TP_FUSION_TUNE_SETTLE_MS``)."""
    value = os.environ.get(SETTLE_ENV)
    try:
        return SETTLE_MS if value is None else float(value)
    except ValueError:
        raise ValueError(f"${SETTLE_ENV} is a number of milliseconds (0: no settling), not {value!r}") from None


def settle(fns: Iterable[Callable[[], object]], ms: float, pg, device) -> None:
    """Run each of ``fns`` in turn, untimed, for about ``ms`` in all, as many calls on every rank of ``pg``
    (None: the world; collective over it)."""
    fns = list(fns)
    for fn in fns:
        for _ in range(calls_spanning(fn, ms / len(fns), pg, device)):
            fn()


def _settle_gpus(device: torch.device) -> None:
    """``settle`` on a 4096-square bf16 GEMM, which runs the GPU at its power cap as the plans' GEMMs do
    (collective over the world)."""
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    settle([lambda: torch.mm(a, a)], settle_ms(), None, device)


def slowest(values: list[float], pg, device) -> list[float]:
    """Each value's max over the ranks of ``pg`` (None: the world), in one tiny all_reduce."""
    t = torch.tensor(values, device=device)
    if dist.is_initialized():
        dist.all_reduce(t, pg, op="max")
    return t.tolist()


def _measures(program: Program) -> bool:
    return (program.device.type == "cuda" and dist.is_initialized() and dist.backend() == "nccl"
            and os.environ.get("TP_FUSION_TUNE", "1") != "0")


def _random_env(program: Program, *names: int | None) -> dict[int, torch.Tensor]:
    """Random operands of these tensors' local shapes (a rank's own data is not needed to time it)."""
    gen = torch.Generator(program.device).manual_seed(0)
    env = {}
    for name in names:
        if name is not None:
            t = program.fusion.tensor(name)
            shape = local_shape(program.fusion, name)
            env[name] = torch.randn(shape, dtype=t.dtype.torch, device=program.device, generator=gen) / math.sqrt(
                shape[-1])
    return env


def _has_gelu_epilogue(f: FusedGemm) -> bool:
    return f.collective is Collective.ALLGATHER and f.bias is not None and _epilogue(f.epilogue) is overlap.gelu_tanh


def _fastest(runs: dict, env: dict, pg, device) -> dict:
    """Each ``run(env)``'s ms, max over ``pg`` (None: the world), the min of interleaved rounds (so clock
    drift hits all alike), each timing in its steady state (``steady_ms``; collective over ``pg``)."""
    fns = {key: (lambda run=run: run(dict(env))) for key, run in runs.items()}
    calls = {key: calls_spanning(fn, MIN_MS, pg, device) for key, fn in fns.items()}
    rounds = {key: [] for key in runs}
    for _ in range(ROUNDS):
        for key, fn in fns.items():
            rounds[key].append(steady_ms(fn, TIMED_ITERS, WARMUP, MIN_MS, pg, device, calls[key]))
    return {key: min(r) for key, r in rounds.items()}


def _choose_mode(i: int, program: Program, hosts: list[str]) -> tuple[str, overlap.Tuning | None, bool, str, bool]:
    """(mode, the fused kernel's knobs, whether a tanh-GELU epilogue runs apart from the GEMM, why, whether
    timings chose it) for fused segment ``i``, whose group's ranks are on ``hosts``. The knobs are those
    of the fastest fused variant even where ``sequential`` won: ``_fused_if_faster_in_plan`` may yet run
    the segment fused."""
    seg = program.segments[i]
    f = seg.fused
    if f.runs_here and len(hosts) > 1:
        why = (f"segment {i} {seg.note}: group {list(f.group)} spans hosts {', '.join(hosts)}; "
               f"symmetric memory needs one host -> {SEQUENTIAL} ({dist.backend()} collectives)")
        return SEQUENTIAL, None, False, why, False
    if f.collective is Collective.ALLREDUCE and math.prod(local_shape(program.fusion, f.x)[:-1]) % f.group_size:
        return SEQUENTIAL, None, False, "", False  # rows that do not split over the ranks: nothing to pipeline
    if not _measures(program) or not f.runs_here:
        return FUSED, None, False, "", False
    if symm.driver() is None:
        return SEQUENTIAL, None, False, \
            f"segment {i} {seg.note}: no symmetric-memory path on this machine -> {SEQUENTIAL}", False
    gelu_choices = (True, False) if _has_gelu_epilogue(f) else (True,)
    kernels = [(FUSED, t) for t in KERNEL_VARIANTS[f.collective]] + [(SEQUENTIAL, overlap.DEFAULT_TUNING)]
    runs = {(mode, t, in_gemm): _fused(dataclasses.replace(f, mode=mode, tuning=t), program, gelu_in_gemm=in_gemm)
            for mode, t in kernels for in_gemm in gelu_choices}
    ms = _fastest(runs, _random_env(program, f.x, f.weight, f.bias, f.residual), dist.group(f.group), program.device)
    def best(mode, t):
        return min(ms[mode, t, g] for g in gelu_choices)
    fastest_fused = min(KERNEL_VARIANTS[f.collective], key=lambda t: best(FUSED, t))
    mode, t = (FUSED, fastest_fused) if best(FUSED, fastest_fused) <= best(*kernels[-1]) else kernels[-1]
    in_gemm = len(gelu_choices) == 1 or _keeps_gelu_in_gemm(ms[mode, t, True], ms[mode, t, False])
    timings = ", ".join(f"{_kernel_name(m, k)} {ms[m, k, True]:.3f} ms"
                        + (f" (GELU apart {ms[m, k, False]:.3f})" if len(gelu_choices) > 1 else "")
                        for m, k in kernels)
    why = f"segment {i} {seg.note}: {timings} -> {_kernel_name(mode, t)}" + ("" if in_gemm else ", GELU apart")
    return mode, fastest_fused, not in_gemm, why, True


def _kernel_name(mode: str, t: overlap.Tuning) -> str:
    """``fused`` or ``sequential``, with the knobs a fused kernel sets apart from the defaults."""
    knobs = [f"{field.name}={getattr(t, field.name)!r}" for field in dataclasses.fields(t)
             if getattr(t, field.name) != getattr(overlap.DEFAULT_TUNING, field.name)]
    return f"{mode} ({', '.join(knobs)})" if mode == FUSED and knobs else mode


def _keeps_gelu_in_gemm(in_gemm_ms: float, apart_ms: float) -> bool:
    """Whether a GELU stays in its GEMM's epilogue: it leaves only where a pass apart measured at least 2%
    faster (``GELU_APART_GAIN``), for fused segments and compute segments alike."""
    return apart_ms > in_gemm_ms * GELU_APART_GAIN


def _choose_gelus(program: Program) -> tuple[set[int], list[str]]:
    """The compute segments' GEMM+GELU pairs whose GELU runs faster apart from the GEMM's epilogue
    (collective over the world: every rank times every pair, as the sizes are global), with notes."""
    apart, notes = set(), []
    if not _measures(program):
        return apart, notes
    for i, seg in enumerate(program.segments):
        if seg.kind != "compute":
            continue
        for j in program.gelu_pairs(seg):
            gemm, act = seg.steps[j], seg.steps[j + 1]
            runs = {in_gemm: _gemm_gelu(gemm, act, in_gemm) for in_gemm in (True, False)}
            ms = _fastest(runs, _random_env(program, *gemm.op.inputs), None, program.device)
            keep = _keeps_gelu_in_gemm(ms[True], ms[False])
            if not keep:
                apart.add(act.op.outputs[0])
            notes.append(f"segment {i} linear+gelu: GELU in the GEMM's epilogue {ms[True]:.3f} ms, apart "
                         f"{ms[False]:.3f} ms -> {'in the epilogue' if keep else 'apart'}")
    return apart, notes


def _graphable(program: Program) -> bool:
    """The same answer on every rank: CUDA with NCCL, every mesh spanning the whole world, and every op
    capturable (``OpDef.capturable``: no random draw, no kernel that reads device values on the host, no
    attribute that each call gives)."""
    world = set(range(dist.world_size()))
    fusion = program.fusion
    return (_measures(program) and graphs.enabled()
            and all(t.sharding is None or set(t.sharding.mesh.devices) == world for t in fusion.tensors)
            and all(opdef(op.kind).capturable(operand_types(op, fusion.tensor), dict(op.attrs)) for op in fusion.ops))


def _modes(program: Program) -> list[str | None]:
    """Each fused segment's mode, in order."""
    return [seg.fused.mode for seg in program.segments if seg.fused is not None]


def _capture(runner: Runner, inputs: list[torch.Tensor]) -> graphs.GraphedRun | None:
    """The runner's plan captured as CUDA graphs, or None on every rank where some rank could not capture
    it (collective: every rank of the world calls it, with the same plan). The ranks agree that all
    captured before anything runs again: a rank left eager while its peers replay would pair collectives
    wrongly."""
    try:
        graphed = graphs.GraphedRun(lambda xs: runner.run_eager(xs, report_faults=False), inputs)
    except Exception as e:  # not capturable on this rank (no peer is told: the agreement below is)
        graphed = None
        warnings.warn(f"tp_fusion: this rank could not capture the plan as a CUDA graph, so every rank runs it "
                      f"eagerly: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", stacklevel=3)
    (not_captured,) = slowest([float(graphed is None)], None, inputs[0].device)
    if not_captured and graphed is not None:
        graphed.release()
        graphed = None
    return graphed


def _capture_if_faster(runners: dict[str, Runner], inputs: list[torch.Tensor], eager_ms: float
                       ) -> tuple[str | None, graphs.GraphedRun | None, str]:
    """Capture the plan of each of ``runners`` (a label for the note -> its runner; the first runs the plan
    as tuned) and keep the graph that replays fastest if it beats ``eager_ms`` (the first plan launched
    eagerly) plus execute's own host time (``EXECUTE_HOST_MS``), max over the ranks (collective).
    Returns the label of the graph kept (None: eager), the graph, and a note."""
    timed, notes = {}, []
    for what, runner in runners.items():
        graphed = _capture(runner, inputs)
        if graphed is None:
            notes.append(f"cuda graph{what}: a rank could not capture the plan")
            continue
        ms = steady_ms(lambda g=graphed: g.replay(inputs), TIMED_ITERS, WARMUP, MIN_MS, None, inputs[0].device)
        timed[what] = (ms, graphed)
        notes.append(f"cuda graph{what} {ms:.3f} ms")
    best = min(timed, key=lambda what: timed[what][0], default=None)
    if best is not None and timed[best][0] >= eager_ms + EXECUTE_HOST_MS:
        best = None
    for what, (_, graphed) in timed.items():
        if what != best:
            graphed.release()
    note = f"{', '.join(notes)}, eager {eager_ms:.3f} ms -> {'eager' if best is None else 'graph' + best}"
    return best, (None if best is None else timed[best][1]), note


def _graph_candidates(tuned: Program, runner: Runner, fused: list[int], timed_sequential: list[int],
                      eager_ms: float) -> dict[str, Runner] | None:
    """The plans to capture (a label for the note -> its runner; "": the plan as tuned), or None where the
    plan stays eager: one that keeps a fused segment and is not bound by launches (``SMALL_PLAN_MS``:
    graphs measured no faster there). A plan under it, where the segments' eager timings mostly measured
    the host, is captured with every segment sequential and with every timed segment fused too, so the
    fused-or-sequential choice is made again between graphs. Alike on every rank (collective over the
    world): a segment's choice, and which segments timed sequential, can differ between the groups of a
    2-D mesh, and every rank must capture and time the same plans; what holds on any rank counts."""
    alternatives = {what: tuned.with_choices(modes, cuda_graph=False, notes=tuned.notes)
                    for what, modes in ((" (every segment sequential)", {i: SEQUENTIAL for i in fused}),
                                        (" (every timed segment fused)", {i: FUSED for i in timed_sequential}))}
    keeps_fused, *differs = slowest([float(FUSED in _modes(tuned)),
                                     *(float(_modes(plan) != _modes(tuned)) for plan in alternatives.values())],
                                    None, tuned.device)
    if eager_ms >= SMALL_PLAN_MS:  # eager_ms is the max over the world: alike on every rank
        return None if keeps_fused else {"": runner}
    return {"": runner, **{what: Runner(plan) for (what, plan), d in zip(alternatives.items(), differs) if d}}


def _fused_if_faster_in_plan(program: Program, runner: Runner, candidates: list[int],
                             inputs: list[torch.Tensor], numbers: dict | None) -> tuple[Program, Runner]:
    """Fused segments that timed faster ``sequential`` on their own (``candidates``, this rank's) are run
    ``fused`` where the whole plan runs faster so. Timed alone, back to back, a fused kernel can lose to
    the collective where its GEMM is shorter than its transfers; within the plan, the sequential
    collective also waits for the slower rank at a point where nothing else runs (tp transformer layer
    8192x4096 on 2x H200: the out-projection's allreduce timed 0.441 ms sequential and 0.464 fused alone,
    yet the layer ran 3.27 ms with it sequential and 3.05 with it fused). Both plans are launched
    eagerly and timed as segments are (``_fastest``, max over the world: collective over the world)."""
    (anywhere,) = slowest([float(bool(candidates))], None, program.device)
    if not anywhere:
        return program, runner
    alternative = program.with_choices({i: FUSED for i in candidates}, cuda_graph=False, notes=program.notes)
    runners = {SEQUENTIAL: runner, FUSED: Runner(alternative)}
    with torch.no_grad():
        ms = _fastest({mode: lambda env, r=r: r.run_eager(inputs, numbers) for mode, r in runners.items()}, {}, None,
                      program.device)
    mode = FUSED if ms[FUSED] < ms[SEQUENTIAL] else SEQUENTIAL
    which = ", ".join(str(i) for i in candidates) or "none on this rank"
    note = f"whole plan: segment(s) {which} sequential {ms[SEQUENTIAL]:.3f} ms, fused {ms[FUSED]:.3f} ms -> {mode}"
    chosen = (alternative if mode == FUSED else program).with_choices({}, cuda_graph=False,
                                                                       notes=(*program.notes, note))
    runners[mode].program = chosen
    return chosen, runners[mode]


def _plan_ms(runner: Runner, inputs: list[torch.Tensor]) -> float:
    """The runner's plan launched eagerly, ms per call, max over the world (collective)."""
    return steady_ms(lambda: runner.run_eager(inputs), TIMED_ITERS, WARMUP, MIN_MS, None, inputs[0].device)


def tune(program: Program, runner: Runner, inputs: list[torch.Tensor], numbers: dict | None = None
         ) -> tuple[Program, Runner]:
    """The program with its measured choices recorded, and a runner for it (collective: every rank
    of the world calls it for the same program). ``numbers``: the call's, as ``Runner.run`` takes them."""
    global _tuned_at
    if not _measures(program):
        return _tune(program, runner, inputs, numbers)
    (idle_s,) = slowest([time.monotonic() - _tuned_at], None, program.device)  # alike on every rank
    if idle_s > SETTLE_AFTER_IDLE_S:
        _settle_gpus(program.device)
    tuned = _tune(program, runner, inputs, numbers)
    _tuned_at = time.monotonic()
    return tuned


def _tune(program: Program, runner: Runner, inputs: list[torch.Tensor], numbers: dict | None
          ) -> tuple[Program, Runner]:
    """``tune``'s choices, the GPUs settled."""
    fused = [i for i, seg in enumerate(program.segments) if seg.fused is not None]
    hosts = symm.hosts_spanned([program.segments[i].fused.group for i in fused]) if fused else []
    modes, kernels, apart, notes, timed_sequential = {}, {}, set(), [], []
    for i, seg_hosts in zip(fused, hosts):
        modes[i], kernels[i], gelu_apart, note, timed = _choose_mode(i, program, seg_hosts)
        if gelu_apart:
            apart.add(program.segments[i].fused.out)
        if note:
            notes.append(note)
        if timed and modes[i] == SEQUENTIAL:
            timed_sequential.append(i)
    compute_apart, compute_notes = _choose_gelus(program)
    tuned = program.with_choices(modes, cuda_graph=False, notes=(*notes, *compute_notes),
                                 gelu_apart=frozenset(apart | compute_apart), kernels=kernels)
    runner = Runner(tuned)
    if _measures(program):
        tuned, runner = _fused_if_faster_in_plan(tuned, runner, timed_sequential, inputs, numbers)
    if not _graphable(tuned):
        return tuned, runner
    with torch.no_grad():
        eager_ms = _plan_ms(runner, inputs)
        runners = _graph_candidates(tuned, runner, fused, timed_sequential, eager_ms)
        if runners is None:
            return tuned, runner
        what, graphed, note = _capture_if_faster(runners, inputs, eager_ms)
    chosen = runners.get(what, runner)
    chosen.program = chosen.program.with_choices({}, cuda_graph=graphed is not None, notes=(*tuned.notes, note))
    chosen.graph = graphed
    return chosen.program, chosen
