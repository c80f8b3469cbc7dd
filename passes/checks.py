"""The ``ensures`` checks of the passes; each includes those of the passes before it."""

from __future__ import annotations

from tp_fusion.sharding.reshard import held_already

from tp_fusion.ir import Fusion
from tp_fusion.ops import Trait, traits


def well_formed(fusion: Fusion) -> None:
    """Every tensor is defined once, before use; every output is defined."""
    defined = set(fusion.inputs)
    for op in fusion.ops:
        for a in op.tensor_inputs:
            assert a in defined, f"{op}: T{a} used before it is defined"
        for o in op.outputs:
            assert o not in defined, f"{op}: T{o} defined twice"
            defined.add(o)
    for o in fusion.outputs:
        assert o in defined, f"output T{o} is never defined"


def sharded(fusion: Fusion) -> None:
    """propagate_shardings: every tensor has a sharding, every op a strategy, no output is Partial."""
    well_formed(fusion)
    if not fusion.has_meshes:
        return
    for op in fusion.ops:
        assert op.strategy is not None or traits(op.kind) & (Trait.COLLECTIVE | Trait.LOCAL_RESHARD | Trait.RESHARD), \
            f"{op}: no strategy recorded"
        for o in (*op.tensor_inputs, *op.outputs):
            assert fusion.tensor(o).sharding is not None, f"T{o} has no sharding"
    for o in fusion.outputs:
        t = fusion.tensor(o)
        assert t.annotated or not t.sharding.has_partial, f"output T{o} is Partial"


def resharded(fusion: Fusion) -> None:
    """insert_reshardings: every op but a resharding gets exactly what its recorded strategy says; an output
    aliased to an input has its sharding."""
    sharded(fusion)
    if not fusion.has_meshes:
        return
    for op in fusion.ops:
        if traits(op.kind) & (Trait.RESHARD | Trait.COLLECTIVE | Trait.LOCAL_RESHARD):
            continue
        st = op.strategy
        for a, need in zip(op.inputs, st.inputs):
            if isinstance(a, int):
                assert fusion.tensor(a).sharding == need, f"{op}: T{a} is {fusion.tensor(a).sharding}, needs {need}"
        for o, got in zip(op.outputs, st.outputs):
            assert fusion.tensor(o).sharding == got, f"{op}: produces {got}, T{o} is {fusion.tensor(o).sharding}"
    for o in fusion.outputs:
        assert not fusion.tensor(o).sharding.has_partial, f"output T{o} is Partial"
    for p, i in fusion.aliases:
        o = fusion.outputs[p]
        assert fusion.tensor(o).sharding == fusion.tensor(i).sharding, f"output T{o} is sharded otherwise than T{i}"


def lowered(fusion: Fusion) -> None:
    """lower_communications: no set moves data any more (``held_already``: each device of its output
    holds its piece already under its input's sharding)."""
    resharded(fusion)
    for op in fusion.ops:
        if traits(op.kind) & Trait.RESHARD:
            src, dst = fusion.tensor(op.inputs[0]).sharding, fusion.tensor(op.outputs[0]).sharding
            shape = fusion.tensor(op.outputs[0]).shape
            assert src is None or held_already(src, dst, shape), f"{op}: a resharding set survived lowering"


def segmented(fusion: Fusion) -> None:
    """segment / fuse_collectives: segments cover the ops once, in order; one collective at most
    per segment, none in a compute segment."""
    lowered(fusion)
    covered = [i for s in fusion.segments for i in s.ops]
    assert covered == list(range(len(fusion.ops))), "segments do not cover the ops once, in order"
    for s in fusion.segments:
        comms = [i for i in s.ops if traits(fusion.ops[i].kind) & Trait.COLLECTIVE]
        assert len(comms) <= 1, f"segment {s} holds {len(comms)} communications"
        assert s.kind != "compute" or not comms, f"compute segment {s} communicates"
