"""Choosing how an op runs on a mesh: the placements it needs of its inputs and gives its outputs.

Shared by the propagation pass (which assigns output shardings) and the resharding pass (which
inserts ``set``s where an input's sharding differs from what the op needs), so both agree.
"""

from __future__ import annotations

from dataclasses import dataclass

from tp_fusion.sharding.rules import RULES, Candidate, preference
from tp_fusion.sharding.sharding import REPLICATE, Replicate, Shard, Sharding
from tp_fusion.errors import LoweringError
from tp_fusion.ir import Fusion, Op
from tp_fusion.mesh import DeviceMesh


@dataclass(frozen=True)
class Strategy:
    mesh: DeviceMesh
    inputs: tuple[Sharding | None, ...]  # what each operand must be (None: not a tensor)
    outputs: tuple[Sharding, ...]  # what the op produces


def _free(have, need) -> bool:
    """A transition that needs no communication: none, or a local slice of a replicated value."""
    return have == need or (isinstance(have, Replicate) and isinstance(need, Shard))


def op_mesh(op: Op, fusion: Fusion, hint: Sharding | None, default: DeviceMesh) -> DeviceMesh:
    if hint is not None:
        return hint.mesh
    for i in preference(op, fusion):
        s = fusion.tensor(op.inputs[i]).sharding
        if s is not None:
            return s.mesh
    return default


def choose(op: Op, fusion: Fusion, hint: Sharding | None, default_mesh: DeviceMesh) -> Strategy:
    """Pick, mesh axis by mesh axis (mesh_x first), a candidate of the op's rule:
    1. one that produces ``hint`` (the output's assigned sharding) with only free input transitions;
    2. else one that keeps the sharding of the first operand, in preference order, that is sharded;
    3. else replicate everything.
    Candidates that would shard one dim on two mesh axes are skipped.
    """
    if op.kind not in RULES:
        raise LoweringError(f"{op.kind}: no sharding rule for this op")
    mesh = op_mesh(op, fusion, hint, default_mesh)
    have = []
    for a in op.inputs:
        s = fusion.tensor(a).sharding if isinstance(a, int) else None
        have.append(None if not isinstance(a, int) else
                    s.placements if s is not None and s.mesh == mesh else (REPLICATE,) * mesh.ndim)
    need_in = [None if h is None else [None] * mesh.ndim for h in have]
    need_out = [[None] * mesh.ndim for _ in op.outputs]
    order = preference(op, fusion)
    for axis in reversed(range(mesh.ndim)):
        cands = [c for c in RULES[op.kind](op, fusion, mesh.shape[axis]) if _compatible(c, need_in, need_out)]
        pick = None
        if hint is not None:
            pick = next((c for c in cands if c.outputs[0] == hint.placements[axis]
                         and all(h is None or _free(h[axis], p) for h, p in zip(have, c.inputs))), None)
        for i in order if pick is None else ():
            p = have[i][axis]
            if isinstance(p, Replicate):
                continue
            matching = [c for c in cands if c.inputs[i] == p]
            if matching:
                pick = min(matching, key=lambda c: sum(h is not None and not _free(h[axis], q)
                                                       for h, q in zip(have, c.inputs)))
                break
        pick = pick or cands[0]
        for i, p in enumerate(pick.inputs):
            if need_in[i] is not None:
                need_in[i][axis] = p
        for j, p in enumerate(pick.outputs):
            need_out[j][axis] = p
    return Strategy(mesh, tuple(None if n is None else Sharding(mesh, tuple(n)) for n in need_in),
                    tuple(Sharding(mesh, tuple(n)) for n in need_out))


def _compatible(c: Candidate, need_in, need_out) -> bool:
    for placements, chosen in zip((*c.inputs, *c.outputs), (*need_in, *need_out)):
        if isinstance(placements, Shard) and chosen is not None and placements in chosen:
            return False
    return True
