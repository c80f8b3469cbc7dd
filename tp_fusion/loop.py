"""Loop domains, as in nvFuser: the axes a TensorView's schedule splits, reorders and parallelizes,
and the sharding they give the tensor.

A loop domain is a tuple of ``LoopAxis`` (``tp_fusion.ir``). It starts as the tensor's logical dims
plus, for the output of a GEMM or a reduction, the reduced dims (``r{K}``): a linear/matmul output
ends with its contraction, sum/mean/amax/var_mean keep their reduced dims in place. From it:

- a device-parallel piece of a logical dim shards that dim on the piece's mesh axis, at the piece's
  place in the dim (``Shard(dim, outer)``: outermost, inner or middle);
- a device-parallel piece of a reduction axis leaves the tensor Partial (a pending sum; a pending max,
  min or product for those reductions) on that mesh axis: each device reduced its part (nvFuser's
  rfactor). With a logical dim sharded on the same mesh axis too, the tensor holds its shard of the
  finished reduction (a reduce-scatter).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from tp_fusion.errors import ShardingError
from tp_fusion.ir import LoopAxis, Op
from tp_fusion.mesh import DeviceMesh
from tp_fusion.ops import Trait, opdef
from tp_fusion.sharding.sharding import PARTIAL_SUM, REPLICATE, Partial, Replicate, Shard, Sharding

Loop = tuple[LoopAxis, ...]


def default_loop(shape: tuple[int, ...], producer: Op | None, shape_of: Callable[[int], tuple[int, ...]]) -> Loop:
    """The unscheduled loop domain of a tensor of ``shape`` made by ``producer`` (None: an input)."""
    logical = [LoopAxis(d, e) for d, e in enumerate(shape)]
    if producer is None:
        return tuple(logical)
    op = opdef(producer.kind)
    if op.has(Trait.GEMM):
        a, b = (shape_of(x) for x in producer.tensor_inputs[:2])
        k_of_b = b[-1] if op.weight_out_in else (b[0] if len(b) == 1 else b[-2])
        return (*logical, LoopAxis(0, a[-1] if a[-1] >= 0 else k_of_b, reduction=True))
    if op.has(Trait.REDUCTION) and not producer.attr("keepdim", False):
        x = shape_of(producer.tensor_inputs[0])
        dims, loop, out_dim = producer.attr("dims"), [], 0
        for d, e in enumerate(x):
            if d in dims:
                loop.append(LoopAxis(dims.index(d), e, reduction=True))
            else:
                loop.append(LoopAxis(out_dim, e))
                out_dim += 1
        return tuple(loop)
    return tuple(logical)


def pending_of(producer: Op | None) -> Partial:
    """How the devices' results of ``producer``'s output combine where its reduction axes are
    device-parallel: a sum for a GEMM, a sum or a mean; a max, min or prod reduction's own op."""
    return PARTIAL_SUM if producer is None else Partial(opdef(producer.kind).pending)


def split(loop: Loop, axis: int, factor: int, inner_split: bool) -> Loop:
    """Axis ``axis`` of extent n becomes [n/factor, factor] (``inner_split``) or [factor, n/factor]."""
    old = loop[axis]
    rest = -1 if old.extent < 0 else old.extent // factor
    outer, inner = (rest, factor) if inner_split else (factor, rest)
    pieces = (LoopAxis(old.dim, outer, reduction=old.reduction, piece=(*old.piece, 0)),
              LoopAxis(old.dim, inner, reduction=old.reduction, piece=(*old.piece, 1)))
    return (*loop[:axis], *pieces, *loop[axis + 1:])


def reorder(loop: Loop, old2new: dict[int, int], what: str) -> Loop:
    """nvFuser's ``reorder``: axis ``old`` moves to position ``new``; the other axes keep their order
    in the positions left."""
    n = len(loop)
    moves = {}
    for old, new in old2new.items():
        if not all(isinstance(i, int) and -n <= i < n for i in (old, new)):
            raise ShardingError(f"{what}: reorder {old2new} names an axis out of range for a loop domain of {n} "
                                "axes")
        moves[old % n] = new % n
    if len(set(moves.values())) != len(moves):
        raise ShardingError(f"{what}: reorder {old2new} moves two axes to one position")
    out: list[LoopAxis | None] = [None] * n
    for old, new in moves.items():
        out[new] = loop[old]
    rest = iter(ax for i, ax in enumerate(loop) if i not in moves)
    return tuple(ax if ax is not None else next(rest) for ax in out)


def sharding(loop: Loop, mesh: DeviceMesh, what: str, pending: Partial = PARTIAL_SUM) -> Sharding:
    """The sharding ``loop`` gives a tensor on ``mesh`` (see the module docstring); a device-parallel
    reduction axis leaves it ``pending`` (its producer's: ``pending_of``)."""
    placements = [REPLICATE] * mesh.ndim
    for reduction in (False, True):  # a logical dim sharded on a mesh axis wins over a pending sum on it
        for i, ax in enumerate(loop):
            if not ax.ptype.is_device or ax.reduction != reduction:
                continue
            mesh_axis = ax.ptype.mesh_axis(mesh.ndim)
            where = f"{what} loop axis {i} ({ax.ptype.value})"
            if mesh_axis < 0:
                raise ShardingError(f"{where}: the mesh {list(mesh.shape)} has no such axis")
            if ax.extent != mesh.shape[mesh_axis]:
                raise ShardingError(
                    f"{where}: extent {ax.extent} must equal the mesh axis size {mesh.shape[mesh_axis]}; "
                    f"use outer_split(axis, {mesh.shape[mesh_axis]})")
            if reduction:
                if isinstance(placements[mesh_axis], Replicate):
                    placements[mesh_axis] = pending
                continue
            before = [a.extent for a in loop if a.dim == ax.dim and not a.reduction and a.piece < ax.piece]
            # An empty dim (a symbolic extent bound to 0) has empty pieces wherever they lie: a block shard.
            placements[mesh_axis] = Shard(ax.dim, -1 if -1 in before else math.prod(before) or 1)
    return Sharding(mesh, tuple(placements))


def pieces(loop: Loop, dim: int, reduction: bool = False) -> list[int]:
    """The positions in ``loop`` of logical dim ``dim``'s pieces, outermost first (past the reduction axes
    that a reduction keeps in place, such as a sum's ``r{T}``); with ``reduction``, those of its ``dim``-th
    reduction axis (the ``dim``-th dim its producer reduced)."""
    return [i for i, a in enumerate(loop) if a.dim == dim and a.reduction == reduction]


def bind(loop: Loop, shape: tuple[int, ...], what: str, when: str, reduced: tuple[int, ...] = ()) -> Loop:
    """``loop`` with the symbolic piece of each logical dim sized from ``shape`` (the concrete extents), and of
    each reduction axis from ``reduced`` (the extents of the dims its producer reduced, in the order of its
    ``r`` axes: ``default_loop``'s); ShardingError where the schedule does not fit them. ``when`` says where
    they come from."""
    out = list(loop)
    for d, n, at in [*((d, n, pieces(loop, d)) for d, n in enumerate(shape)),
                     *((f"r{r} (reduced)", n, pieces(loop, r, reduction=True)) for r, n in enumerate(reduced))]:
        known = [loop[i].extent for i in at if loop[i].extent >= 0]
        k = math.prod(known)
        symbolic = [i for i in at if loop[i].extent < 0]
        if n < 0 or not at or (not symbolic and k == n):
            continue
        product = f" ({' x '.join(map(str, known))})" if len(known) > 1 else ""
        if not symbolic:
            direct = len(at) == 1 and loop[at[0]].ptype.is_device
            note, fix = (" (a dim parallelized without a split spans the mesh axis)",
                         f", or to shard it in {k} pieces split its loop axis first (outer_split({at[0]}, {k})) "
                         "and parallelize the outer piece") if direct else ("", "")
            raise ShardingError(f"{what}: dim {d}'s schedule gives it extent {k}{product}{note}, but it is "
                                f"{n}{when}; pass a tensor whose dim {d} is {k}{fix}")
        if n % k != 0:
            raise ShardingError(f"{what}: dim {d} is symbolic and bound to {n}{when}, but its schedule splits it by "
                                f"{k}{product}, which does not divide {n}; pass a size that is a multiple of {k} "
                                "or change the split")
        (i,) = symbolic
        out[i] = LoopAxis(loop[i].dim, n // k, loop[i].ptype, loop[i].reduction, loop[i].piece)
    return tuple(out)


def allocation_order(loop: Loop, order: list[int], ndim: int, what: str) -> tuple[int, ...]:
    """The stride order (as ``define_tensor``'s) of an allocation domain that lists the loop axes
    ``order`` outermost first. Device-parallel axes (local extent 1) and reduction axes hold no memory;
    the other pieces of a dim must be adjacent and outer first, since a torch tensor has one stride per
    dim (ShardingError otherwise)."""
    if sorted(order) != list(range(len(loop))):
        raise ShardingError(f"{what}: an allocation domain lists every loop axis once; got axes {order} of "
                            f"[{', '.join(map(str, loop))}]")
    stored = [i for i in order if not loop[i].reduction and not loop[i].ptype.is_device]
    dims = [loop[i].dim for i in stored]
    for d in set(dims):
        at = [j for j, e in enumerate(dims) if e == d]
        pieces = [loop[stored[j]].piece for j in at]
        if at != list(range(at[0], at[0] + len(at))) or pieces != sorted(pieces):
            raise ShardingError(f"{what}: the allocation domain [{', '.join(str(loop[i]) for i in order)}] splits "
                                f"dim {d} around other dims or puts an inner piece first; a tensor has one stride "
                                "per dim, so its pieces must be adjacent, outer first")

    def place(d: int) -> int:  # a dim stored in no piece (all device-parallel) goes where its first piece is
        pieces = [j for j, i in enumerate(order) if loop[i].dim == d and not loop[i].reduction]
        return ([j for j in pieces if order[j] in stored] or pieces)[0]
    outer_first = sorted(range(ndim), key=place)
    return tuple(ndim - 1 - outer_first.index(d) for d in range(ndim))
