"""A tensor's sharding: a mesh plus one placement per mesh axis (DTensor's model).

The user writes a sharding as a schedule on the loop domain (``outer_split`` + ``parallelize``);
``tp_fusion.tensor_view`` turns that schedule into this form, which rules, passes, the runtime and
the printer use. Placements are indexed by mesh axis (0 = outermost); ``mesh_x`` is the last axis.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch

from tp_fusion.errors import InputError, ShardingError
from tp_fusion.mesh import DeviceMesh
from tp_fusion.types import ParallelType


@dataclass(frozen=True, slots=True)
class Shard:
    """The tensor dim ``dim`` is split evenly across the mesh axis. ``outer`` places the device piece
    in the dim: the dim is viewed as ``[outer, devices, rest]`` and the device index picks the middle
    (1: the outermost piece, a plain block shard; more: a strided shard; -1: not known until a
    symbolic extent is bound). ``outer`` counts the dim's pieces outside this one in the GLOBAL dim,
    so two mesh axes may shard one dim at different places (e.g. context and tensor parallel)."""

    dim: int
    outer: int = 1

    def __str__(self) -> str:
        return f"S({self.dim})" if self.outer == 1 else f"S({self.dim}, outer={self.outer})"


@dataclass(frozen=True, slots=True)
class Replicate:
    """Every device of the mesh axis holds the whole tensor."""

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True, slots=True)
class Partial:
    """Each device holds a partial result; the value is the ``op``-reduction over the mesh axis: ``sum``
    (a GEMM's contraction, a sum or mean over a sharded dim), or ``max``, ``min``, ``prod`` (those
    reductions over a sharded dim)."""

    op: str = "sum"

    def __post_init__(self):
        if self.op not in _COMBINE:
            raise ShardingError(f"Partial({self.op!r}): the reduction must be one of {', '.join(_COMBINE)}")

    def __str__(self) -> str:
        return f"P({self.op})"

    def combine(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """Two devices' partials reduced into one."""
        return _COMBINE[self.op](a, b)

    def of_whole(self, x: torch.Tensor, index: int) -> torch.Tensor:
        """What the device at ``index`` of the mesh axis holds of the whole value ``x`` as a partial: ``x``
        on index 0 and the reduction's identity elsewhere (zeros for sum, ones for prod); ``x`` everywhere
        for max and min (a value reduced with itself is itself)."""
        if index == 0 or self.op in ("max", "min"):
            return x
        return torch.zeros_like(x) if self.op == "sum" else torch.ones_like(x)


_COMBINE = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum, "prod": torch.mul}


Placement = Shard | Replicate | Partial
REPLICATE = Replicate()
PARTIAL_SUM = Partial()


@dataclass(frozen=True, slots=True)
class Sharding:
    """How a tensor lies on a mesh: one placement (``Shard``, ``Replicate``, ``Partial``) per mesh axis.
    ``mesh`` None (``Sharding.unsharded()``): a tensor of a fusion without meshes, whole on every process
    (nvFuser's Sharding of an empty mesh); only ``fd.output_shardings()`` hands these out."""

    mesh: DeviceMesh | None
    placements: tuple[Placement, ...]

    def __post_init__(self):
        assert len(self.placements) == (0 if self.mesh is None else self.mesh.ndim), (self.mesh, self.placements)

    @staticmethod
    def unsharded() -> Sharding:
        """The sharding of a tensor without a mesh: ``axis_sharded_on`` is -1, ``shard_tensor`` the whole."""
        return Sharding(None, ())

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

    def materialized(self) -> Sharding:
        """This sharding with every pending sum done (Partial -> Replicate)."""
        return Sharding(self.mesh, tuple(REPLICATE if isinstance(p, Partial) else p for p in self.placements))

    def num_device_axes(self) -> int:
        """How many mesh axes shard or hold partials."""
        return sum(not isinstance(p, Replicate) for p in self.placements)

    def axis_sharded_on(self, ptype: ParallelType) -> int:
        """The tensor dim sharded on ``ptype``'s mesh axis, or -1 (replicated, partial or absent)."""
        if not ptype.is_device:
            raise ShardingError(f"axis_sharded_on({ptype}): pass a device type (mesh_x, mesh_y or mesh_z); "
                                "no dim is sharded on a serial axis")
        axis = -1 if self.mesh is None else ptype.mesh_axis(self.mesh.ndim)
        if axis < 0 or not isinstance(self.placements[axis], Shard):
            return -1
        return self.placements[axis].dim

    def dim_factor(self, dim: int) -> int:
        """How many pieces ``dim`` is split into across the mesh."""
        f = 1
        for extent, p in zip(self.mesh.shape, self.placements):
            if isinstance(p, Shard) and p.dim == dim:
                f *= extent
        return f

    def dim_shards(self, dim: int) -> list[tuple[int, Shard]]:
        """The (mesh axis, Shard) pairs that shard ``dim``, outermost piece first. Two pieces start at the
        same ``outer`` only where the outer one has extent 1: a mesh axis of size 1 goes first."""
        return sorted(((a, p) for a, p in enumerate(self.placements) if isinstance(p, Shard) and p.dim == dim),
                      key=lambda ap: (ap[1].outer, self.mesh.shape[ap[0]] != 1, ap[0]))

    def dim_view(self, dim: int, n: int) -> list[tuple[int, int | None]]:
        """``dim`` of global extent ``n`` as pieces ``(extent, mesh axis or None)``, outermost first:
        each device piece is indexed by its mesh axis' coordinate, the others are kept whole."""
        if any(p.outer < 0 for _, p in self.dim_shards(dim)):
            raise ShardingError(f"dim {dim}: the place of its shard in {self} depends on a symbolic extent; bind it "
                                "first (shard the TensorView with a full tensor)")
        if not self.nests(dim):
            raise ShardingError(f"dim {dim}: two mesh axes of {self} shard overlapping pieces of it; give each mesh "
                                "axis its own piece of the dim")
        view, done = [], 1  # done: the product of the pieces placed so far
        for axis, p in self.dim_shards(dim):
            view += [(p.outer // done, None), (self.mesh.shape[axis], axis)]
            done = p.outer * self.mesh.shape[axis]
        if n % done != 0:
            raise ShardingError(f"dim {dim} of extent {n} does not split into {done} pieces as {self} needs; pad it "
                                "to a multiple or shard another dim")
        view.append((n // done, None))
        return [(e, a) for e, a in view if e != 1 or a is not None]

    def nests(self, dim: int) -> bool:
        """Whether the mesh axes that shard ``dim`` take disjoint pieces of it: each piece lies inside
        the rest of the ones outside it (its ``outer`` is a multiple of theirs times their size)."""
        done = 1
        for axis, p in self.dim_shards(dim):
            if p.outer % done != 0:
                return False
            done = p.outer * self.mesh.shape[axis]
        return True

    def local_outer(self, axis: int) -> int:
        """The ``outer`` of mesh axis ``axis``'s Shard in the LOCAL tensor, where the other mesh axes that
        shard pieces outside it have already taken their piece: what a collective on ``axis`` chunks by."""
        p = self.placements[axis]
        outer = p.outer
        for other, q in self.dim_shards(p.dim):
            if other != axis and q.outer < p.outer:
                outer //= self.mesh.shape[other]
        return outer

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

    def local_piece(self, x: torch.Tensor, rank: int, dim: int) -> torch.Tensor:
        """``rank``'s piece of ``x``'s ``dim`` (global extent); a view where possible."""
        view = self.dim_view(dim, x.shape[dim])
        if all(axis is None for _, axis in view):
            return x
        coords = self.mesh.coords(rank)
        out = x.unflatten(dim, [e for e, _ in view])
        for i in reversed(range(len(view))):
            if view[i][1] is not None:
                out = out.narrow(dim + i, coords[view[i][1]], 1)
        return out.flatten(dim, dim + len(view) - 1)

    def local_indices(self, rank: int, dim: int, n: int) -> torch.Tensor:
        """The global indices along ``dim`` (of extent ``n``) of ``rank``'s piece; none for a rank outside the
        mesh (it holds no piece: a lookup of a table sharded on one pipeline stage, localized on the ranks of
        another, which run nothing of it)."""
        if rank not in self.mesh:
            return torch.arange(0)
        return self.local_piece(torch.arange(n).view((1,) * dim + (n,)), rank, dim).flatten()

    def loop_axes_str(self, shape: tuple[int, ...]) -> str:
        """The loop domain this sharding implies, e.g. ``[16, mesh_x{2}, 32]``: the device pieces and
        the local extent of the rest (for a strided shard, the pieces around it)."""
        parts = []
        for d, e in enumerate(shape):
            shards = self.dim_shards(d)
            if e < 0 or all(p.outer == 1 for _, p in shards):
                for a, _ in shards:
                    parts.append(f"{ParallelType.for_mesh_axis(a, self.mesh.ndim).value}{{{self.mesh.shape[a]}}}")
                parts.append("?" if e < 0 else str(e // self.dim_factor(d)))
                continue
            for extent, a in self.dim_view(d, e):
                parts.append(str(extent) if a is None else
                             f"{ParallelType.for_mesh_axis(a, self.mesh.ndim).value}{{{extent}}}")
        return "[" + ", ".join(parts) + "]"

    def partial_str(self) -> str:
        """`` partial(sum: mesh_x)`` for printing (one entry per reduction), or empty when nothing is partial."""
        axes: dict[str, list[str]] = {}
        for a, p in enumerate(self.placements):
            if isinstance(p, Partial):
                axes.setdefault(p.op, []).append(ParallelType.for_mesh_axis(a, self.mesh.ndim).value)
        return "".join(f" partial({op}: {', '.join(names)})" for op, names in axes.items())

    def __str__(self) -> str:
        if self.mesh is None:
            return "unsharded"
        return f"{self.mesh.short()}({', '.join(map(str, self.placements))})"


def _sharding_of(tv_or_sharding, shape: tuple[int, ...]) -> Sharding | None:
    """A Sharding as it is; a TensorView's sharding bound to ``shape`` and materialized: what the rank
    holds of its value once any pending sum is done (what ``execute`` returns for an output)."""
    if isinstance(tv_or_sharding, Sharding):
        return tv_or_sharding
    if not hasattr(tv_or_sharding, "bound_sharding"):
        raise InputError(f"shard_tensor: expected a TensorView (or a Sharding, e.g. fd.output_shardings()[i]) to "
                         f"shard by, got {tv_or_sharding!r}")
    return tv_or_sharding.bound_sharding(shape)


def _check_shard_arguments(full, rank) -> None:
    """``shard_tensor``'s arguments of the wrong kind, as ``InputError``s that say what to pass."""
    if not isinstance(full, torch.Tensor):
        hint = "; torch.from_numpy(full) converts a numpy array" if type(full).__module__ == "numpy" else ""
        raise InputError(f"shard_tensor: full must be a torch.Tensor (the whole, unsharded value), got "
                         f"{type(full).__module__}.{type(full).__qualname__}{hint}")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, numbers.Integral) or rank < 0):
        raise InputError(f"shard_tensor: rank must be a rank of the process group (an int >= 0), or None for this "
                         f"rank, got {rank!r}")


def shard_tensor(full: torch.Tensor, tv_or_sharding, rank: int | None = None) -> torch.Tensor:
    """The local shard of ``full`` that ``rank`` (default: this rank) holds under the sharding of a
    TensorView or a Sharding. Given a Sharding, a Partial placement holds the full value on mesh index 0
    and its reduction's identity elsewhere (``Partial.of_whole``); given a TensorView, a pending sum (a
    device-parallel reduction axis) is done, as in nvFuser, and the shard is laid out as ``define_tensor``
    declared it (``stride_order``). A rank outside the mesh holds an empty tensor."""
    from tp_fusion.ops import with_stride_order
    from tp_fusion.runtime import dist

    _check_shard_arguments(full, rank)
    sharding = _sharding_of(tv_or_sharding, tuple(full.shape))
    order = getattr(tv_or_sharding, "stride_order", None)  # a TensorView's declared layout: the shard has it
    if sharding is None or sharding.mesh is None:
        return (full if order is None else with_stride_order(full, order)).clone()
    rank = dist.rank() if rank is None else rank
    if rank not in sharding.mesh:
        return full.new_empty((0,))
    sharding.check_divides(tuple(full.shape), "shard_tensor")
    out = full
    for d in range(full.dim()):
        out = sharding.local_piece(out, rank, d)
    out = (out.contiguous() if order is None else with_stride_order(out, order)).clone()  # (clone keeps strides)
    for index, p in zip(sharding.mesh.coords(rank), sharding.placements):
        if isinstance(p, Partial):
            out = p.of_whole(out, index)
    return out


def unshard_tensor(pieces: dict[int, torch.Tensor], sharding: Sharding) -> torch.Tensor:
    """Reassemble the full tensor from every mesh rank's local shard (for tests and validation)."""
    mesh = sharding.mesh
    any_piece = next(iter(pieces.values()))
    full_shape = sharding.global_shape(tuple(any_piece.shape))
    out = any_piece.new_zeros(full_shape)
    partial = {p for p in sharding.placements if isinstance(p, Partial)}
    if len(partial) > 1:
        raise ShardingError(f"unshard_tensor: {sharding} holds partials of several reductions, whose order matters")
    seen, nd = set(), len(full_shape)
    for rank in mesh.devices:
        coords = mesh.coords(rank)
        if any(c != 0 for c, p in zip(coords, sharding.placements) if isinstance(p, Replicate)):
            continue  # a copy of what index 0 of that axis holds
        key = tuple(c for c, p in zip(coords, sharding.placements) if isinstance(p, Shard))
        index = tuple(sharding.local_indices(rank, d, n).view([-1 if i == d else 1 for i in range(nd)])
                      for d, n in enumerate(full_shape))
        if key not in seen:
            out[index] = pieces[rank]
        elif partial:  # another device's partial of the same piece
            (p,) = partial
            out[index] = p.combine(out[index], pieces[rank])
        seen.add(key)
    return out
