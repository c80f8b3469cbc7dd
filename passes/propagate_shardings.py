"""Give every tensor of a fusion with meshes a sharding."""

from __future__ import annotations

from tp_fusion.sharding.sharding import REPLICATE, Partial, Sharding
from tp_fusion.sharding.strategy import choose
from tp_fusion.ir import Fusion, Op
from tp_fusion.mesh import DeviceMesh


def default_mesh(fusion: Fusion) -> DeviceMesh | None:
    """The mesh of the first tensor that has one (the fusion's mesh for unannotated inputs)."""
    return next((t.sharding.mesh for t in fusion.tensors if t.sharding is not None), None)


def _materialized(s: Sharding) -> Sharding:
    return Sharding(s.mesh, tuple(REPLICATE if isinstance(p, Partial) else p for p in s.placements))


def _hint(op: Op, fusion: Fusion) -> Sharding | None:
    out = fusion.tensor(op.outputs[0])
    return out.sharding if out.annotated else None


def propagate_shardings(fusion: Fusion) -> Fusion:
    """Requires: annotated tensors carry their sharding. Ensures: every tensor has a sharding;
    annotated tensors are unchanged; unannotated inputs are replicated on the fusion's mesh; no
    fusion output and no biased linear output is Partial (they are materialized).

    Forward: each op's unannotated outputs get what ``choose`` says the op produces. Backward:
    an unannotated replicated tensor computed only from replicated data (or from nothing, like
    ``full``) takes the sharding all its consumers need, so it is computed sharded instead of
    computed whole and sliced.
    """
    mesh = default_mesh(fusion)
    if mesh is None:
        return fusion
    f = fusion.with_tensors({i: fusion.tensor(i).replace(sharding=Sharding.replicated(mesh))
                             for i in fusion.inputs if fusion.tensor(i).sharding is None})
    outputs = set(f.outputs)
    for op in f.ops:
        st = choose(op, f, _hint(op, f), mesh)
        updates = {}
        for o, s in zip(op.outputs, st.outputs):
            t = f.tensor(o)
            if t.annotated:
                continue
            biased_linear = op.kind == "linear" and isinstance(op.inputs[2], int)
            if o in outputs or biased_linear:
                s = _materialized(s)
            updates[o] = t.replace(sharding=s)
        f = f.with_tensors(updates)
    return _backward(f, mesh)


def _backward(f: Fusion, mesh: DeviceMesh) -> Fusion:
    pinned = set(f.inputs) | set(f.outputs)
    for op in reversed(f.ops):
        if not all(f.tensor(a).sharding.is_replicated for a in op.tensor_inputs):
            continue
        for o in op.outputs:
            t = f.tensor(o)
            if t.annotated or o in pinned or not t.sharding.is_replicated:
                continue
            needs = set()
            for consumer in f.consumers(o):
                st = choose(consumer, f, f.tensor(consumer.outputs[0]).sharding, mesh)
                needs |= {st.inputs[i] for i, a in enumerate(consumer.inputs) if a == o}
            if len(needs) == 1:
                (need,) = needs
                if not need.is_replicated and not need.has_partial:
                    f = f.with_tensors({o: t.replace(sharding=need)})
    return f
