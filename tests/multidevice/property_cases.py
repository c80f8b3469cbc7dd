"""What the property tests (``test_properties*.py``) share. Hypothesis draws the case seeds (plain data),
derandomized, so alike on every rank; each rank rebuilds every case from its seed with ``random.Random``,
runs it, and the ranks compare outcomes after each case. A failing case reports its seed, so it can be
replayed (each file keeps the seeds that found bugs in its ``REGRESSIONS_*``)."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st

from tp_fusion import DeviceMesh, ParallelType
from tp_fusion.runtime import dist

# No shrinking: each rank would shrink on its own, and the ranks' collectives could fall out of step.
ONCE = settings(max_examples=1, deadline=None, derandomize=True, phases=(Phase.generate,),
                suppress_health_check=list(HealthCheck))
MESHES_4 = [[[0, 1], [2, 3]], [0, 1, 2, 3], [[0, 2], [1, 3]]]  # at world 4: a 2x2 mesh both ways round, a 1-D one


def seeds(n: int):
    """``n`` distinct case seeds."""
    return st.lists(st.integers(0, 2**31 - 1), min_size=n, max_size=n, unique=True)


def examples(default: int) -> int:
    """How many cases a test draws: ``TP_FUSION_PROPERTY_EXAMPLES`` where set (long runs off CI), else
    ``default`` (what CI runs)."""
    value = os.environ.get("TP_FUSION_PROPERTY_EXAMPLES")
    return int(value) if value else default


def agree(outcome: str, text: str, exact: bool = True) -> None:
    """Assert that every rank had the same outcome of a case (``text`` says which): the same string, or, where
    not ``exact``, every rank ran it ("ok") or every rank raised (a rank may name its own error rather than a
    peer's)."""
    if dist.is_initialized() and dist.world_size() > 1:
        outcomes = dist.gather_from_all(outcome)
        kinds = set(outcomes) if exact else {o == "ok" for o in outcomes}
        assert len(kinds) == 1, f"the ranks disagree: {outcomes}\n{text}"


def shard_randomly(tv, mesh, rng, reduced_p: float = 0.0) -> None:
    """Put ``tv`` on ``mesh``: replicated, or each mesh axis sharding a distinct dim that its size divides (an
    outer or, now and then, an inner piece of a split), or, with probability ``reduced_p``, the outer piece of a
    reduction axis r{K} (a pending sum on that mesh axis). ``rng`` (a ``random.Random``) makes every choice."""
    tv.set_device_mesh(mesh)
    shape, split = tv.shape, []
    for axis in reversed(range(mesh.ndim)):
        n = mesh.shape[axis]
        reduced = [i for i, ax in enumerate(tv._loop()) if ax.reduction and ax.piece == () and ax.extent % n == 0]
        if reduced_p and reduced and rng.random() < reduced_p:
            i = rng.choice(reduced)
            tv.outer_split(i, n)
            tv.axis(i).parallelize(ParallelType.for_mesh_axis(axis, mesh.ndim))
            continue
        dims = [d for d in range(tv.ndim) if d not in split and shape[d] % n == 0]
        if not dims or rng.random() < 0.3:
            continue
        d = rng.choice(dims)
        i = next(i for i, ax in enumerate(tv._loop()) if ax.dim == d and not ax.reduction)
        inner = rng.random() < 0.3 and shape[d] > n
        tv.split(i, n, inner_split=inner)
        tv.axis(i + inner).parallelize(ParallelType.for_mesh_axis(axis, mesh.ndim))
        split.append(d)


def with_meshes(seeds: list[int], meshes: list, regressions: list = ()) -> list:
    """The cases (seed, devices) of a test: the ``regressions`` first, then each seed with the next of ``meshes``
    in turn (devices None: a fusion without meshes)."""
    return [*regressions, *((s, meshes[i % len(meshes)]) for i, s in enumerate(seeds))]


def run_cases(run_case, rank: int, world: int, cases: list) -> None:
    """Each case on this rank, ``run_case(seed, rank, world, mesh)``. A case that gives one outcome (a str: "ok" or
    an error class) must give it on every rank; one that checks its own calls gives their list, or nothing."""
    for seed, devices in cases:
        outcome = run_case(seed, rank, world, None if devices is None else DeviceMesh(devices))
        if isinstance(outcome, str):
            agree(outcome, f"seed {seed} on {devices}")
