"""Drop the ops whose results reach no output of the fusion."""

from __future__ import annotations

from tp_fusion.ir import Fusion


def remove_unused(fusion: Fusion) -> Fusion:
    """Requires: a well-formed fusion. Ensures: every op has an output that a fusion output depends on
    (as nvFuser's fusion does: an op nothing needs runs no kernel and no collective; its random draws
    change nothing else, as every random op names its own seed and offset). Tensors keep their names."""
    needed = set(fusion.outputs)
    kept = []
    for op in reversed(fusion.ops):
        if needed.intersection(op.outputs):
            kept.append(op)
            needed.update(op.tensor_inputs)
    if len(kept) == len(fusion.ops):
        return fusion
    return fusion.replace(ops=tuple(reversed(kept)))
