"""Insert a resharding ``set`` wherever a tensor's sharding differs from what its consumer needs."""

from __future__ import annotations

from tp_fusion.sharding.sharding import REPLICATE, Partial, Placement, Shard, Sharding
from tp_fusion.sharding.strategy import Strategy

from tp_fusion.ir import Fusion, Op, Tensor
from tp_fusion.ops import Trait, is_biased_gemm, traits


def insert_reshardings(fusion: Fusion) -> Fusion:
    """Requires: every tensor has a sharding and every op its ``strategy`` (propagate_shardings).
    Ensures: every op but ``set`` gets its inputs in the shardings its strategy needs and produces
    exactly its outputs' shardings; every change of sharding is a ``set`` of its own (one per tensor
    and target, reused); no fusion output is Partial (an output the user scheduled with a pending
    sum is summed by a ``set``, as nvFuser's device-parallel reduction axis finishes its reduction).

    A linear whose contraction is sharded and that has a bias is split into a linear without bias
    (Partial), the resharding of that result, and an add of the bias: the bias is added once.
    """
    if not fusion.has_meshes:
        return fusion
    tensors = list(fusion.tensors)
    ops: list[Op] = []
    cache: dict[tuple[int, Sharding], int] = {}

    def new_tensor(like: int, sharding: Sharding) -> int:
        t = tensors[like]
        tensors.append(Tensor(len(tensors), t.shape, t.dtype, sharding))
        return len(tensors) - 1

    def reshard(name: int, target: Sharding) -> int:
        if tensors[name].sharding == target:
            return name
        if (name, target) not in cache:
            cache[(name, target)] = out = new_tensor(name, target)
            ops.append(Op("set", (name,), (out,)))
        return cache[(name, target)]

    for op in fusion.ops:
        if traits(op.kind) & Trait.RESHARD:  # a set between two shardings: lowering's job
            ops.append(op)
            continue
        st: Strategy = op.strategy
        args = tuple(reshard(a, s) if isinstance(a, int) else a for a, s in zip(op.inputs, st.inputs))
        if is_biased_gemm(op) and st.outputs[0].has_partial:
            out, target = op.outputs[0], tensors[op.outputs[0]].sharding
            partial = new_tensor(out, st.outputs[0])
            ops.append(Op("linear", args[:2], (partial,), strategy=Strategy(st.mesh, st.inputs[:2], st.outputs)))
            bias_target = Sharding(target.mesh, tuple(_bias_placement(p, tensors[out].ndim - 1)
                                                      for p in target.placements))
            add_args = (reshard(partial, target), reshard(op.inputs[2], bias_target))
            ops.append(Op("add", add_args, (out,), strategy=Strategy(st.mesh, (target, bias_target), (target,))))
            continue
        outs, after = [], []
        for o, natural in zip(op.outputs, st.outputs):
            if natural == tensors[o].sharding:
                outs.append(o)
            else:
                tmp = new_tensor(o, natural)
                outs.append(tmp)
                after.append(Op("set", (tmp,), (o,)))
        ops.append(op.replace(inputs=args, outputs=tuple(outs)))
        ops.extend(after)
    outputs = tuple(reshard(o, tensors[o].sharding.materialized()) for o in fusion.outputs)
    return fusion.replace(tensors=tuple(tensors), ops=tuple(ops), outputs=outputs)


def _bias_placement(p: Placement, last: int) -> Placement:
    """How the bias [out] must be placed to be added to a linear output placed ``p`` (``last``: its out
    dim): sharded as the out dim is, partial (on one device) where the output is a pending sum."""
    if isinstance(p, Shard) and p.dim == last:
        return Shard(0, p.outer)
    return p if isinstance(p, Partial) else REPLICATE
