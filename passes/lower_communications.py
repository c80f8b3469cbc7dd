"""Lower each resharding ``set`` into the steps of the resharding table (``tp_fusion.sharding.reshard``)."""

from __future__ import annotations

from tp_fusion.sharding.reshard import reshard_steps

from tp_fusion.ir import Fusion, Op, Tensor
from tp_fusion.ops import Trait, traits


def lower_communications(fusion: Fusion) -> Fusion:
    """Requires: insert_reshardings ran. Ensures: every ``set`` whose input and output shardings
    differ is replaced by one op per ``ReshardStep`` (a collective, or a local slice), each acting
    on one mesh axis or moving between meshes; intermediate tensors are new. A set whose destination's
    devices hold their pieces already (``held_already``: shardings that differ only on mesh axes of
    size 1, a replicated value kept on some of its devices) stays a local copy. A step that an earlier
    set ran already, on the same tensor with the same arguments, runs once: the later set goes on from
    its result (two moves of x that both start by gathering it, to slice it in two ways, gather it once;
    a pending max read in two shardings is allreduced once), or copies it where it was its last step."""
    if not fusion.has_meshes:
        return fusion
    tensors, ops = list(fusion.tensors), []
    made: dict[tuple, int] = {}  # (input, collective, arguments, sharding after) -> the step's result
    for op in fusion.ops:
        if not traits(op.kind) & Trait.RESHARD:
            ops.append(op)
            continue
        src_t, dst_t = tensors[op.inputs[0]], tensors[op.outputs[0]]
        steps = reshard_steps(src_t.sharding, dst_t.sharding, dst_t.shape, f"set T{src_t.name} -> T{dst_t.name}")
        if not steps:
            ops.append(op)
            continue
        cur = src_t.name
        for i, step in enumerate(steps):
            last, attrs = i == len(steps) - 1, tuple(step.attrs().items())
            key = (cur, step.collective, attrs, step.after)
            if key in made and step.collective.communicates:
                cur = made[key]
                if last:  # the set's own result: a local copy of the one made before
                    ops.append(Op(op.kind, (cur,), (dst_t.name,)))
                continue
            if last:
                out = dst_t.name
            else:
                out = len(tensors)
                tensors.append(Tensor(out, dst_t.shape, dst_t.dtype, step.after))
            ops.append(Op(step.collective.value, (cur,), (out,), attrs))
            made[key] = cur = out
    return fusion.replace(tensors=tuple(tensors), ops=tuple(ops))
