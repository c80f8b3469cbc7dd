"""Group a lowered fusion's ops into segments: compute runs between communications."""

from __future__ import annotations

from tp_fusion.ir import Fusion, Segment
from tp_fusion.ops import Trait, traits


def segment(fusion: Fusion) -> Fusion:
    """Requires: lower_communications ran. Ensures: ``fusion.segments`` covers every op once, in
    order; each communication op is a segment of its own; maximal runs of local ops (compute,
    local copies and slices) form compute segments."""
    segments: list[Segment] = []
    run: list[int] = []
    for i, op in enumerate(fusion.ops):
        if traits(op.kind) & Trait.COLLECTIVE:
            if run:
                segments.append(Segment("compute", tuple(run)))
                run = []
            segments.append(Segment("communication", (i,)))
        else:
            run.append(i)
    if run:
        segments.append(Segment("compute", tuple(run)))
    return fusion.replace(segments=tuple(segments))
