"""Match a GEMM with the collective that feeds or follows it into one fused segment.

Patterns (the runtime overlaps their communication with the GEMM; see ``tp_fusion.runtime.overlap``):
- allgather -> GEMM, gathering rows the GEMM consumes (a non-last dim of its left operand); the
  ``EPILOGUE`` ops that follow on the GEMM result alone join it;
- GEMM without bias -> reduce_scatter over a non-last dim of the result, then the add of a bias
  ``[out]`` to the reduced rows that insert_reshardings placed after it (a row-parallel linear; the
  kernel adds it once, in one rank's GEMM epilogue), then the add of a residual: a tensor sharded as
  the reduced rows (the kernel adds it as the own rows' GEMM's C operand, so it costs no pass);
- GEMM without bias -> allreduce, and the adds of a bias and a residual likewise.
"""

from __future__ import annotations

from tp_fusion.sharding.reshard import Collective

from tp_fusion.ir import Fusion, Op, Segment, symbols_of
from tp_fusion.ops import OPS, Trait, is_plain_gemm, traits


def _single_use(fusion: Fusion, name: int) -> bool:
    return len(fusion.consumers(name)) == 1 and name not in fusion.outputs


def _collective(op: Op) -> Collective | None:
    return Collective(op.kind) if traits(op.kind) & Trait.COLLECTIVE else None


def _in_rank_order(fusion: Fusion, comm: Op) -> bool:
    """Whether every group of ``comm``'s mesh axis lists its ranks in increasing order, as the fused
    kernels need: they take a rank's chunk by its process-group rank (the plain collectives reorder)."""
    return fusion.tensor(comm.inputs[0]).sharding.mesh.unordered_group(comm.attr("mesh_axis")) is None


def _gathers_rows(fusion: Fusion, ag: Op, gemm: Op) -> bool:
    if not is_plain_gemm(gemm, fusion) or gemm.inputs[0] != ag.outputs[0] or ag.outputs[0] in gemm.inputs[1:]:
        return False
    return ag.attr("dim") < fusion.tensor(ag.outputs[0]).ndim - 1 and ag.attr("outer", 1) == 1


def _epilogue(fusion: Fusion, ops: tuple[int, ...], result: int) -> list[int]:
    """The leading ``ops`` that a fused allgather+GEMM runs on its result ``result`` as its epilogue: unary
    pointwise ops, each the one reader of the one before, that keep the GEMM's dtype (the kernels write
    the epilogue into the GEMM's output chunks; a cast to another dtype runs after the segment; so does an op
    whose attributes scalar inputs give per call)."""
    taken = []
    dtype = fusion.tensor(result).dtype
    for i in ops:
        op = fusion.ops[i]
        if not traits(op.kind) & Trait.EPILOGUE or op.inputs != (result,) or not _single_use(fusion, result) \
                or fusion.tensor(op.outputs[0]).dtype != dtype or symbols_of(op.attrs):
            break
        taken.append(i)
        result = op.outputs[0]
    return taken


def _bias_add(fusion: Fusion, op: Op, result: int) -> bool:
    """``op`` adds a replicated bias ``[out]`` to ``result`` (and nothing else reads ``result``)."""
    if OPS[op.kind] is not OPS["add"] or op.inputs[0] != result or not isinstance(op.inputs[1], int):
        return False
    bias, out = fusion.tensor(op.inputs[1]), fusion.tensor(result)
    return (_single_use(fusion, result) and bias.ndim == 1 and bias.shape[0] == out.shape[-1]
            and bias.dtype == out.dtype and bias.sharding is not None and bias.sharding.is_replicated)


def _residual_add(fusion: Fusion, op: Op, result: int) -> bool:
    """``op`` adds to ``result`` (read by nothing else) a tensor of its shape, dtype and sharding."""
    if OPS[op.kind] is not OPS["add"] or result not in op.inputs or not _single_use(fusion, result):
        return False
    other = op.inputs[1] if op.inputs[0] == result else op.inputs[0]
    if not isinstance(other, int) or other == result:
        return False
    res, out = fusion.tensor(other), fusion.tensor(result)
    return res.shape == out.shape and res.dtype == out.dtype and res.sharding == out.sharding


def reduction_addends(fusion: Fusion, result: int, ops: list[Op]) -> dict[str, int]:
    """Of the leading ``ops`` after a GEMM+reduction whose result is ``result``, those that join its fused
    segment, by role: ``{"bias": tensor, "residual": tensor}`` (each optional, in that order; the add
    that takes the residual may have it on either side). ``fuse_collectives`` takes the adds named
    here, and ``program`` reads the roles back from the segment's ops."""
    taken: dict[str, int] = {}
    for role, accepts in (("bias", _bias_add), ("residual", _residual_add)):
        if len(taken) < len(ops) and accepts(fusion, ops[len(taken)], result):
            op = ops[len(taken)]
            taken[role] = op.inputs[1] if op.inputs[0] == result else op.inputs[0]
            result = op.outputs[0]
    return taken


def fuse_collectives(fusion: Fusion) -> Fusion:
    """Requires: segment ran. Ensures: each matched pattern is one ``fused`` segment whose note
    names its ops (e.g. ``allgather+linear+gelu``); the other segments keep their ops in order."""
    segs = list(fusion.segments or ())
    out: list[Segment] = []
    i = 0
    while i < len(segs):
        seg, nxt = segs[i], segs[i + 1] if i + 1 < len(segs) else None
        if seg is None:  # wholly taken into the fused segment before it
            i += 1
            continue
        if seg.kind == "communication" and nxt is not None and nxt.kind == "compute":
            ag, gemm = fusion.ops[seg.ops[0]], fusion.ops[nxt.ops[0]]
            if (_collective(ag) is Collective.ALLGATHER and _single_use(fusion, ag.outputs[0])
                    and _gathers_rows(fusion, ag, gemm) and _in_rank_order(fusion, ag)):
                epi = _epilogue(fusion, nxt.ops[1:], gemm.outputs[0])
                taken = (seg.ops[0], nxt.ops[0], *epi)
                out.append(Segment("fused", taken, "+".join(fusion.ops[k].kind for k in taken)))
                rest = nxt.ops[1 + len(epi):]
                segs[i + 1] = Segment("compute", rest) if rest else None
                i += 1 if rest else 2
                continue
        if seg.kind == "compute" and nxt is not None and nxt.kind == "communication":
            gemm, comm = fusion.ops[seg.ops[-1]], fusion.ops[nxt.ops[0]]
            kind = _collective(comm)
            result = fusion.tensor(gemm.outputs[0])
            if (is_plain_gemm(gemm, fusion) and len(gemm.inputs) == 2 and comm.inputs[0] == gemm.outputs[0]
                    and _single_use(fusion, gemm.outputs[0])
                    and (kind is Collective.ALLREDUCE
                         or (kind is Collective.REDUCE_SCATTER and comm.attr("dim") < result.ndim - 1
                             and comm.attr("outer", 1) == 1 and _in_rank_order(fusion, comm)))):
                if len(seg.ops) > 1:
                    out.append(Segment("compute", seg.ops[:-1]))
                taken = [seg.ops[-1], nxt.ops[0]]
                after = segs[i + 2] if i + 2 < len(segs) else None
                if after is not None and after.kind == "compute":
                    adds = len(reduction_addends(fusion, comm.outputs[0], [fusion.ops[k] for k in after.ops]))
                    taken += after.ops[:adds]
                    rest = after.ops[adds:]
                    segs[i + 2] = Segment("compute", rest) if rest else None
                out.append(Segment("fused", tuple(taken), "+".join(fusion.ops[k].kind for k in taken)))
                i += 2
                continue
        if seg is not None:
            out.append(seg)
        i += 1
    return fusion.replace(segments=tuple(s for s in out if s is not None))
