"""``fd.plan.summary()``: what each segment of a plan moves and computes, per rank.

Per segment: the bytes a rank sends and receives for each collective, the FLOPs of its compute,
and whether it is a fused (communication-overlapped) segment. All sizes come from LOCAL shapes
(each tensor's global shape divided by its sharding) and the dtype's size.

Communication model (bandwidth-optimal ring algorithms, as NCCL's; ``n`` = the size of the mesh
axis the collective runs on, ``P`` = the payload in bytes, per rank):

=================  ====================================  ==================================
collective         payload ``P``                         sent = received, per rank
=================  ====================================  ==================================
allgather          the gathered (output) local tensor    ``(n-1)/n * P``
reduce_scatter     the unreduced (input) local tensor    ``(n-1)/n * P``
allreduce          the local tensor                      ``2 (n-1)/n * P`` (reduce_scatter +
                                                         allgather)
all_to_all         the local tensor                      ``(n-1)/n * P`` (keeps 1/n)
send_recv          the local shard                       ``P`` (0 if the meshes are the same)
broadcast          the replicated tensor                 ``P`` (pipelined chain: each rank
                                                         receives P and forwards it once)
slice (local)      -                                     0
=================  ====================================  ==================================

The numbers are for a rank that takes part (the maximum over ranks for send_recv and broadcast,
where the root only sends and the last rank only receives). FLOPs: ``2*M*N*K`` for linear, matmul
and grouped_mm (``M*N`` = the local output's elements, ``K`` the local contracted extent; a bias add is
not counted), the output's elements for pointwise ops (gelu, add, ... count 1 per element),
the input's elements for reductions, softmax and layer_norm, and 0 for shape ops and copies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tp_fusion.errors import DefinitionError
from tp_fusion.ir import Fusion, Op
from tp_fusion.mesh import as_axes
from tp_fusion.ops import Trait, opdef, traits
from tp_fusion.sharding.reshard import Collective
from tp_fusion.types import ParallelType


@dataclass(frozen=True)
class CommCost:
    """One collective of a segment, with this model's bytes per rank."""

    kind: str
    group: str  # e.g. "mesh_x, n=2", or "mesh(0 1)->mesh(2 3)" for moves between meshes
    group_size: int
    payload: int  # P, bytes
    sent: int  # bytes per rank
    received: int  # bytes per rank


@dataclass(frozen=True)
class SegmentSummary:
    index: int
    kind: str  # compute, communication or fused
    ops: str  # op kinds joined with "+", e.g. "allgather+linear+gelu"
    fused: bool
    choice: str | None  # for fused segments: "fused", "sequential" or None (not decided yet)
    comms: tuple[CommCost, ...]
    flops: int

    @property
    def sent(self) -> int:
        return sum(c.sent for c in self.comms)

    @property
    def received(self) -> int:
        return sum(c.received for c in self.comms)


@dataclass(frozen=True)
class PlanSummary:
    """A printable table (``str``) plus the numbers (``segments``, totals)."""

    rank: int
    segments: tuple[SegmentSummary, ...]

    @property
    def flops(self) -> int:
        return sum(s.flops for s in self.segments)

    @property
    def sent(self) -> int:
        return sum(s.sent for s in self.segments)

    @property
    def received(self) -> int:
        return sum(s.received for s in self.segments)

    def __str__(self) -> str:
        head = ("seg", "kind", "ops", "collective", "sent/rank", "recv/rank", "FLOPs/rank")
        rows = []
        for s in self.segments:
            kind = s.kind if not s.fused or s.choice == "fused" else f"fused ({s.choice or 'undecided'})"
            comm = ", ".join(f"{c.kind} ({c.group})" for c in s.comms) or "-"
            rows.append((str(s.index), kind, s.ops, comm, format_bytes(s.sent) if s.comms else "-",
                         format_bytes(s.received) if s.comms else "-", format_flops(s.flops) if s.flops else "-"))
        rows.append(("total", "", "", "", format_bytes(self.sent), format_bytes(self.received),
                     format_flops(self.flops)))
        widths = [max(len(r[i]) for r in (head, *rows)) for i in range(len(head))]
        numeric = {4, 5, 6}

        def line(r):
            return "  ".join(c.rjust(w) if i in numeric else c.ljust(w)
                             for i, (c, w) in enumerate(zip(r, widths))).rstrip()
        out = [f"Plan summary (rank {self.rank}; bytes per rank, ring model; FLOPs on local shards)",
               line(head), line(tuple("-" * w for w in widths))]
        out += [line(r) for r in rows]
        return "\n".join(out)


def format_bytes(n: int) -> str:
    """``512 B``, ``8.0 KiB``, ``1.5 MiB``, ``2.0 GiB``."""
    if n < 1024:
        return f"{n} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
    raise AssertionError


def format_flops(n: int) -> str:
    """Four significant digits with an SI prefix: ``266.2 k``, ``1.924 T``."""
    if n < 1000:
        return str(n)
    for unit in ("k", "M", "G", "T", "P"):
        n /= 1000
        if n < 1000 or unit == "P":
            return f"{n:.4g} {unit}"
    raise AssertionError


def _local_shape(fusion: Fusion, name: int) -> tuple[int, ...]:
    t = fusion.tensor(name)
    return t.sharding.local_shape(t.shape) if t.sharding else t.shape


def _bytes(fusion: Fusion, name: int) -> int:
    return math.prod(_local_shape(fusion, name)) * fusion.tensor(name).dtype.torch.itemsize


def comm_cost(fusion: Fusion, op: Op, rank: int = 0) -> CommCost:
    """This model's bytes on ``rank`` for one communication op of a lowered fusion."""
    src, out = op.inputs[0], op.outputs[0]
    collective = Collective(op.kind)
    if collective is Collective.SEND_RECV:  # the device at each place of one mesh sends to that of the other
        a, b = op.attr("src_mesh"), op.attr("dst_mesh")
        payload = _bytes(fusion, out)
        sends = rank in a and b.devices[a.devices.index(rank)] != rank
        receives = rank in b and a.devices[b.devices.index(rank)] != rank
        return CommCost(op.kind, f"{a.short()}->{b.short()}", 2, payload, payload if sends else 0,
                        payload if receives else 0)
    if collective is Collective.BROADCAST:
        a, b = op.attr("src_mesh"), op.attr("dst_mesh")
        payload = _bytes(fusion, out)
        return CommCost(op.kind, f"{a.short()}->{b.short()}", len(set(a.devices) | set(b.devices)), payload, payload,
                        payload)
    if collective in (Collective.GATHER, Collective.REDUCE, Collective.SCATTER):  # a 1-D mesh and one device
        a, b = op.attr("src_mesh"), op.attr("dst_mesh")
        group, root = (a, b.devices[0]) if collective is not Collective.SCATTER else (b, a.devices[0])
        n = group.size
        payload = _bytes(fusion, src if collective is Collective.SCATTER else out)  # whole on the one device
        sent = received = 0
        if rank in group:
            if collective is Collective.REDUCE:  # a ring into the root: P on each link
                mine = payload
            else:  # a piece of P/n between the root and each other rank
                mine = payload * (n - 1) // n if rank == root else payload // n
            if (rank == root) == (collective is not Collective.SCATTER):  # the data flows into this rank
                received = mine
            else:
                sent = mine
        return CommCost(op.kind, f"{a.short()}->{b.short()}", n, payload, sent, received)
    mesh = fusion.tensor(src).sharding.mesh
    axis = op.attr("mesh_axis")
    n = mesh.numel_along(axis)
    group = f"{'+'.join(ParallelType.for_mesh_axis(a, mesh.ndim).value for a in as_axes(axis))}, n={n}"
    payload = _bytes(fusion, out if collective is Collective.ALLGATHER else src)
    share = payload * (n - 1) // n if rank in mesh else 0  # a rank off the mesh (another stage) takes no part
    if collective is Collective.ALLREDUCE:
        share *= 2
    return CommCost(op.kind, group, n, payload, share, share)


def op_flops(fusion: Fusion, op: Op) -> int:
    """FLOPs of one op on this rank's local shards (the op registry's ``flops``)."""
    ins = [_local_shape(fusion, a) for a in op.tensor_inputs]
    return opdef(op.kind).flops(ins, [_local_shape(fusion, o) for o in op.outputs])


def summarize(plan, rank: int = 0) -> PlanSummary:
    """The summary of a compiled ``Program`` (``fd.plan.summary()``), or of a lowered and segmented
    ``Fusion`` (``passes.run_pipeline``'s result; no process group needed, fused choices undecided)."""
    if isinstance(plan, Fusion):
        fusion = plan
        symbolic = next((t for t in fusion.tensors if any(e < 0 for e in t.shape)), None)
        if symbolic is not None:
            raise DefinitionError(f"summarize: T{symbolic.name} {symbolic.type_str()} has a symbolic extent, so its "
                                  "bytes and FLOPs are unknown; summarize fd.compile(global_input_shapes) instead")
        segments = [(seg, [fusion.ops[i] for i in seg.ops], None) for seg in fusion.segments or ()]
    else:
        fusion, rank = plan.fusion, plan.rank
        segments = [(seg, [s.op for s in seg.steps], seg.fused.mode if seg.fused else None) for seg in plan.segments]
    rows = []
    for i, (seg, ops, choice) in enumerate(segments):
        fused = seg.kind == "fused"
        rows.append(SegmentSummary(
            index=i, kind=seg.kind, ops="+".join(op.kind for op in ops), fused=fused,
            choice=choice if fused else None,
            comms=tuple(comm_cost(fusion, op, rank) for op in ops if traits(op.kind) & Trait.COLLECTIVE),
            flops=sum(op_flops(fusion, op) for op in ops)))
    return PlanSummary(rank, tuple(rows))
