"""Match a matmul with the collective that feeds or follows it into one fused segment.

Patterns (the runtime overlaps their communication with the GEMM on CUDA):
- allgather -> linear/matmul, gathering rows the GEMM consumes (a non-last dim of its left
  operand); the pointwise ops that follow on the GEMM result alone join as an epilogue;
- linear/matmul -> reduce_scatter over a non-last dim of the result;
- linear/matmul -> allreduce.
"""

from __future__ import annotations

from tp_fusion.ir import Fusion, Op, Segment

GEMMS = ("linear", "matmul")
EPILOGUE_OPS = ("gelu", "relu", "silu", "tanh", "sigmoid", "neg", "cast")


def _single_use(fusion: Fusion, name: int) -> bool:
    return len(fusion.consumers(name)) == 1 and name not in fusion.outputs


def _gathers_rows(fusion: Fusion, ag: Op, gemm: Op) -> bool:
    if gemm.kind not in GEMMS or gemm.inputs[0] != ag.outputs[0] or gemm.inputs[1] == ag.outputs[0]:
        return False
    x = fusion.tensor(ag.outputs[0])
    return ag.attr("dim") < x.ndim - 1 and (gemm.kind == "linear" or fusion.tensor(gemm.inputs[1]).ndim == 2)


def _epilogue(fusion: Fusion, ops: tuple[int, ...], start: int, result: int) -> list[int]:
    taken = []
    for i in ops[start:]:
        op = fusion.ops[i]
        if op.kind not in EPILOGUE_OPS or op.inputs != (result,) or not _single_use(fusion, result):
            break
        taken.append(i)
        result = op.outputs[0]
    return taken


def fuse_collectives(fusion: Fusion) -> Fusion:
    """Requires: segment ran. Ensures: each matched pattern is one ``fused`` segment whose note
    names it (e.g. ``allgather+linear+gelu``); the other segments are unchanged."""
    segs = list(fusion.segments or ())
    out: list[Segment] = []
    i = 0
    while i < len(segs):
        seg, nxt = segs[i], segs[i + 1] if i + 1 < len(segs) else None
        if seg.kind == "communication" and nxt is not None and nxt.kind == "compute":
            ag, gemm = fusion.ops[seg.ops[0]], fusion.ops[nxt.ops[0]]
            if ag.kind == "allgather" and _single_use(fusion, ag.outputs[0]) and _gathers_rows(fusion, ag, gemm):
                epi = _epilogue(fusion, nxt.ops, 1, gemm.outputs[0])
                fused = (seg.ops[0], nxt.ops[0], *epi)
                names = ["allgather", gemm.kind, *(fusion.ops[k].kind for k in epi)]
                out.append(Segment("fused", fused, "+".join(names)))
                rest = nxt.ops[1 + len(epi):]
                segs[i + 1] = Segment("compute", rest) if rest else None
                i += 1 if rest else 2
                continue
        if seg.kind == "compute" and nxt is not None and nxt.kind == "communication":
            gemm, comm = fusion.ops[seg.ops[-1]], fusion.ops[nxt.ops[0]]
            t = fusion.tensor(gemm.outputs[0])
            if (gemm.kind in GEMMS and comm.kind in ("reduce_scatter", "allreduce")
                    and comm.inputs[0] == gemm.outputs[0] and _single_use(fusion, gemm.outputs[0])
                    and (comm.kind == "allreduce" or comm.attr("dim") < t.ndim - 1)
                    and (gemm.kind == "linear" or fusion.tensor(gemm.inputs[1]).ndim == 2)
                    and (gemm.kind == "matmul" or not isinstance(gemm.inputs[2], int))):
                if len(seg.ops) > 1:
                    out.append(Segment("compute", seg.ops[:-1]))
                out.append(Segment("fused", (seg.ops[-1], nxt.ops[0]), f"{gemm.kind}+{comm.kind}"))
                i += 2
                continue
        if seg is not None:
            out.append(seg)
        i += 1
    return fusion.replace(segments=tuple(s for s in out if s is not None))
