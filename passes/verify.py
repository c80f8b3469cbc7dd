"""Invariants of a fusion after each pass; used by the tests after every pass."""

from __future__ import annotations

from tp_fusion.passes.lower_communications import COLLECTIVES, LOCAL_RESHARDS
from tp_fusion.passes.propagate_shardings import default_mesh
from tp_fusion.sharding.sharding import Partial
from tp_fusion.sharding.strategy import choose
from tp_fusion.ir import Fusion

_STAGES = ("propagate_shardings", "insert_reshardings", "lower_communications", "segment", "fuse_collectives")


def verify(fusion: Fusion, after: str) -> None:
    """Raise AssertionError naming the broken invariant. ``after`` is the name of the last pass."""
    stage = _STAGES.index(after)
    defined = set(fusion.inputs)
    for op in fusion.ops:
        for a in op.tensor_inputs:
            assert a in defined, f"{op}: T{a} used before it is defined"
        for o in op.outputs:
            assert o not in defined, f"{op}: T{o} defined twice"
            defined.add(o)
    for o in fusion.outputs:
        assert o in defined, f"output T{o} is never defined"
    mesh = default_mesh(fusion)
    if mesh is None:
        return
    for t in fusion.tensors:
        if t.name in defined:
            assert t.sharding is not None, f"T{t.name} has no sharding after {after}"
    for o in fusion.outputs:
        assert not any(isinstance(p, Partial) for p in fusion.tensor(o).sharding.placements), f"output T{o} is Partial"
    if stage >= 1:
        for op in fusion.ops:
            if op.kind in ("set", *LOCAL_RESHARDS, *COLLECTIVES):
                continue
            st = choose(op, fusion, fusion.tensor(op.outputs[0]).sharding, mesh)
            for a, need in zip(op.inputs, st.inputs):
                if isinstance(a, int):
                    assert fusion.tensor(a).sharding == need, f"{op}: T{a} is {fusion.tensor(a).sharding}, needs {need}"
            for o, got in zip(op.outputs, st.outputs):
                assert fusion.tensor(o).sharding == got, f"{op}: produces {got}, T{o} is {fusion.tensor(o).sharding}"
    if stage >= 2:
        for op in fusion.ops:
            if op.kind == "set":
                src, dst = (fusion.tensor(op.inputs[0]).sharding, fusion.tensor(op.outputs[0]).sharding)
                assert src == dst, f"{op}: a resharding set survived lowering"
    if stage >= 3:
        covered = [i for s in fusion.segments for i in s.ops]
        assert covered == list(range(len(fusion.ops))), "segments do not cover the ops once, in order"
        for s in fusion.segments:
            comms = [i for i in s.ops if fusion.ops[i].kind in COLLECTIVES]
            assert len(comms) <= 1, f"segment {s} holds {len(comms)} communications"
            assert s.kind != "compute" or not comms, f"compute segment {s} communicates"
