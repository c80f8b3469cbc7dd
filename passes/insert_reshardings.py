"""Insert a resharding ``set`` wherever a tensor's sharding differs from what its consumer needs."""

from __future__ import annotations

from tp_fusion.passes.propagate_shardings import default_mesh
from tp_fusion.sharding.sharding import REPLICATE, Partial, Shard, Sharding
from tp_fusion.sharding.strategy import choose
from tp_fusion.ir import Const, Fusion, Op, Tensor


def insert_reshardings(fusion: Fusion) -> Fusion:
    """Requires: every tensor has a sharding (propagate_shardings). Ensures: every op but ``set``
    gets its inputs in the shardings its rule needs and produces exactly its outputs' shardings;
    every change of sharding is a ``set`` of its own (one per tensor and target, reused).

    A linear whose contraction is sharded and that has a bias is split into a linear without bias
    (Partial), the resharding of that result, and an add of the bias: the bias is added once.
    """
    mesh = default_mesh(fusion)
    if mesh is None:
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
        if op.kind == "set":
            ops.append(op)
            continue
        st = choose(op, fusion, fusion.tensor(op.outputs[0]).sharding, mesh)
        args = tuple(reshard(a, s) if isinstance(a, int) else a for a, s in zip(op.inputs, st.inputs))
        if op.kind == "linear" and isinstance(op.inputs[2], int) and st.outputs[0].has_partial:
            out = op.outputs[0]
            partial = new_tensor(out, st.outputs[0])
            ops.append(Op("linear", (args[0], args[1], Const(None)), (partial,)))
            target = tensors[out].sharding
            bias_target = Sharding(target.mesh, tuple(
                Shard(0) if p == Shard(len(tensors[out].shape) - 1) else REPLICATE for p in target.placements))
            ops.append(Op("add", (reshard(partial, target), reshard(op.inputs[2], bias_target)), (out,)))
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
    for o in fusion.outputs:
        assert not any(isinstance(p, Partial) for p in tensors[o].sharding.placements), f"T{o} left Partial"
    return fusion.replace(tensors=tuple(tensors), ops=tuple(ops))
