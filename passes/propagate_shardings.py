"""Give every tensor of a fusion with meshes a sharding, and every op the strategy it runs with."""

from __future__ import annotations

from tp_fusion.sharding.reshard import free_between
from tp_fusion.sharding.sharding import Sharding
from tp_fusion.sharding.strategy import Strategy, choose

from tp_fusion.ir import Fusion
from tp_fusion.mesh import DeviceMesh
from tp_fusion.ops import is_biased_gemm


def default_mesh(fusion: Fusion) -> DeviceMesh | None:
    """The mesh of the first tensor that has one (the fusion's mesh for unannotated inputs)."""
    return next((t.sharding.mesh for t in fusion.tensors if t.sharding is not None), None)


class _Draft:
    """The tensors of a fusion, updated in place while a pass walks its ops (what ``choose`` reads)."""

    def __init__(self, fusion: Fusion):
        self.tensors = list(fusion.tensors)
        self.copies: dict[int, Sharding] = {}  # tensors an op needs moved (summed, gathered): the first need

    def tensor(self, name: int):
        return self.tensors[name]

    def set_sharding(self, name: int, sharding: Sharding) -> None:
        self.tensors[name] = self.tensors[name].replace(sharding=sharding)


def propagate_shardings(fusion: Fusion) -> Fusion:
    """Requires: annotated tensors carry their sharding. Ensures: every tensor has a sharding and
    every op a ``strategy``; annotated tensors are unchanged; unannotated inputs are replicated on the
    fusion's mesh; no fusion output and no biased GEMM output is Partial (they are materialized).

    Forward: each op's unannotated outputs get what ``choose`` says the op produces. Backward:
    an unannotated replicated tensor computed only from replicated data (or from nothing, like
    ``full``) takes the sharding all its consumers need, so it is computed sharded instead of
    computed whole and sliced.
    """
    mesh = default_mesh(fusion)
    if mesh is None:
        return fusion
    draft = _Draft(fusion)
    for i in fusion.inputs:
        if draft.tensor(i).sharding is None:
            draft.set_sharding(i, Sharding.replicated(mesh))
    outputs = set(fusion.outputs)
    ops = []
    for op in fusion.ops:
        st = choose(op, draft, _hint(draft, op.outputs[0]), mesh, draft.copies)
        for a, need in zip(op.inputs, st.inputs):  # a move on the operand's own mesh that communicates
            if need is not None and not need.has_partial and draft.tensor(a).sharding.mesh == need.mesh \
                    and not free_between(draft.tensor(a).sharding, need):
                draft.copies.setdefault(a, need)
        for o, s in zip(op.outputs, st.outputs):
            if draft.tensor(o).annotated:
                continue
            if o in outputs or is_biased_gemm(op):
                s = s.materialized()
            draft.set_sharding(o, s)
        ops.append(op.replace(strategy=st))
    _backward(fusion, draft, ops, mesh)
    return fusion.replace(tensors=tuple(draft.tensors), ops=tuple(ops))


def _hint(draft: _Draft, name: int) -> Sharding | None:
    t = draft.tensor(name)
    return t.sharding if t.annotated else None


def _backward(fusion: Fusion, draft: _Draft, ops: list, mesh: DeviceMesh) -> None:
    """See ``propagate_shardings``; updates ``draft`` and the producers' strategies in ``ops``.
    Fusion outputs take part (an output may come back sharded, as in nvFuser). A tensor materialized
    from a pending sum (a row-parallel linear's output) takes a Shard that all its consumers need
    too: the sum is then a reduce_scatter, not an allreduce and a slice."""
    index = {id(op): i for i, op in enumerate(fusion.ops)}
    for i in reversed(range(len(ops))):
        op = ops[i]
        from_replicated = all(draft.tensor(a).sharding.is_replicated for a in op.tensor_inputs)
        summed = {o for o, s in zip(op.outputs, op.strategy.outputs) if s.has_partial}
        if not from_replicated and not summed:
            continue
        changed = False
        for o in op.outputs:
            t = draft.tensor(o)
            if t.annotated or o in fusion.inputs or not t.sharding.is_replicated:
                continue
            if not (from_replicated or o in summed):
                continue
            needs = set()
            for consumer in fusion.consumers(o):
                st: Strategy = ops[index[id(consumer)]].strategy
                needs |= {st.inputs[k] for k, a in enumerate(consumer.inputs) if a == o}
            if len(needs) == 1:
                (need,) = needs
                if not need.is_replicated and not need.has_partial:
                    draft.set_sharding(o, need)
                    changed = True
        if changed and from_replicated:
            ops[i] = op.replace(strategy=choose(op, draft, draft.tensor(op.outputs[0]).sharding, mesh))
