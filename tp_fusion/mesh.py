"""DeviceMesh: an n-D array of ranks. Mesh axis 0 is the outermost; ``mesh_x`` binds the last."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable

import torch

from tp_fusion.errors import ShardingError


class DeviceMesh:
    """An immutable n-D arrangement of distinct ranks, e.g. ``DeviceMesh(range(4))`` or
    ``DeviceMesh(torch.arange(4).reshape(2, 2))``."""

    __slots__ = ("devices", "shape")

    def __init__(self, devices: Iterable[int] | torch.Tensor):
        shape, flat = _shape_and_ranks(devices)
        if not flat:
            raise ShardingError("DeviceMesh needs at least one device; got an empty list")
        if len(shape) > 3:
            raise ShardingError(f"DeviceMesh has {len(shape)} axes; at most 3 (mesh_x, mesh_y, mesh_z)")
        if min(flat) < 0:
            raise ShardingError(f"DeviceMesh devices must be ranks >= 0; got {flat}")
        if len(set(flat)) != len(flat):
            dup = sorted({d for d in flat if flat.count(d) > 1})
            raise ShardingError(f"DeviceMesh {flat} repeats device(s) {dup}; each rank may appear once")
        object.__setattr__(self, "devices", tuple(flat))
        object.__setattr__(self, "shape", shape)

    def __setattr__(self, name, value):
        raise AttributeError("DeviceMesh is immutable")

    @property
    def ndim(self) -> int:
        """The number of mesh axes."""
        return len(self.shape)

    @property
    def size(self) -> int:
        """The number of devices."""
        return len(self.devices)

    def __len__(self) -> int:
        return self.size

    def __contains__(self, rank: int) -> bool:
        return rank in self.devices

    def __eq__(self, other) -> bool:
        return isinstance(other, DeviceMesh) and (self.devices, self.shape) == (other.devices, other.shape)

    def __hash__(self) -> int:
        return hash((self.devices, self.shape))

    def __repr__(self) -> str:
        if self.ndim == 1:
            return f"DeviceMesh({list(self.devices)})"
        return f"DeviceMesh({list(self.devices)}, shape={list(self.shape)})"

    def short(self) -> str:
        """Compact form for printed IR: ``mesh(0 1)`` or ``mesh(2x2: 0 1 2 3)``."""
        devs = " ".join(map(str, self.devices))
        return f"mesh({devs})" if self.ndim == 1 else f"mesh({'x'.join(map(str, self.shape))}: {devs})"

    def coords(self, rank: int) -> tuple[int, ...]:
        """The index of ``rank`` along each mesh axis."""
        flat = self.devices.index(rank)
        out = []
        for extent in reversed(self.shape):
            out.append(flat % extent)
            flat //= extent
        return tuple(reversed(out))

    def rank_at(self, coords: tuple[int, ...]) -> int:
        """The rank at ``coords`` (one index per mesh axis)."""
        flat = 0
        for c, extent in zip(coords, self.shape):
            flat = flat * extent + c
        return self.devices[flat]

    def axis_group(self, axis: int | tuple[int, ...], rank: int) -> tuple[int, ...]:
        """The ranks that share every coordinate of ``rank`` but the ones along ``axis`` (a mesh axis, or
        a tuple of them: a collective over several axes at once), in row-major order of those axes."""
        axes = as_axes(axis)
        c = list(self.coords(rank))
        out = []
        for index in itertools.product(*(range(self.shape[a]) for a in axes)):
            for a, i in zip(axes, index):
                c[a] = i
            out.append(self.rank_at(tuple(c)))
        return tuple(out)

    def all_axis_groups(self, axis: int | tuple[int, ...]) -> list[tuple[int, ...]]:
        """Every group along ``axis`` (a mesh axis or a tuple of them), in a fixed order (so every rank
        creates them alike)."""
        axes = as_axes(axis)
        others = [range(n) if a not in axes else range(1) for a, n in enumerate(self.shape)]
        return [self.axis_group(axes, self.rank_at(c)) for c in itertools.product(*others)]

    def unordered_group(self, axis: int | tuple[int, ...]) -> tuple[int, ...] | None:
        """A group along ``axis`` whose ranks are not in increasing order, or None. torch numbers a
        process group's ranks increasingly (and places a DTensor's shards so): collectives that place
        pieces by position need every group in that order."""
        return next((g for g in self.all_axis_groups(axis) if list(g) != sorted(g)), None)

    def numel_along(self, axes: int | Iterable[int]) -> int:
        """How many devices the mesh axes ``axes`` (one axis, or several) span together."""
        return math.prod(self.shape[a] for a in as_axes(axes))


def as_axes(axis: int | Iterable[int]) -> tuple[int, ...]:
    """One mesh axis or several (a collective's ``mesh_axis``), as a tuple."""
    return (axis,) if isinstance(axis, int) else tuple(axis)


def _bad_mesh(devices, why: str) -> ShardingError:
    return ShardingError(f"DeviceMesh({devices!r}): {why}; pass integer ranks, e.g. DeviceMesh(range(4)) or "
                         "DeviceMesh(torch.arange(4).reshape(2, 2))")


def _shape_and_ranks(devices) -> tuple[tuple[int, ...], list[int]]:
    """The mesh's shape and its ranks in row-major order; a clear ShardingError for anything that is
    not a (possibly nested) rectangular array of integer ranks."""
    if isinstance(devices, torch.Tensor):
        if devices.dtype.is_floating_point or devices.dtype.is_complex or devices.dtype == torch.bool:
            raise _bad_mesh(devices, f"the ranks must be integers, got a {devices.dtype} tensor")
        return tuple(devices.shape), [int(d) for d in devices.flatten().tolist()]
    if isinstance(devices, (str, bytes)):
        raise _bad_mesh(devices, "a string is not a list of ranks")
    if hasattr(devices, "shape") and hasattr(devices, "tolist"):  # a numpy array
        devices = devices.tolist()
    try:
        items = list(devices)
    except TypeError:
        raise _bad_mesh(devices, f"expected an iterable of ranks, got {type(devices).__name__}") from None

    def walk(node, depth: int) -> tuple[int, ...]:
        if _is_rank(node):
            return ()
        if isinstance(node, (str, bytes, float)) or not hasattr(node, "__iter__"):
            raise _bad_mesh(devices, f"{node!r} is not an integer rank")
        sub = [walk(c, depth + 1) for c in node]
        if len(set(sub)) > 1:
            raise _bad_mesh(devices, f"the rows at depth {depth + 1} have different shapes (a mesh is rectangular)")
        return (len(node),) + (sub[0] if sub else ())

    nested = [list(c) if hasattr(c, "__iter__") and not isinstance(c, (str, bytes)) else c for c in items]
    kinds = {_is_rank(c) for c in nested}
    if len(kinds) > 1:
        raise _bad_mesh(devices, "it mixes ranks and lists of ranks (a mesh is rectangular)")
    shape = walk(nested, 0)
    flat: list[int] = []

    def collect(node):
        if _is_rank(node):
            flat.append(int(node))
        else:
            for c in node:
                collect(c)
    collect(nested)
    return shape, flat


def _is_rank(x) -> bool:
    import numbers

    return isinstance(x, numbers.Integral) and not isinstance(x, bool) or (
        isinstance(x, torch.Tensor) and x.ndim == 0 and not x.dtype.is_floating_point)
