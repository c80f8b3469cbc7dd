"""A tensor's sharding: a mesh plus one placement per mesh axis (DTensor's model).

The user writes a sharding as a schedule on the loop domain (``outer_split`` + ``parallelize``);
``tp_fusion.tensor_view`` turns that schedule into this form, which rules, passes, the runtime and
the printer use. Placements are indexed by mesh axis (0 = outermost); ``mesh_x`` is the last axis.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tp_fusion.errors import ShardingError
from tp_fusion.mesh import DeviceMesh
from tp_fusion.types import ParallelType


@dataclass(frozen=True, slots=True)
class Shard:
    """The tensor dim ``dim`` is split evenly across the mesh axis (outer part = device index)."""

    dim: int

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True, slots=True)
class Replicate:
    """Every device of the mesh axis holds the whole tensor."""

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True, slots=True)
class Partial:
    """Each device holds a partial result; the value is the ``op``-reduction over the mesh axis."""

    op: str = "sum"

    def __str__(self) -> str:
        return f"P({self.op})"


Placement = Shard | Replicate | Partial
REPLICATE = Replicate()
PARTIAL_SUM = Partial()


@dataclass(frozen=True, slots=True)
class Sharding:
    """How a tensor lies on a mesh: one placement (``Shard``, ``Replicate``, ``Partial``) per mesh axis."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]

    def __post_init__(self):
        assert len(self.placements) == self.mesh.ndim, (self.mesh, self.placements)

    @staticmethod
    def replicated(mesh: DeviceMesh) -> Sharding:
        """Replicated on every axis of ``mesh``."""
        return Sharding(mesh, (REPLICATE,) * mesh.ndim)

    def with_placement(self, axis: int, placement: Placement) -> Sharding:
        """The same sharding with ``placement`` on mesh axis ``axis``."""
        p = list(self.placements)
        p[axis] = placement
        return Sharding(self.mesh, tuple(p))

    @property
    def is_replicated(self) -> bool:
        """Whether every mesh axis replicates."""
        return all(isinstance(p, Replicate) for p in self.placements)

    @property
    def has_partial(self) -> bool:
        """Whether some mesh axis holds partial sums."""
        return any(isinstance(p, Partial) for p in self.placements)

    def num_device_axes(self) -> int:
        """How many mesh axes shard or hold partials."""
        return sum(not isinstance(p, Replicate) for p in self.placements)

    def axis_sharded_on(self, ptype: ParallelType) -> int:
        """The tensor dim sharded on ``ptype``'s mesh axis, or -1 (replicated, partial or absent)."""
        axis = ptype.mesh_axis(self.mesh.ndim)
        if axis < 0 or not isinstance(self.placements[axis], Shard):
            return -1
        return self.placements[axis].dim

    def dim_factor(self, dim: int) -> int:
        """How many pieces ``dim`` is split into across the mesh."""
        f = 1
        for extent, p in zip(self.mesh.shape, self.placements):
            if p == Shard(dim):
                f *= extent
        return f

    def local_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """A device's shard shape of a tensor of global ``shape``."""
        return tuple(-1 if e < 0 else e // self.dim_factor(d) for d, e in enumerate(shape))

    def global_shape(self, local_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The global shape of a tensor whose shards have ``local_shape``."""
        return tuple(e * self.dim_factor(d) for d, e in enumerate(local_shape))

    def check_divides(self, shape: tuple[int, ...], what: str) -> None:
        """ShardingError, naming ``what``, unless every sharded dim of ``shape`` splits evenly."""
        for axis, p in enumerate(self.placements):
            if isinstance(p, Shard):
                if p.dim >= len(shape):
                    raise ShardingError(f"{what}: mesh axis {axis} shards dim {p.dim}, but the tensor has "
                                        f"{len(shape)} dims {list(shape)}")
                n = shape[p.dim]
                if n >= 0 and n % self.dim_factor(p.dim) != 0:
                    raise ShardingError(
                        f"{what}: dim {p.dim} of extent {n} does not split evenly across "
                        f"{self.dim_factor(p.dim)} devices; pad it to a multiple or shard another dim")

    def local_index(self, rank: int, dim: int) -> tuple[int, int]:
        """(index, count) of ``rank``'s piece of ``dim``, outer mesh axes outermost."""
        coords = self.mesh.coords(rank)
        idx, count = 0, 1
        for axis, (extent, p) in enumerate(zip(self.mesh.shape, self.placements)):
            if p == Shard(dim):
                idx, count = idx * extent + coords[axis], count * extent
        return idx, count

    def loop_axes_str(self, shape: tuple[int, ...]) -> str:
        """The loop domain this sharding implies, e.g. ``[16, mesh_x{2}, 32]``."""
        parts = []
        for d, e in enumerate(shape):
            axes = [a for a, p in enumerate(self.placements) if p == Shard(d)]
            for a in axes:
                parts.append(f"{ParallelType.for_mesh_axis(a, self.mesh.ndim).value}{{{self.mesh.shape[a]}}}")
            parts.append("?" if e < 0 else str(e // self.dim_factor(d)))
        return "[" + ", ".join(parts) + "]"

    def partial_str(self) -> str:
        """`` partial(sum: mesh_x)`` for printing, or empty when nothing is partial."""
        axes = [ParallelType.for_mesh_axis(a, self.mesh.ndim).value
                for a, p in enumerate(self.placements) if isinstance(p, Partial)]
        return f" partial(sum: {', '.join(axes)})" if axes else ""

    def __str__(self) -> str:
        return f"{self.mesh.short()}({', '.join(map(str, self.placements))})"


def _sharding_of(tv_or_sharding) -> Sharding | None:
    return tv_or_sharding if isinstance(tv_or_sharding, Sharding) else tv_or_sharding.sharding


def shard_tensor(full: torch.Tensor, tv_or_sharding, rank: int | None = None) -> torch.Tensor:
    """The local shard of ``full`` that ``rank`` (default: this rank) holds under the sharding of a
    TensorView or a Sharding. Partial placements hold the full value on mesh index 0 and zeros
    elsewhere. A rank outside the mesh holds an empty tensor."""
    from tp_fusion.runtime import dist

    sharding = _sharding_of(tv_or_sharding)
    if sharding is None:
        return full.clone()
    rank = dist.rank() if rank is None else rank
    if rank not in sharding.mesh:
        return full.new_empty((0,))
    sharding.check_divides(tuple(full.shape), "shard_tensor")
    out = full
    for d in range(full.dim()):
        idx, count = sharding.local_index(rank, d)
        if count > 1:
            out = out.chunk(count, dim=d)[idx]
    coords = sharding.mesh.coords(rank)
    if any(isinstance(p, Partial) and coords[a] != 0 for a, p in enumerate(sharding.placements)):
        return torch.zeros_like(out)
    return out.contiguous().clone()


def unshard_tensor(pieces: dict[int, torch.Tensor], sharding: Sharding) -> torch.Tensor:
    """Reassemble the full tensor from every mesh rank's local shard (for tests and validation)."""
    mesh = sharding.mesh
    any_piece = next(iter(pieces.values()))
    full_shape = sharding.global_shape(tuple(any_piece.shape))
    out = any_piece.new_zeros(full_shape)
    seen = set()
    for rank in mesh.devices:
        sl = []
        for d in range(len(full_shape)):
            idx, count = sharding.local_index(rank, d)
            n = full_shape[d] // count
            sl.append(slice(idx * n, (idx + 1) * n))
        key = tuple((s.start, s.stop) for s in sl)
        coords = mesh.coords(rank)
        if sharding.has_partial:
            if all(c == 0 for c, p in zip(coords, sharding.placements) if isinstance(p, Replicate)):
                out[tuple(sl)] += pieces[rank]
        elif key not in seen:
            out[tuple(sl)] = pieces[rank]
        seen.add(key)
    return out
