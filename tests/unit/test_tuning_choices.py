"""Choices tuning makes without timing them here (the timings run on GPUs: tests/gpu, benchmarks):
which plans may be captured as a CUDA graph (``tuning._graphable``: a random draw stays eager, since a
replay would repeat an unseeded draw and a seeded one's generator cannot be captured, and so does an op that
reads device values on the host), and how measured timings
become choices (the GELU leaves the GEMM's epilogue only when clearly faster; a fused segment that lost alone
is timed fused within the whole plan too)."""

from __future__ import annotations

import math

import pytest
import torch
from tp_fusion.sharding.reshard import Collective

from tp_fusion import DataType, DeviceMesh, FusionDefinition, ParallelType
from tp_fusion.program import FUSED, SEQUENTIAL
from tp_fusion.runtime import graphs, overlap, runner, tuning
from tp_fusion.runtime.overlap import DEFAULT_TUNING, Tuning


def _dropout_like(seeded: bool):
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 8], dtype=DataType.Float)
        seed = {"rng_seed": 7, "rng_offset": 0} if seeded else {}
        fd.add_output(fd.ops.mul(x, fd.ops.rand_like(x, **seed)))
    return fd.compile([[4, 8]], device="cuda")


@pytest.fixture
def gpu_tuning(monkeypatch):
    """Tuning as it decides on a CUDA + NCCL job (its device and backend checks pass)."""
    monkeypatch.setattr(tuning, "_measures", lambda program: True)


def _plain():
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 8], dtype=DataType.Float)
        fd.add_output(fd.ops.mul(x, x))
    return fd.compile([[4, 8]], device="cuda")


def test_random_draws_are_never_captured(gpu_tuning):
    assert tuning._graphable(_plain())
    assert not tuning._graphable(_dropout_like(seeded=False))  # a replay would repeat the host's seed
    assert not tuning._graphable(_dropout_like(seeded=True))  # its generator is not the graph's


@pytest.mark.parametrize("dtype,graphable", [(DataType.BFloat16, True), (DataType.Float, False),
                                             (DataType.Double, False)])
def test_grouped_mm_is_captured_only_where_it_reads_its_offsets_on_the_gpu(gpu_tuning, dtype, graphable):
    """torch's one CUDA kernel of _grouped_mm (bf16) reads the offsets on the GPU; the other dtypes take a
    path that reads them on the host, which a capture refuses (it used to fail and warn at tuning)."""
    with FusionDefinition() as fd:
        x, w = fd.define_tensor([24, 8], dtype=dtype), fd.define_tensor([4, 8, 16], dtype=dtype)
        offsets = fd.define_tensor([4], dtype=DataType.Int32)
        fd.add_output(fd.ops.grouped_mm(x, w, offsets))
    assert tuning._graphable(fd.compile([[24, 8], [4, 8, 16], [4]], device="cuda")) == graphable


def test_graphs_are_on_unless_turned_off(gpu_tuning, monkeypatch):
    assert graphs.enabled()
    monkeypatch.setenv("TP_FUSION_CUDA_GRAPHS", "0")
    assert not graphs.enabled() and not tuning._graphable(_plain())


def test_draws_differ_per_call_without_a_seed():
    """The property the rule above protects, on the CPU."""
    with FusionDefinition() as f:
        x = f.define_tensor([4, 8], dtype=DataType.Float)
        f.add_output(f.ops.rand_like(x))
    a, b = f.execute([torch.ones(4, 8)])[0], f.execute([torch.ones(4, 8)])[0]
    assert not torch.equal(a, b)


def _mlp_program():
    with FusionDefinition() as fd:
        x, w1, b1, w2 = (fd.define_tensor(s) for s in ([4, 8], [16, 8], [16], [8, 16]))
        fd.add_output(fd.ops.linear(fd.ops.gelu(fd.ops.linear(x, w1, b1), approximate="tanh"), w2))
    return fd.compile([[4, 8], [16, 8], [16], [8, 16]])


@pytest.mark.parametrize("apart_ms, leaves", [(0.99, False), (0.97, True)])
def test_gelu_leaves_the_epilogue_only_when_clearly_faster(gpu_tuning, monkeypatch, apart_ms, leaves):
    monkeypatch.setattr(tuning, "_fastest", lambda runs, env, pg, device: {True: 1.0, False: apart_ms})
    monkeypatch.setattr(tuning, "_random_env", lambda program, *names: {})
    program = _mlp_program()
    apart, notes = tuning._choose_gelus(program)
    (gelu,) = [op.outputs[0] for op in program.fusion.ops if op.kind == "gelu"]
    assert apart == ({gelu} if leaves else set())
    assert notes == [f"segment 0 linear+gelu: GELU in the GEMM's epilogue 1.000 ms, apart {apart_ms:.3f} ms -> "
                     f"{'apart' if leaves else 'in the epilogue'}"]


def _tp_mlp_program():
    """A tp MLP compiled for CUDA on rank 0 of 2: its fc2 is a fused linear+allreduce segment."""
    mesh = DeviceMesh(range(2))
    with FusionDefinition() as fd:
        x, w1, w2 = fd.define_tensor([8, 8]), fd.define_tensor([16, 8]), fd.define_tensor([8, 16])
        fd.add_output(fd.ops.linear(fd.ops.gelu(fd.ops.linear(x, w1), approximate="tanh"), w2))
    for tv in (x, w1, w2):
        tv.set_device_mesh(mesh)
    for tv, dim in ((w1, 0), (w2, 1)):
        tv.outer_split(dim, 2)
        tv.axis(dim).parallelize(ParallelType.mesh_x)
    return fd.compile([[8, 8], [16, 8], [8, 16]], rank=0, device="cuda")


@pytest.mark.parametrize("fused_ms, want", [(1.0, FUSED), (3.0, SEQUENTIAL)])
def test_a_segment_faster_sequential_alone_runs_fused_where_the_plan_is_faster_so(monkeypatch, fused_ms, want):
    """Timed alone, a fused segment lost to its sequential collective; the whole plan is then timed with it
    fused too, and the faster plan is kept (with a note saying why)."""
    (i,) = [i for i, seg in enumerate(_tp_mlp_program().segments) if seg.fused is not None]
    alone = _tp_mlp_program().with_choices({i: SEQUENTIAL}, cuda_graph=False, notes=())

    class Timed:  # stands in for the Runner: "running" the plan returns its time in ms
        def __init__(self, program):
            self.program = program

        def run_eager(self, inputs, numbers):
            return fused_ms if self.program.segments[i].fused.mode == FUSED else 2.0

    monkeypatch.setattr(tuning, "Runner", Timed)
    monkeypatch.setattr(tuning, "time_ms", lambda fn, iters, warmup: fn())
    monkeypatch.setattr(tuning, "slowest", lambda values, pg, device: values)  # one rank, no GPU
    chosen, runner = tuning._fused_if_faster_in_plan(alone, Timed(alone), [i], [], None)
    assert chosen.segments[i].fused.mode == want and runner.program is chosen
    assert chosen.notes == (f"whole plan: segment(s) {i} sequential 2.000 ms, fused {fused_ms:.3f} ms -> {want}",)


def _sp_mlp_program():
    """An SP MLP compiled for CUDA on rank 0 of 2: a fused allgather+linear+gelu and a fused
    linear+reduce_scatter."""
    mesh = DeviceMesh(range(2))
    with FusionDefinition() as fd:
        x, w1, b1, w2 = (fd.define_tensor(s) for s in ([8, 8], [16, 8], [16], [8, 16]))
        z = fd.ops.linear(fd.ops.gelu(fd.ops.linear(x, w1, b1), approximate="tanh"), w2)
        fd.add_output(z)
    for tv, dim in ((x, 0), (w1, 0), (b1, 0), (w2, 1), (z, 0)):
        tv.set_device_mesh(mesh)
        tv.outer_split(dim, 2)
        tv.axis(dim).parallelize(ParallelType.mesh_x)
    return fd.compile([[8, 8], [16, 8], [16], [8, 16]], rank=0, device="cuda")


def test_each_fused_segment_runs_the_kernel_variant_measured_fastest(gpu_tuning, monkeypatch):
    """Every variant of ``KERNEL_VARIANTS`` is timed against the sequential collective (and the GELU in
    and apart from the epilogue); the fastest is recorded in the program, and the note says why."""
    program = _sp_mlp_program()
    index = {seg.fused.collective: i for i, seg in enumerate(program.segments) if seg.fused is not None}
    winners = {Tuning(rs_reduce="ring", rs_subchunks=2)}
    timed = []

    def fastest(runs, env, pg, device):  # the winners with the GELU in the epilogue: 1 ms; all else 2 ms
        timed.append(set(runs))
        return {key: 1.0 if key[0] == FUSED and key[1] in winners and key[2] else 2.0 for key in runs}

    monkeypatch.setattr(tuning, "_fastest", fastest)
    monkeypatch.setattr(tuning, "_random_env", lambda program, *names: {})
    monkeypatch.setattr(tuning, "_fused", lambda f, program, gelu_in_gemm: None)
    monkeypatch.setattr(tuning.symm, "driver", lambda: object())
    monkeypatch.setattr(tuning.dist, "group", lambda ranks: None)

    ag = tuning._choose_mode(index[Collective.ALLGATHER], program, ["host"])
    assert ag[:3] == (FUSED, DEFAULT_TUNING, False) and ag[4]  # a tie keeps the fused kernel
    assert ag[3] == ("segment 0 allgather+linear+gelu: fused 2.000 ms (GELU apart 2.000), sequential 2.000 ms "
                     "(GELU apart 2.000) -> fused")
    assert timed[0] == {(mode, t, g) for mode, t in [(FUSED, DEFAULT_TUNING), (SEQUENTIAL, DEFAULT_TUNING)]
                        for g in (True, False)}
    rs = tuning._choose_mode(index[Collective.REDUCE_SCATTER], program, ["host"])
    assert rs[:3] == (FUSED, Tuning(rs_reduce="ring", rs_subchunks=2), False)
    assert rs[3].endswith("fused 2.000 ms, fused (rs_reduce='ring', rs_subchunks=2) 1.000 ms, sequential 2.000 ms "
                          "-> fused (rs_reduce='ring', rs_subchunks=2)")
    chosen = program.with_choices({index[Collective.REDUCE_SCATTER]: FUSED}, cuda_graph=False, notes=(),
                                  kernels={index[Collective.REDUCE_SCATTER]: rs[1]})
    assert chosen.segments[index[Collective.REDUCE_SCATTER]].fused.tuning == rs[1]
    assert chosen.segments[index[Collective.ALLGATHER]].fused.tuning is None


def test_the_runner_gives_a_fused_kernel_the_knobs_tuning_recorded(monkeypatch):
    program = _sp_mlp_program()
    (i,) = [i for i, seg in enumerate(program.segments)
            if seg.fused is not None and seg.fused.collective is Collective.REDUCE_SCATTER]
    knobs = Tuning(rs_reduce="ring", rs_subchunks=2)
    program = program.with_choices({i: FUSED}, cuda_graph=False, notes=(), kernels={i: knobs})
    got = {}
    monkeypatch.setattr(overlap, "linear_reduce_scatter", lambda *a, **kw: got.update(kw))
    monkeypatch.setattr(runner.dist, "group", lambda ranks: None)
    monkeypatch.setattr(runner.dist, "group_size", lambda pg: 2)
    f = program.segments[i].fused
    env = {name: torch.ones(2, 2) for name in (f.x, f.weight)}
    runner._fused(f, program)(env)
    assert got["tuning"] == knobs and got["mode"] == FUSED


def test_a_segment_left_sequential_keeps_its_fastest_fused_knobs_for_the_plan_timing(gpu_tuning, monkeypatch):
    """Sequential won alone, so the mode is sequential; the knobs are the fastest fused variant's, which
    ``_fused_if_faster_in_plan`` runs if the segment does better fused within the whole plan."""
    program = _sp_mlp_program()
    (i,) = [i for i, seg in enumerate(program.segments)
            if seg.fused is not None and seg.fused.collective is Collective.REDUCE_SCATTER]
    ring = Tuning(rs_reduce="ring", rs_subchunks=2)
    monkeypatch.setattr(tuning, "_fastest", lambda runs, env, pg, device: {
        key: {SEQUENTIAL: 1.0}.get(key[0], 1.5 if key[1] == ring else 2.0) for key in runs})
    monkeypatch.setattr(tuning, "_random_env", lambda program, *names: {})
    monkeypatch.setattr(tuning, "_fused", lambda f, program, gelu_in_gemm: None)
    monkeypatch.setattr(tuning.symm, "driver", lambda: object())
    monkeypatch.setattr(tuning.dist, "group", lambda ranks: None)
    mode, knobs, _, why, timed = tuning._choose_mode(i, program, ["host"])
    assert (mode, knobs, timed) == (SEQUENTIAL, ring, True) and why.endswith("-> sequential")


@pytest.mark.parametrize("knobs", [{"ag_gemm": "gathered"}, {"ag_streams": 3}, {"rs_reduce": "inplace"},
                                   {"rs_subchunks": 0}, {"ar_subchunks": 0}])
def test_knobs_out_of_range_are_refused(knobs):
    with pytest.raises(ValueError, match="ag_streams and rs_streams are 1 or 2, ag_gemm 'chunks' or"):
        Tuning(**knobs)


def test_tune_settles_the_gpus_before_its_first_timing_unless_it_just_tuned(gpu_tuning, monkeypatch):
    """On a GPU job, tune keeps the GPUs busy (``_settle_gpus``) before it times anything: timings taken in
    the power controller's transient after idle time rank kernels by that transient. A tune that follows
    another within ``SETTLE_AFTER_IDLE_S`` finds the GPUs busy already and does not settle again."""
    events = []
    monkeypatch.setattr(tuning, "_settle_gpus", lambda device: events.append("settle"))
    monkeypatch.setattr(tuning, "_fastest",
                        lambda runs, env, pg, device: events.append("time") or dict.fromkeys(runs, 1.0))
    monkeypatch.setattr(tuning, "_tuned_at", -math.inf)  # nothing tuned yet in this process
    monkeypatch.setenv("TP_FUSION_CUDA_GRAPHS", "0")
    program = _mlp_program()
    tuned, _ = tuning.tune(program, runner.Runner(program), [])
    assert events == ["settle", "time"]  # the GELU pair's timing, after the settling
    assert tuned.notes[0].startswith("segment 0 linear+gelu:")
    tuning.tune(program, runner.Runner(program), [])  # right after: no settling
    assert events == ["settle", "time", "time"]
    monkeypatch.setattr(tuning, "_tuned_at", tuning._tuned_at - tuning.SETTLE_AFTER_IDLE_S)
    tuning.tune(program, runner.Runner(program), [])  # the GPUs have been idle since
    assert events == ["settle", "time", "time", "settle", "time"]


def test_settling_shares_its_time_among_the_runs_and_can_be_turned_off(monkeypatch):
    calls = []
    monkeypatch.setattr(tuning, "calls_spanning", lambda fn, ms, pg, device: int(ms))  # 1 ms per call
    tuning.settle([lambda: calls.append("a"), lambda: calls.append("b")], 6.0, None, "cpu")
    assert calls == ["a"] * 3 + ["b"] * 3
    assert tuning.settle_ms() == tuning.SETTLE_MS
    monkeypatch.setenv(tuning.SETTLE_ENV, "0")
    assert tuning.settle_ms() == 0.0
    monkeypatch.setenv(tuning.SETTLE_ENV, "2s")
    with pytest.raises(ValueError, match=r"\$TP_FUSION_TUNE_SETTLE_MS is a number of milliseconds .*'2s'"):
        tuning.settle_ms()


class _Graphed:
    """Stands in for ``graphs.GraphedRun``: records its releases."""

    released: list = []

    def __init__(self, fn, inputs):
        self.replays = 0

    def replay(self, inputs):
        self.replays += 1

    def release(self):
        _Graphed.released.append(self)


@pytest.fixture
def fake_graphs(monkeypatch):
    """Captures that always succeed, on one rank; ``steady_ms`` is set per test."""
    _Graphed.released = []
    monkeypatch.setattr(tuning.graphs, "GraphedRun", _Graphed)
    monkeypatch.setattr(tuning, "slowest", lambda values, pg, device: values)


@pytest.mark.parametrize("graph_ms, kept", [(0.276, True), (0.36, False)])
def test_a_graph_is_kept_where_it_beats_eager_launches_plus_executes_host_time(fake_graphs, monkeypatch,
                                                                                graph_ms, kept):
    """Eager launches timed back to back leave out execute's own host time per call, which a replay hides:
    SP 1024x4096x16384 on 2x H200 timed a graph at 0.276 ms and eager launches at 0.249 ms, yet execute
    ran the plan eagerly in 0.358 ms. The graph is kept while it beats eager + ``EXECUTE_HOST_MS``."""
    monkeypatch.setattr(tuning, "steady_ms", lambda fn, iters, warmup, min_ms, pg, device: graph_ms)
    what, graphed, note = tuning._capture_if_faster({"": None}, [torch.ones(1)], eager_ms=0.249)
    assert (what, graphed is not None, bool(_Graphed.released)) == (("" if kept else None), kept, not kept)
    assert note == f"cuda graph {graph_ms:.3f} ms, eager 0.249 ms -> {'graph' if kept else 'eager'}"


def test_the_fastest_graph_is_kept_and_the_others_released(fake_graphs, monkeypatch):
    """A small plan with fused segments is captured as it is and with every segment sequential; the
    faster replay wins (here the fused one), the other graph is released at once."""
    times = iter([0.21, 0.25])  # fused plan, then the sequential one

    def steady_ms(fn, iters, warmup, min_ms, pg, device):
        fn()  # a replay of the graph being timed
        return next(times)
    monkeypatch.setattr(tuning, "steady_ms", steady_ms)
    what, graphed, note = tuning._capture_if_faster({"": None, " (every segment sequential)": None},
                                                    [torch.ones(1)], eager_ms=0.30)
    assert what == "" and graphed.replays == 1 and len(_Graphed.released) == 1
    assert _Graphed.released[0] is not graphed
    assert note == ("cuda graph 0.210 ms, cuda graph (every segment sequential) 0.250 ms, eager 0.300 ms "
                    "-> graph")


class _Plan:
    """Stands in for the Runner in the graph candidates: it holds the plan it would run."""

    def __init__(self, program):
        self.program = program


@pytest.mark.parametrize("peer_differs", [False, True])
def test_every_rank_captures_the_same_candidate_plans(monkeypatch, peer_differs):
    """The graph candidates are agreed over the world: here this rank ran both segments sequential and
    timed none of them so (its alternatives equal its plan), while a peer of another group may have
    chosen otherwise. Where any rank's alternative differs, every rank captures it too; where any rank
    keeps a fused segment in a plan over ``SMALL_PLAN_MS``, every rank stays eager."""
    program = _sp_mlp_program()
    fused = [i for i, seg in enumerate(program.segments) if seg.fused is not None]
    tuned = program.with_choices({i: SEQUENTIAL for i in fused}, cuda_graph=False, notes=())
    monkeypatch.setattr(tuning, "Runner", _Plan)
    peers = (lambda values, pg, device: [1.0] * len(values)) if peer_differs else (lambda values, pg, device: values)
    monkeypatch.setattr(tuning, "slowest", peers)
    mine = _Plan(tuned)
    small = tuning._graph_candidates(tuned, mine, fused, [], eager_ms=0.5)
    assert small[""] is mine
    assert set(small) == ({"", " (every segment sequential)", " (every timed segment fused)"} if peer_differs
                          else {""})
    large = tuning._graph_candidates(tuned, mine, fused, [], eager_ms=2.0)
    assert large is None if peer_differs else large == {"": mine}
