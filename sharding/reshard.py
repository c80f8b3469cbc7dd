"""The resharding table: how a tensor goes from one sharding to another, as typed steps.

Per mesh axis (DTensor's redistribute table, nvFuser's ``CommunicationType``):

============================  =======================================================
Shard(i) -> Replicate         ``ALLGATHER``
Partial  -> Replicate         ``ALLREDUCE`` (with the Partial's op: sum, max, min or prod)
Partial  -> Shard(i)          ``REDUCE_SCATTER``
Shard(i) -> Shard(j)          ``ALL_TO_ALL`` (i != j; on one dim at another place:
                              ``ALLGATHER`` then ``LOCAL_SLICE``)
Replicate -> Shard(i)         ``LOCAL_SLICE`` (no communication)
Replicate -> Partial          ``TO_PARTIAL`` (local: ``Partial.of_whole``, e.g. zeros off index 0)
Shard(i) -> Partial           ``ALLGATHER`` then ``TO_PARTIAL``
Partial(a) -> Partial(b)      ``ALLREDUCE`` then ``TO_PARTIAL`` (two reductions, e.g. max then sum)
============================  =======================================================

A change on several mesh axes becomes a sequence: free local steps first (less data to move
afterwards), then reduce-scatters (the same), then the rest (a pending reduction made whole on several
axes: one ``ALLREDUCE`` over them together); a step that would shard a piece of a dim that another mesh axis shards
waits, and if every remaining step waits, one axis is gathered first. A mesh axis of size 1 needs no
step at all: every placement on it holds the whole value. Nothing moves where each device of the
destination holds its piece already (``held_already``: e.g. a replicated value kept on some of its
own devices). Otherwise, between a 1-D mesh and one of its devices, only that device's share moves:
``GATHER`` (shards into it), ``REDUCE`` (partial sums into it) or ``SCATTER`` (shards out of it).
Onto some of the source mesh's own devices that hold the whole value once its pending sums are summed,
nothing moves between the meshes: the sums run on the source mesh, ``KEEP`` (a local copy) relabels the
value onto the destination mesh, local slices shard it. Else a change of mesh moves the data with
``SEND_RECV`` (meshes of one shape, placements kept), or gathers it whole on the source mesh and
keeps it (destination devices all in the source mesh) or ``BROADCAST``s it (otherwise, from the
source mesh's first device), with same-mesh steps before and after.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

import torch
from tp_fusion.sharding.sharding import REPLICATE, Partial, Placement, Replicate, Shard, Sharding

from tp_fusion.errors import LoweringError, ShardingError
from tp_fusion.mesh import DeviceMesh, as_axes


class Collective(enum.Enum):
    """What one resharding step runs; ``value`` is the op kind it lowers to."""

    ALLGATHER = "allgather"
    REDUCE_SCATTER = "reduce_scatter"
    ALLREDUCE = "allreduce"
    ALL_TO_ALL = "all_to_all"
    SEND_RECV = "send_recv"
    BROADCAST = "broadcast"
    GATHER = "gather"
    REDUCE = "reduce"
    SCATTER = "scatter"
    LOCAL_SLICE = "local_slice"
    TO_PARTIAL = "to_partial"
    KEEP = "set"  # onto another mesh whose devices hold the value already: a local copy

    @property
    def communicates(self) -> bool:
        return self not in (Collective.LOCAL_SLICE, Collective.TO_PARTIAL, Collective.KEEP)


@dataclass(frozen=True, slots=True)
class ReshardStep:
    """One step of a resharding. Same-mesh steps act on ``mesh_axis`` (an allreduce on several axes at
    once: a tuple of them); ``src``/``dst`` are that axis's placements before and after. Moves between
    meshes (``SEND_RECV``, ``BROADCAST``) have ``mesh_axis`` None and carry both meshes. ``after`` is the
    whole sharding once the step ran."""

    collective: Collective
    mesh_axis: int | tuple[int, ...] | None
    src: Placement | None
    dst: Placement | None
    after: Sharding
    src_mesh: DeviceMesh | None = None
    dst_mesh: DeviceMesh | None = None
    src_outer: int = 1  # the local ``outer`` of a Shard src before the step (Sharding.local_outer)
    dst_outer: int = 1  # the same of a Shard dst after it

    def attrs(self) -> dict:
        """The attributes of the op this step lowers to; ``outer``/``src_outer`` (a strided shard: the
        collective chunks the dim viewed as [outer, devices, rest]) only where they are not 1, and
        ``reduce_op`` (how partials combine) only where it is not a sum."""
        if self.collective is Collective.KEEP:
            return {}
        partial = next((p for p in (self.src, self.dst) if isinstance(p, Partial)), None)
        out = {"reduce_op": partial.op} if partial is not None and partial.op != "sum" else {}
        if self.mesh_axis is None:  # a move between meshes; GATHER and SCATTER also chunk a dim
            out |= {"src_mesh": self.src_mesh, "dst_mesh": self.dst_mesh}
            shard, outer = (self.src, self.src_outer) if isinstance(self.src, Shard) else (self.dst, self.dst_outer)
            if isinstance(shard, Shard):
                out |= {"dim": shard.dim} | ({"outer": outer} if outer != 1 else {})
            return out
        out |= {"mesh_axis": self.mesh_axis}
        match self.src, self.dst:
            case Shard(), Shard():
                out |= {"src_dim": self.src.dim, "dim": self.dst.dim}
                out |= {"src_outer": self.src_outer} if self.src_outer != 1 else {}
                out |= {"outer": self.dst_outer} if self.dst_outer != 1 else {}
            case Shard(), _:
                out |= {"dim": self.src.dim} | ({"outer": self.src_outer} if self.src_outer != 1 else {})
            case _, Shard():
                out |= {"dim": self.dst.dim} | ({"outer": self.dst_outer} if self.dst_outer != 1 else {})
        return out


_TABLE = {
    (Shard, Replicate): Collective.ALLGATHER,
    (Partial, Replicate): Collective.ALLREDUCE,
    (Partial, Shard): Collective.REDUCE_SCATTER,
    (Shard, Shard): Collective.ALL_TO_ALL,
    (Replicate, Shard): Collective.LOCAL_SLICE,
    (Replicate, Partial): Collective.TO_PARTIAL,
}


def step_collective(src: Placement, dst: Placement) -> Collective | None:
    """The one-axis step from ``src`` to ``dst`` (None: no single step, e.g. Shard -> Partial, which
    ``same_mesh_steps`` gathers first)."""
    return _TABLE.get((type(src), type(dst)))


def is_free(src: Placement, dst: Placement) -> bool:
    """A transition that needs no communication: none, or a local slice of a replicated value."""
    return src == dst or (isinstance(src, Replicate) and isinstance(dst, Shard))


def is_local(src: Placement, dst: Placement) -> bool:
    """A transition that moves nothing between devices: ``is_free``, or a replicated value made a pending
    sum (``TO_PARTIAL``: each device keeps the value or the reduction's identity). What a move costs is
    priced by this; ``is_free`` also promises that no work is done."""
    return is_free(src, dst) or isinstance(src, Replicate) and isinstance(dst, Partial)


def local_between(src: Sharding, dst: Sharding) -> bool:
    """Whether ``dst`` is reached from ``src`` on the same mesh with no communication (``is_local`` on
    every mesh axis)."""
    return src.mesh == dst.mesh and all(is_local(a, b) for a, b in zip(src.placements, dst.placements))


def free_between(src: Sharding, dst: Sharding) -> bool:
    """Whether ``dst`` is reached from ``src`` on the same mesh with no communication (``is_free`` on every
    mesh axis)."""
    return src.mesh == dst.mesh and all(is_free(a, b) for a, b in zip(src.placements, dst.placements))


def gathered(src: Sharding, dst: Sharding) -> bool:
    """Whether ``dst`` is ``src`` on the same mesh with some mesh axes gathered (each placement kept or
    Replicate, no pending sum): what a view of ``src`` can read instead, keeping the rest of its sharding."""
    return src.mesh == dst.mesh and not dst.has_partial and all(
        a == b or isinstance(b, Replicate) for a, b in zip(src.placements, dst.placements))


def on_own_devices(src: Sharding, dst: Sharding) -> bool:
    """Whether every device of ``dst``'s mesh is one of ``src``'s (then a value whole on ``src`` needs no
    communication to reach ``dst``)."""
    return set(dst.mesh.devices) <= set(src.mesh.devices)


def _trivial_axes(s: Sharding) -> Sharding:
    """``s`` with every placement on a mesh axis of size 1 replaced by Replicate (they are equal)."""
    if all(n > 1 for n in s.mesh.shape):
        return s
    return Sharding(s.mesh, tuple(REPLICATE if n == 1 else p for n, p in zip(s.mesh.shape, s.placements)))


# The order of a change on several mesh axes: free local slices first, then reductions that scatter (each leaves
# a piece of the payload for the steps after it: a pending sum on both axes of a 2x2 mesh, wanted sharded on one
# and whole on the other, is reduce-scattered, then allreduced at half its size), then the rest.
_PHASES = (lambda a, b: isinstance(a, Replicate),
           lambda a, b: isinstance(a, Partial) and isinstance(b, Shard),
           lambda a, b: True)


def same_mesh_steps(src: Sharding, dst: Sharding, what: str) -> list[ReshardStep]:
    """The steps from ``src`` to ``dst`` on one mesh (see the module docstring)."""
    src, dst = _trivial_axes(src), _trivial_axes(dst)
    cur, steps = list(src.placements), []
    while cur != list(dst.placements):
        progressed = False
        for phase in _PHASES:
            for axis in reversed(range(len(cur))):
                a, b = cur[axis], dst.placements[axis]
                if a == b or not phase(a, b):
                    continue
                if isinstance(a, Shard) and (isinstance(b, Partial) or isinstance(b, Shard) and a.dim == b.dim) \
                        or isinstance(a, Partial) and isinstance(b, Partial):
                    b = REPLICATE  # gather or reduce now; slice or go partial (another reduction) on the next pass
                if isinstance(b, Shard) and not Sharding(src.mesh, (*cur[:axis], b, *cur[axis + 1:])).nests(b.dim):
                    continue  # would overlap another axis' piece of b.dim: wait for it to let go
                collective = step_collective(a, b)
                if collective is None:
                    raise LoweringError(f"{what}: cannot reshard {src} -> {dst}: no lowering for {a} -> {b} "
                                        f"on mesh axis {axis}")
                steps.append(_step(collective, axis, cur, b, src.mesh))
                progressed = True
        if not progressed:  # every step waits on another: gather one axis first
            axis = next((a for a in reversed(range(len(cur)))
                         if cur[a] != dst.placements[a] and not isinstance(cur[a], Replicate)), None)
            if axis is None:  # only slices are left, and each overlaps another axis' piece
                raise LoweringError(f"{what}: cannot reshard {src} -> {dst}: {dst} shards a dim on mesh axes "
                                    "whose pieces overlap")
            steps.append(_step(step_collective(cur[axis], REPLICATE), axis, cur, REPLICATE, src.mesh))
    return _joined_allreduces(steps)


def _joined_allreduces(steps: list[ReshardStep]) -> list[ReshardStep]:
    """``steps`` with each run of allreduces of one reduction on several mesh axes made one allreduce over
    those axes together: a ring over n devices sends 2(n-1)/n of the payload, one ring per axis the sum of
    theirs (2x2: 1.5x against 2x; 2x4: 1.75x against 2.5x), in fewer collectives."""
    out: list[ReshardStep] = []
    for step in steps:
        last = out[-1] if out else None
        if last is not None and step.collective is last.collective is Collective.ALLREDUCE and step.src == last.src:
            axes = tuple(sorted((*as_axes(last.mesh_axis), step.mesh_axis)))
            out[-1] = dataclasses.replace(last, mesh_axis=axes, after=step.after)
        else:
            out.append(step)
    return out


def _step(collective: Collective, axis: int, cur: list, b: Placement, mesh: DeviceMesh) -> ReshardStep:
    """The step that sets mesh axis ``axis`` of ``cur`` to ``b`` (``cur`` is updated)."""
    before = Sharding(mesh, tuple(cur))
    a, cur[axis] = cur[axis], b
    after = Sharding(mesh, tuple(cur))
    return ReshardStep(collective, axis, a, b, after,
                       src_outer=before.local_outer(axis) if isinstance(a, Shard) else 1,
                       dst_outer=after.local_outer(axis) if isinstance(b, Shard) else 1)


def reshard_steps(src: Sharding, dst: Sharding, shape: tuple[int, ...], what: str) -> list[ReshardStep]:
    """Every step from ``src`` to ``dst`` of a tensor of global ``shape``, on one mesh or between meshes;
    none where the devices of ``dst`` hold their pieces already (``held_already``). Raises
    LoweringError where the table has no way."""
    if held_already(src, dst, shape):
        return []
    if src.mesh == dst.mesh:
        return same_mesh_steps(src, dst, what)
    one = _one_device_move(src, dst)
    if one is not None:
        return [one]

    before, move, landed = _hop(src, dst, shape)  # src -> before on src's mesh; move to landed; -> dst there
    hop = ReshardStep(move, None, None, None, landed, src.mesh, dst.mesh)
    return same_mesh_steps(src, before, what) + [hop] + same_mesh_steps(landed, dst, what)


def _hop(src: Sharding, dst: Sharding, shape: tuple[int, ...]) -> tuple[Sharding, Collective, Sharding]:
    """How a move between two meshes leaves ``src``'s mesh: the sharding there it leaves from, the
    collective that moves it, and the sharding it lands in on ``dst``'s mesh."""
    summed, whole_dst = src.materialized(), Sharding.replicated(dst.mesh)
    own_devices = on_own_devices(src, dst)
    if own_devices and held_already(summed, whole_dst, shape):
        return summed, Collective.KEEP, whole_dst  # pending sums summed where they are, then kept
    if src.mesh.shape == dst.mesh.shape and not (own_devices and dst.is_replicated):  # placements kept
        scattered = _scattered(src, dst, shape)
        return scattered, Collective.SEND_RECV, Sharding(dst.mesh, scattered.placements)
    return Sharding.replicated(src.mesh), Collective.KEEP if own_devices else Collective.BROADCAST, whole_dst


def _scattered(src: Sharding, dst: Sharding, shape: tuple[int, ...]) -> Sharding:
    """``src`` with its pending sums summed into shards where the pieces divide (else whole): what it sends to a
    mesh of its shape. A stage's partial activation is reduce-scattered, its pieces sent and, where the next
    stage wants it whole, gathered there (Megatron's scatter-gather between pipeline stages): a reduce-scatter,
    a send and an allgather of P/n each, against an allreduce of 2P(n-1)/n and a send of P. On each such mesh
    axis the piece is the one ``dst`` holds there, else one of the largest dim no other axis shards."""
    placements = list(src.placements)
    for axis, p in enumerate(src.placements):
        if not isinstance(p, Partial):
            continue
        sharded = {q.dim for q in placements if isinstance(q, Shard)}
        free = sorted((d for d in range(len(shape)) if d not in sharded), key=lambda d: -shape[d])
        wants = [dst.placements[axis]] if isinstance(dst.placements[axis], Shard) else []
        placements[axis] = REPLICATE
        for want in wants + [Shard(d) for d in free]:
            trial = Sharding(src.mesh, (*placements[:axis], want, *placements[axis + 1:]))
            if shape[want.dim] >= 0 and trial.nests(want.dim) and shape[want.dim] % trial.dim_factor(want.dim) == 0:
                placements[axis] = want
                break
    return Sharding(src.mesh, tuple(placements))


def departure(src: Sharding, dst: Sharding, shape: tuple[int, ...]) -> Sharding | None:
    """The sharding on ``src``'s mesh that ``reshard_steps`` brings a tensor to before it moves to ``dst``'s
    mesh (so the moves of one tensor to several meshes share those steps); None where it stays on one mesh,
    moves in one step, or need not move."""
    if src.mesh == dst.mesh or held_already(src, dst, shape) or _one_device_move(src, dst) is not None:
        return None
    return _hop(src, dst, shape)[0]


def _one_device_move(src: Sharding, dst: Sharding) -> ReshardStep | None:
    """The one step between a 1-D mesh and one of its devices (nvFuser's Gather, Reduce and Scatter):
    that device gathers the shards or reduces the partial sums, or scatters the shards; None elsewhere."""
    if dst.mesh.size == 1 and src.mesh.ndim == 1 and dst.mesh.devices[0] in src.mesh:
        p, outer = src.placements[0], 1
        if isinstance(p, Shard):
            collective, outer = Collective.GATHER, src.local_outer(0)
        elif isinstance(p, Partial):
            collective = Collective.REDUCE
        else:
            return None
        return ReshardStep(collective, None, p, REPLICATE, Sharding.replicated(dst.mesh), src.mesh, dst.mesh,
                           src_outer=outer)
    if src.mesh.size == 1 and dst.mesh.ndim == 1 and src.mesh.devices[0] in dst.mesh \
            and isinstance(dst.placements[0], Shard):
        return ReshardStep(Collective.SCATTER, None, REPLICATE, dst.placements[0], dst, src.mesh, dst.mesh,
                           dst_outer=dst.local_outer(0))
    return None


def held_already(src: Sharding, dst: Sharding, shape: tuple[int, ...]) -> bool:
    """Whether every device of ``dst`` already holds its piece of a tensor of global ``shape`` under
    ``src``: the shardings differ at most on size-1 mesh axes, or (neither holding partial values)
    each device of ``dst`` is in ``src``'s mesh and holds the same indices of every dim there, e.g. a
    replicated value kept on some of its own devices, or a 1-D mesh's shards on a 2x1 mesh of its
    devices. The ``set`` between them stays a local copy."""
    if src.mesh == dst.mesh and _trivial_axes(src) == _trivial_axes(dst):
        return True
    if src.has_partial or dst.has_partial or any(e < 0 for e in shape) \
            or not set(dst.mesh.devices) <= set(src.mesh.devices):
        return False
    try:
        return all(torch.equal(src.local_indices(r, d, n), dst.local_indices(r, d, n))
                   for r in dst.mesh.devices for d, n in enumerate(shape))
    except ShardingError:  # a piece that does not divide: lowering reports it
        return False
