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
        if isinstance(devices, torch.Tensor):
            shape, flat = tuple(devices.shape), [int(d) for d in devices.flatten().tolist()]
        else:
            import numpy as np

            arr = np.asarray(list(devices) if not hasattr(devices, "shape") else devices)
            shape, flat = tuple(arr.shape), [int(d) for d in arr.flatten().tolist()]
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
        return len(self.shape)

    @property
    def size(self) -> int:
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
        flat = 0
        for c, extent in zip(coords, self.shape):
            flat = flat * extent + c
        return self.devices[flat]

    def axis_group(self, axis: int, rank: int) -> tuple[int, ...]:
        """The ranks that share every coordinate of ``rank`` but the one along ``axis``."""
        c = list(self.coords(rank))
        out = []
        for i in range(self.shape[axis]):
            c[axis] = i
            out.append(self.rank_at(tuple(c)))
        return tuple(out)

    def all_axis_groups(self, axis: int) -> list[tuple[int, ...]]:
        """Every group along ``axis``, in a fixed order (so every rank creates them alike)."""
        others = [range(n) if a != axis else range(1) for a, n in enumerate(self.shape)]
        return [self.axis_group(axis, self.rank_at(c)) for c in itertools.product(*others)]

    def numel_along(self, axes: Iterable[int]) -> int:
        return math.prod(self.shape[a] for a in axes)
