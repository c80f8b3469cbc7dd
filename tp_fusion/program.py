"""A rank's program: the lowered, segmented fusion as plain data, ready for the runner.

``build_program`` turns a lowered fusion into typed instructions (``Compute``, ``Communicate``,
``FusedGemm``) grouped in segments, with everything a rank needs resolved: local attributes,
which ops this rank takes part in, the process groups (as rank tuples), and which buffers a
collective may reduce in place. Choices that are measured (fused or sequential, CUDA graph or
eager) are fields that ``tp_fusion.runtime.tuning`` fills in; ``str(program)`` shows them.
Nothing here runs anything: ``tp_fusion.runtime.runner`` does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from tp_fusion.ir import Fusion, Op
from tp_fusion.ops import Localize, Trait, is_biased_gemm, is_plain_gemm, is_tanh_gelu, opdef, traits
from tp_fusion.passes.fuse_collectives import reduction_addends
from tp_fusion.sharding.reshard import Collective
from tp_fusion.sharding.sharding import Sharding
from tp_fusion.types import DataType

FUSED, SEQUENTIAL = "fused", "sequential"


@dataclass(frozen=True)
class Compute:
    """Run ``op``'s aten implementation on local shards with ``attrs`` (local extents)."""

    op: Op
    attrs: tuple[tuple[str, object], ...]
    runs_here: bool


@dataclass(frozen=True)
class Communicate:
    """One resharding step (a collective, or a local slice) of ``op`` on this rank."""

    op: Op
    collective: Collective
    group: tuple[int, ...] | None  # this rank's group along the step's mesh axis (None: none needed)
    out_shape: tuple[int, ...]  # this rank's local output shape
    dtype: DataType
    donate: bool  # the input is dead after this step: it may be reduced in place
    runs_here: bool


@dataclass(frozen=True)
class FusedGemm:
    """A GEMM and its collective run as one overlapped kernel (``tp_fusion.runtime.overlap``):
    ``allgather`` of ``x`` then the GEMM (and ``epilogue``), or the GEMM then ``reduce_scatter`` or
    ``allreduce`` (plus ``bias``, then plus ``residual``, a tensor of the result's local shape).
    ``mode`` is measured by tuning: ``fused`` or ``sequential``; so is ``tuning``, the fused kernel's
    knobs (``overlap.Tuning``; None: the defaults)."""

    collective: Collective
    x: int
    weight: int
    transpose_weight: bool  # matmul's right operand is [in, out]; linear's weight is [out, in]
    bias: int | None
    residual: int | None
    epilogue: tuple[tuple[str, tuple[tuple[str, object], ...]], ...]  # (kind, local attrs) in order
    out: int
    dim: int | None  # the gathered or scattered dim
    group: tuple[int, ...]  # this rank's group (empty where the segment does not run here)
    runs_here: bool
    group_size: int  # the group's size, known on every rank (so that static choices agree everywhere)
    mode: str | None = None
    tuning: object | None = None  # tp_fusion.runtime.overlap.Tuning (the runtime is not imported here)


Instruction = Compute | Communicate


@dataclass(frozen=True)
class ProgramSegment:
    kind: str  # compute, communication or fused
    note: str
    steps: tuple[Instruction, ...]  # one per op (a fused segment runs ``fused`` instead where it can)
    fused: FusedGemm | None = None

    @property
    def collectives(self) -> list[str]:
        return [s.op.kind for s in self.steps if isinstance(s, Communicate) and s.collective.communicates]


@dataclass(frozen=True)
class Program:
    """What one rank runs for one input signature: ``fd.plan`` after ``execute``; ``fd.compile`` returns one."""

    fusion: Fusion
    rank: int
    device: torch.device
    segments: tuple[ProgramSegment, ...]
    outputs: tuple[tuple[int, bool], ...]  # (tensor, whether this rank holds a part of it)
    cuda_graph: bool = False  # replay as a CUDA graph (measured faster than launching eagerly)
    gelu_apart: frozenset[int] = frozenset()  # tanh-GELU outputs whose GELU runs as a pass apart from its
    #                                           GEMM's epilogue (measured faster; ``gelu_epilogues``)
    notes: tuple[str, ...] = ()  # why tuning chose what it chose (timings, host locality), one line each
    overlapped: dict[int, tuple[int, int]] = dataclasses.field(default_factory=dict)  # communication segment
    #   index -> (issued after segment, awaited before segment): collectives run asynchronously so that the
    #   segments in between overlap them (``schedule_collectives``); -1 is the start, len(segments) the end
    numbers: Callable[[dict], dict] | None = None  # the numbers of the value attributes that scalar inputs give,
    #   from their values (``compile.per_call_numbers``): execute computes them at every call; None: none

    def groups(self) -> list[tuple[int, ...]]:
        """Every process group the program uses on any rank, in order (created alike on every rank)."""
        out: dict[tuple[int, ...], None] = {}
        for seg in self.segments:
            for s in seg.steps:
                if isinstance(s, Communicate):
                    for g in _all_groups(self.fusion, s.op):
                        out.setdefault(g)
        return list(out)

    def collectives(self) -> list[str]:
        """The collectives the plan runs, in order (fused segments name theirs)."""
        return [name for seg in self.segments for name in seg.collectives]

    def returned(self) -> list[int]:
        """The outputs ``execute`` returns, in order: the fusion's, less those aliased to an input (written
        into it in place)."""
        return [self.fusion.outputs[p] for p in self.fusion.returned]

    def output_shardings(self) -> list:
        """One Sharding per returned output; ``Sharding.unsharded()`` for an output without a mesh."""
        return [self.fusion.tensor(o).sharding or Sharding.unsharded() for o in self.returned()]

    def summary(self):
        """Per segment: bytes sent/received per rank, FLOPs, fused or not (see ``tp_fusion.summary``)."""
        from tp_fusion.summary import summarize

        return summarize(self)

    def with_choices(self, modes: dict[int, str], cuda_graph: bool, notes: tuple[str, ...],
                     gelu_apart: frozenset[int] | None = None, kernels: dict | None = None) -> Program:
        """The program with tuning's choices recorded: ``modes`` by fused segment index, (if given) the
        fused kernels' knobs by index (``kernels``: ``overlap.Tuning``) and which GELUs run apart from
        their GEMM."""
        kernels = kernels or {}
        segs = tuple(seg if i not in modes and i not in kernels else dataclasses.replace(
            seg, fused=dataclasses.replace(seg.fused, mode=modes.get(i, seg.fused.mode),
                                           tuning=kernels.get(i, seg.fused.tuning)))
            for i, seg in enumerate(self.segments))
        return dataclasses.replace(self, segments=segs, cuda_graph=cuda_graph, notes=notes,
                                   gelu_apart=self.gelu_apart if gelu_apart is None else gelu_apart)

    def gelu_pairs(self, seg: ProgramSegment) -> dict[int, bool]:
        """For a segment's GEMM+GELU pairs (``gelu_epilogues``): step index of the GEMM -> whether the
        GELU runs in the GEMM's epilogue."""
        return {j: seg.steps[j + 1].op.outputs[0] not in self.gelu_apart
                for j in sorted(gelu_epilogues(self.fusion, seg.steps))}

    def __repr__(self) -> str:
        """One line, as a REPL or a debugger shows ``fd.plan`` (``str`` prints the segments)."""
        n = len(self.segments)
        return f"<Plan: {n} segment{'' if n == 1 else 's'} on rank {self.rank} ({self.device}), collectives " \
               f"{self.collectives()}>"

    def __str__(self) -> str:
        f = self.fusion
        lines = [f"Plan: {len(self.segments)} segment(s); inputs [{', '.join(f'T{i}' for i in f.inputs)}], "
                 f"outputs [{', '.join(f'T{o}' for o in self.returned())}]"
                 + "".join(f", T{f.outputs[p]} written into input T{i}" for p, i in f.aliases)]
        for i, seg in enumerate(self.segments):
            head = f"  segment {i}: {seg.kind}"
            if seg.fused is not None:
                head += f" {seg.note} ({seg.fused.mode or 'undecided'})"
            elif seg.note:
                head += f" ({seg.note})"
            if i in self.overlapped:
                head += " (asynchronous: " + _overlap_text(*self.overlapped[i], len(self.segments)) + ")"
            pairs = self.gelu_pairs(seg) if seg.kind == "compute" else {}
            if pairs:
                inside = all(pairs.values())
                head += " (linear+gelu: " + ("bias and GELU in the GEMM's epilogue)" if inside else
                                             "the GELU apart from the GEMM, measured faster)")
            lines.append(head)
            for s in seg.steps:
                outs = " ".join(f"{f.tensor(o).type_str()}{f.tensor(o).sharding_str()}" for o in s.op.outputs)
                lines.append(f"    {s.op} : {outs}")
        if self.cuda_graph:
            lines.append("  replayed as a CUDA graph (measured faster than launching it eagerly)")
        lines += [f"  tuning: {note}" for note in self.notes]
        return "\n".join(lines)


def _overlap_text(issued_after: int, awaited_before: int, n: int) -> str:
    issued = "issued at the start" if issued_after < 0 else f"issued after segment {issued_after}"
    awaited = "awaited at the end" if awaited_before >= n else f"awaited before segment {awaited_before}"
    return f"{issued}, {awaited}"


_ASYNC_COLLECTIVES = (Collective.ALLGATHER, Collective.REDUCE_SCATTER, Collective.ALLREDUCE)


def schedule_collectives(segments: Sequence[ProgramSegment]) -> dict[int, tuple[int, int]]:
    """Which communication segments run asynchronously, and where: a segment of one allgather,
    reduce_scatter or allreduce is issued as soon as its input exists (after the segment that produces
    it; at the start for a fusion input) and awaited just before the first segment that reads its
    result (at the end for a result that only leaves the fusion), so that the segments in between run
    while it communicates. Only where that leaves at least one segment in between, and not for the result
    of another asynchronous collective (chained reshardings run in order). An allreduce that
    reduces its input in place waits for that input's other readers. A process group runs its
    collectives in the order they are issued, so an asynchronous one is not issued before a collective
    that runs in order and is needed sooner (it would wait behind it): it goes after the last such
    communication segment before its own wait (fused segments are not counted: in fused mode they
    communicate through the copy engines). Collectives issued at one point go in the order they are
    awaited. The schedule depends on the segments alone, so every rank issues the same collectives in the
    same order. ``build_program`` uses it for CUDA programs."""
    where: dict[int, int] = {}  # tensor -> the segment that produces it
    readers: dict[int, list[int]] = {}  # tensor -> the segments that read it, in order
    for i, seg in enumerate(segments):
        for s in seg.steps:
            for a in s.op.tensor_inputs:
                readers.setdefault(a, []).append(i)
            for o in s.op.outputs:
                where[o] = i
    windows = {}  # segment -> (earliest issue, wait), for every candidate
    for i, seg in enumerate(segments):
        if seg.kind != "communication" or len(seg.steps) != 1 or seg.steps[0].collective not in _ASYNC_COLLECTIVES:
            continue
        step = seg.steps[0]
        (x,), (result,) = step.op.tensor_inputs, step.op.outputs
        issue = where.get(x, -1)
        if step.donate:  # reduced in place: not before the input's other readers are done with it
            issue = max([issue, *(j for j in readers.get(x, []) if j < i)])
        later = [j for j in readers.get(result, []) if j > i]
        windows[i] = (issue, later[0] if later else len(segments))
    # Candidates drop out until none does (one that drops out runs in order, which may push others later).
    out = dict(windows)
    while True:
        in_order = [j for j, seg in enumerate(segments) if seg.kind == "communication" and j not in out]
        kept = {}
        for i, (first, wait) in windows.items():
            if i not in out or first in out:  # dropped out, or its input comes from an asynchronous collective
                continue
            issue = max([first, *(j for j in in_order if j < wait)])
            if any(j != i for j in range(issue + 1, wait)):  # some other segment runs in between
                kept[i] = (issue, wait)
        if kept == out:
            return out
        out = kept


def local_shape(fusion: Fusion, name: int) -> tuple[int, ...]:
    t = fusion.tensor(name)
    return t.sharding.local_shape(t.shape) if t.sharding else t.shape


_MOVES = (Collective.BROADCAST, Collective.GATHER, Collective.REDUCE, Collective.SCATTER)


def _move_group(op: Op) -> tuple[int, ...]:
    """The ranks of a move between meshes that runs as one collective (one of ``_MOVES``), in increasing
    order: a broadcast's source is the first device of its mesh."""
    src, dst = op.attr("src_mesh"), op.attr("dst_mesh")
    senders = src.devices[:1] if Collective(op.kind) is Collective.BROADCAST else src.devices
    return tuple(sorted({*senders, *dst.devices}))


def _all_groups(fusion: Fusion, op: Op) -> list[tuple[int, ...]]:
    """Every group ``op`` uses on any rank."""
    c = Collective(op.kind)
    if c in _MOVES:
        return [_move_group(op)]
    if c in (Collective.SEND_RECV, Collective.LOCAL_SLICE, Collective.TO_PARTIAL):
        return []
    return fusion.tensor(op.inputs[0]).sharding.mesh.all_axis_groups(op.attr("mesh_axis"))


def _communicate(fusion: Fusion, op: Op, rank: int, donate: bool) -> Communicate:
    c = Collective(op.kind)
    out = fusion.tensor(op.outputs[0])
    if c is Collective.SEND_RECV:
        src, dst = op.attr("src_mesh"), op.attr("dst_mesh")
        runs_here, group = rank in set(src.devices) | set(dst.devices), None
    elif c in _MOVES:
        group = _move_group(op)
        runs_here = rank in group
    else:
        mesh = fusion.tensor(op.inputs[0]).sharding.mesh
        runs_here = rank in mesh
        group = mesh.axis_group(op.attr("mesh_axis"), rank) if runs_here else None
    return Communicate(op, c, group, local_shape(fusion, out.name), out.dtype, donate, runs_here)


def _compute(fusion: Fusion, op: Op, rank: int, device: torch.device) -> Compute:
    od = opdef(op.kind)
    attrs = dict(op.attrs)
    if od.localize is not None:
        ins = [a if isinstance(a, int) else None for a in op.inputs]

        def in_indices(i: int, d: int) -> torch.Tensor:
            t = fusion.tensor(ins[i])
            return torch.arange(t.shape[d]) if t.sharding is None else t.sharding.local_indices(rank, d, t.shape[d])
        attrs = od.localize(attrs, Localize(
            in_global=[None if a is None else fusion.tensor(a).shape for a in ins],
            in_local=[None if a is None else local_shape(fusion, a) for a in ins],
            out_local=local_shape(fusion, op.outputs[0]), device=device, in_indices=in_indices))
    return Compute(op, tuple(attrs.items()), fusion.tensor(op.outputs[0]).held_by(rank))


def gelu_epilogues(fusion: Fusion, steps: Sequence[Instruction]) -> set[int]:
    """Indices ``j`` of compute ``steps`` where ``steps[j]`` is a linear with a bias and a 2-D weight whose
    result only ``steps[j + 1]``, a tanh-GELU, reads: the pair runs as one call (``overlap.linear``), the
    GEMM with the bias and, unless tuning measured it slower (``Program.gelu_apart``), the GELU in its
    epilogue (cuBLASLt GELU_BIAS on CUDA), saving a pass over the result."""
    found = set()
    for j in range(len(steps) - 1):
        gemm, act = steps[j], steps[j + 1]
        if not (isinstance(gemm, Compute) and isinstance(act, Compute)):
            continue
        result = gemm.op.outputs[0]
        if (opdef(gemm.op.kind) is opdef("linear") and is_biased_gemm(gemm.op) and is_plain_gemm(gemm.op, fusion)
                and all(isinstance(a, int) for a in gemm.op.inputs)
                and is_tanh_gelu(act.op.kind, dict(act.attrs))
                and act.op.inputs == (result,) and len(fusion.consumers(result)) == 1
                and result not in fusion.outputs):
            found.add(j)
    return found


def _donatable(fusion: Fusion, name: int, i: int, keep: set, last_use: dict) -> bool:
    """Whether op ``i`` may overwrite tensor ``name``: its last use, no fusion input or output,
    and no view of or into another tensor (those may still be read)."""
    producer = fusion.producer(name)
    return (name not in keep and last_use.get(name) == i
            and (producer is None or not traits(producer.kind) & Trait.VIEW)
            and all(not traits(c.kind) & Trait.VIEW for c in fusion.consumers(name)))


def _fused(fusion: Fusion, ops: list[Op], steps: list[Instruction], rank: int) -> FusedGemm:
    comm = next(op for op in ops if traits(op.kind) & Trait.COLLECTIVE)
    gemm = next(op for op in ops if traits(op.kind) & Trait.GEMM)
    collective = Collective(comm.kind)
    mesh = fusion.tensor(comm.inputs[0]).sharding.mesh
    runs_here = rank in mesh
    after = ops[ops.index(gemm) + 1:] if collective is Collective.ALLGATHER else []
    addends = {} if collective is Collective.ALLGATHER else \
        reduction_addends(fusion, comm.outputs[0], ops[ops.index(comm) + 1:])
    # A reduction's GEMM has no bias of its own: a row-parallel bias is added once, to the reduced rows.
    bias = gemm.inputs[2] if len(gemm.inputs) == 3 else addends.get("bias")
    by_op = {id(s.op): s for s in steps}
    return FusedGemm(
        collective=collective, x=comm.inputs[0] if collective is Collective.ALLGATHER else gemm.inputs[0],
        weight=gemm.inputs[1], transpose_weight=not opdef(gemm.kind).weight_out_in, bias=bias,
        residual=addends.get("residual"),
        epilogue=tuple((op.kind, by_op[id(op)].attrs) for op in after), out=ops[-1].outputs[0],
        dim=comm.attr("dim"), group=mesh.axis_group(comm.attr("mesh_axis"), rank) if runs_here else (),
        runs_here=runs_here, group_size=mesh.numel_along(comm.attr("mesh_axis")))


def build_program(fusion: Fusion, rank: int, device: torch.device) -> Program:
    """This rank's program for a lowered and segmented fusion."""
    last_use = {}
    for i, op in enumerate(fusion.ops):
        for a in op.tensor_inputs:
            last_use[a] = i
    keep = set(fusion.inputs) | set(fusion.outputs)
    segments = []
    for seg in fusion.segments:
        steps: list[Instruction] = []
        for i in seg.ops:
            op = fusion.ops[i]
            if traits(op.kind) & (Trait.COLLECTIVE | Trait.LOCAL_RESHARD):
                steps.append(_communicate(fusion, op, rank, _donatable(fusion, op.inputs[0], i, keep, last_use)))
            else:
                steps.append(_compute(fusion, op, rank, device))
        fused = _fused(fusion, [fusion.ops[i] for i in seg.ops], steps, rank) if seg.kind == "fused" else None
        segments.append(ProgramSegment(seg.kind, seg.note, tuple(steps), fused))
    outputs = tuple((o, fusion.tensor(o).held_by(rank)) for o in fusion.outputs)
    # Asynchronous collectives on CUDA only: NCCL's wait holds the stream, not the host, and the GPU
    # guards bound it (runtime.faults); a gloo wait whose peer failed blocked the host until the
    # group's timeout (60 s in tests/multidevice/test_reliability.py) instead of failing promptly.
    overlapped = schedule_collectives(segments) if device.type == "cuda" else {}
    return Program(fusion, rank, device, tuple(segments), outputs, overlapped=overlapped)
