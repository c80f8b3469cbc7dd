"""Run one resharding step (a collective, a local slice, a move between meshes) on this rank.

Collectives need the gathered/scattered dim outermost and contiguous; where it is not, the
data is restacked here (a local copy), as nvFuser's reorder pass does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from tp_fusion.sharding.reshard import Collective
from tp_fusion.sharding.sharding import Partial

from tp_fusion.mesh import DeviceMesh
from tp_fusion.program import Communicate, Program
from tp_fusion.runtime import dist


def _stack_chunks(x: torch.Tensor, n: int, dim: int, outer: int = 1) -> torch.Tensor:
    """[n, ...]: chunk i along ``dim`` of ``x`` becomes row i (contiguous). With ``outer`` > 1 (a strided
    shard) chunk i is ``dim`` viewed as [outer, n, rest] at [:, i]."""
    if outer != 1:
        return x.unflatten(dim, (outer, n, -1)).movedim(dim + 1, 0).flatten(dim + 1, dim + 2).contiguous()
    if dim == 0:
        return x.contiguous().view(n, x.shape[0] // n, *x.shape[1:])
    return torch.stack(x.chunk(n, dim)).contiguous()


def _unstack(buf: torch.Tensor, dim: int, outer: int = 1) -> torch.Tensor:
    """Inverse of ``_stack_chunks``: rows of ``buf`` concatenated along ``dim`` (interleaved at ``outer``)."""
    if outer != 1:
        return buf.unflatten(dim + 1, (outer, -1)).movedim(0, dim + 1).flatten(dim, dim + 2)
    if dim == 0:
        return buf.view(buf.shape[0] * buf.shape[1], *buf.shape[2:])
    return torch.cat(buf.unbind(0), dim)


def local_slice(x: torch.Tensor, n: int, dim: int, index: int, outer: int = 1) -> torch.Tensor:
    """Chunk ``index`` of ``n`` along ``dim`` (viewed as [outer, n, rest]); no communication."""
    if outer != 1:
        return x.unflatten(dim, (outer, n, -1)).select(dim + 1, index).flatten(dim, dim + 1)
    return x.chunk(n, dim)[index]


# allgather, reduce_scatter and allreduce return their result, or with ``async_op`` a ``finish()`` that
# waits for the collective and then returns it (the runner's overlapped segments, Program.overlapped).

def _result(work, result: Callable[[], torch.Tensor]):
    if work is None:
        return result()

    def finish() -> torch.Tensor:
        work.wait()
        return result()
    return finish


@dataclass(frozen=True)
class GroupOrder:
    """How a mesh axis' group lists its ranks against torch's process group over them, which numbers
    them in increasing order: ``to_mesh[p]`` is the process-group rank of mesh position ``p``,
    ``to_group[g]`` the mesh position of process-group rank ``g``. None where both orders agree."""

    to_mesh: list[int]
    to_group: list[int]

    @staticmethod
    def of(group: tuple[int, ...]) -> GroupOrder | None:
        ranked = sorted(group)
        if list(group) == ranked:
            return None
        return GroupOrder([ranked.index(r) for r in group], [group.index(r) for r in ranked])


def _rows(buf: torch.Tensor, order: list[int] | None) -> torch.Tensor:
    """``buf``'s dim-0 rows permuted by ``order`` (row i of the result is row ``order[i]``); ``buf``
    itself for None. Stacked from views: indexing with the list would copy it to the GPU as an index
    tensor, which a CUDA graph cannot capture."""
    return buf if order is None else torch.stack([buf[i] for i in order])


def allgather(x: torch.Tensor, dim: int, pg, n: int, outer: int = 1, async_op: bool = False,
              order: GroupOrder | None = None):
    buf = x.new_empty((n, *x.shape))
    work = dist.all_gather(buf.view(n * x.shape[0], *x.shape[1:]) if x.dim() else buf, x.contiguous(), pg,
                           async_op=async_op)
    return _result(work, lambda: _unstack(_rows(buf, order and order.to_mesh), dim, outer))


def reduce_scatter(x: torch.Tensor, dim: int, pg, n: int, outer: int = 1, async_op: bool = False,
                   order: GroupOrder | None = None, reduce_op: str = "sum"):
    stacked = _rows(_stack_chunks(x, n, dim, outer), order and order.to_group)
    out = x.new_empty(stacked.shape[1:])
    # (every extent spelled out: torch infers no -1 in a tensor without elements, which a symbolic extent bound to 0
    # gives)
    flat = stacked.view(stacked.shape[0] * stacked.shape[1], *stacked.shape[2:]) if dim == 0 else stacked
    work = dist.reduce_scatter(out, flat, pg, op=reduce_op, async_op=async_op)
    return _result(work, lambda: out)


def allreduce(x: torch.Tensor, pg, donate: bool, async_op: bool = False, reduce_op: str = "sum"):
    out = x if donate and x.is_contiguous() else x.contiguous().clone()
    return _result(dist.all_reduce(out, pg, op=reduce_op, async_op=async_op), lambda: out)


def all_to_all(x: torch.Tensor, src_dim: int, dim: int, pg, n: int, src_outer: int = 1,
               outer: int = 1, order: GroupOrder | None = None) -> torch.Tensor:
    """Sharded on ``src_dim`` in, sharded on ``dim`` out: chunk j along ``dim`` goes to mesh position j."""
    inp = _rows(_stack_chunks(x, n, dim, outer), order and order.to_group).contiguous()
    out = torch.empty_like(inp)
    dist.all_to_all(out, inp, pg)
    return _unstack(_rows(out, order and order.to_mesh), src_dim, src_outer)


def send_recv(x: torch.Tensor | None, src: DeviceMesh, dst: DeviceMesh, rank: int, local_shape, dtype, device):
    """Mesh ``src`` device i sends its shard to mesh ``dst`` device i (same-shape meshes)."""
    works, out = [], None
    if rank in src.devices:
        peer = dst.devices[src.devices.index(rank)]
        if peer == rank:
            out = x
        else:
            works.append(dist.isend(x.contiguous(), peer))
    if rank in dst.devices and out is None:
        peer = src.devices[dst.devices.index(rank)]
        out = torch.empty(local_shape, dtype=dtype, device=device)
        works.append(dist.irecv(out, peer))
    for w in works:
        w.wait()
    return out


def broadcast(x: torch.Tensor | None, src: DeviceMesh, dst: DeviceMesh, rank: int, pg, shape, dtype, device):
    """The replicated value on mesh ``src`` is broadcast from its first device to mesh ``dst``."""
    root = src.devices[0]
    buf = x.contiguous().clone() if rank == root else torch.empty(shape, dtype=dtype, device=device)
    dist.broadcast(buf, root, pg)
    return buf if rank in dst.devices else None


def gather(x: torch.Tensor, root: int, rank: int, pg, n: int, dim: int, outer: int = 1,
           order: GroupOrder | None = None):
    """The ``n`` shards of a mesh gathered into ``root`` (one of its devices), which returns the whole;
    the others return None. ``order``: the mesh's order against the group's (``GroupOrder``)."""
    pieces = [torch.empty_like(x) for _ in range(n)] if rank == root else None
    dist.gather(x.contiguous(), pieces, root, pg)
    if rank != root:
        return None
    return _unstack(_rows(torch.stack(pieces), order and order.to_mesh), dim, outer)


def reduce(x: torch.Tensor, root: int, rank: int, pg, reduce_op: str = "sum"):
    """The partial values reduced (``reduce_op``) into ``root``, which returns it; the others return None."""
    out = x.contiguous().clone()
    dist.reduce(out, root, pg, reduce_op)
    return out if rank == root else None


def scatter(x: torch.Tensor | None, root: int, rank: int, pg, n: int, dim: int, outer: int,
            order: GroupOrder | None, shape, dtype, device):
    """``root``'s whole value cut into the ``n`` shards of a mesh that holds ``root``, one to each."""
    pieces = None if rank != root else list(_rows(_stack_chunks(x, n, dim, outer), order and order.to_group))
    out = torch.empty(shape, dtype=dtype, device=device)
    dist.scatter(out, pieces, root, pg)
    return out


def step_fn(s: Communicate, program: Program, async_op: bool = False):
    """``fn(x) -> local result (None where this rank holds none)`` running one resharding step on
    this rank; groups, indices and shapes are looked up once, here. ``s.donate``: ``x`` may be
    reduced in place. ``async_op`` (an allgather, reduce_scatter or allreduce that runs asynchronously,
    ``program.schedule_collectives``): ``fn(x)`` returns ``finish()``, which waits and returns the result."""
    reduce_op = s.op.attr("reduce_op", "sum")  # how partials combine (ALLREDUCE, REDUCE_SCATTER, REDUCE, TO_PARTIAL)
    fn = _step_fn(s, program, async_op, reduce_op)
    if reduce_op in ("max", "min") and s.dtype.is_floating and s.collective in _REDUCING:
        return _keeping_nan(fn, reduce_op)
    return fn


_REDUCING = (Collective.ALLREDUCE, Collective.REDUCE_SCATTER, Collective.REDUCE)


def _keeping_nan(fn, reduce_op: str):
    """``fn``, a max or min collective over floats, made to keep NaN as torch's amax and amin do (NCCL's and
    gloo's max and min drop it): each element travels with a flag in a trailing dim, 1 (max) or -1 (min)
    where it is NaN and 0 elsewhere, which the same op combines into "some rank's element was NaN"."""
    flag = 1.0 if reduce_op == "max" else -1.0

    def unpack(out: torch.Tensor | None) -> torch.Tensor | None:
        return None if out is None else torch.where(out[..., 1] != 0, float("nan"), out[..., 0])

    def run(x: torch.Tensor):
        nan = x.isnan()
        got = fn(torch.stack([x.masked_fill(nan, 0), nan.to(x.dtype) * flag], -1))
        return (lambda: unpack(got())) if callable(got) else unpack(got)
    return run


def _step_fn(s: Communicate, program: Program, async_op: bool, reduce_op: str):
    """``step_fn`` without the NaN flags of a floating max or min."""
    op, c, rank = s.op, s.collective, program.rank
    shape, dtype, device = s.out_shape, s.dtype.torch, program.device
    if c is Collective.SEND_RECV:
        src, dst = op.attr("src_mesh"), op.attr("dst_mesh")
        return lambda x: send_recv(x, src, dst, rank, shape, dtype, device)
    if c is Collective.BROADCAST:
        src, dst, pg = op.attr("src_mesh"), op.attr("dst_mesh"), dist.group(s.group)
        return lambda x: broadcast(x, src, dst, rank, pg, shape, dtype, device)
    if c in (Collective.GATHER, Collective.REDUCE, Collective.SCATTER):
        src, dst, pg, dim, outer = op.attr("src_mesh"), op.attr("dst_mesh"), dist.group(s.group), \
            op.attr("dim", 0), op.attr("outer", 1)
        if c is Collective.REDUCE:
            return lambda x: reduce(x, dst.devices[0], rank, pg, reduce_op)
        mesh = src if c is Collective.GATHER else dst  # the 1-D side; its order is the pieces' order
        n, order = mesh.size, GroupOrder.of(mesh.devices)
        if c is Collective.GATHER:
            return lambda x: gather(x, dst.devices[0], rank, pg, n, dim, outer, order)
        return lambda x: scatter(x, src.devices[0], rank, pg, n, dim, outer, order, shape, dtype, device)
    n, index, dim, outer = len(s.group), s.group.index(rank), op.attr("dim"), op.attr("outer", 1)
    if c is Collective.LOCAL_SLICE:
        return lambda x: local_slice(x, n, dim, index, outer)
    if c is Collective.TO_PARTIAL:  # Replicate -> Partial: e.g. the value on index 0 of the axis, zeros elsewhere
        partial = Partial(reduce_op)
        return lambda x: partial.of_whole(x, index)
    pg, order = dist.group(s.group), GroupOrder.of(s.group)
    if c is Collective.ALLGATHER:
        return lambda x: allgather(x, dim, pg, n, outer, async_op, order)
    if c is Collective.REDUCE_SCATTER:
        return lambda x: reduce_scatter(x, dim, pg, n, outer, async_op, order, reduce_op)
    if c is Collective.ALLREDUCE:
        donate = s.donate
        return lambda x: allreduce(x, pg, donate, async_op, reduce_op)
    src_dim, src_outer = op.attr("src_dim"), op.attr("src_outer", 1)
    return lambda x: all_to_all(x, src_dim, dim, pg, n, src_outer, outer, order)
