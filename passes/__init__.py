"""Fusion -> Fusion passes and the pipeline that runs them.

Each pass's docstring says what it requires and ensures; its ``ensures`` check (``passes.checks``)
is attached to it as ``pass.ensures`` and runs after it when the pipeline is asked to check
(the tests do; ``TP_FUSION_VERIFY=1`` does at execute).
"""

from __future__ import annotations

import os
import sys

from tp_fusion.passes import checks
from tp_fusion.passes.fuse_collectives import fuse_collectives
from tp_fusion.passes.insert_reshardings import insert_reshardings
from tp_fusion.passes.lower_communications import lower_communications
from tp_fusion.passes.propagate_shardings import propagate_shardings
from tp_fusion.passes.remove_unused import remove_unused
from tp_fusion.passes.segment import segment

from tp_fusion.ir import Fusion

remove_unused.ensures = checks.well_formed
propagate_shardings.ensures = checks.sharded
insert_reshardings.ensures = checks.resharded
lower_communications.ensures = checks.lowered
segment.ensures = checks.segmented
fuse_collectives.ensures = checks.segmented

PIPELINE = (remove_unused, propagate_shardings, insert_reshardings, lower_communications, segment, fuse_collectives)


def run_pipeline(fusion: Fusion, check: bool = False, pipeline=PIPELINE) -> Fusion:
    """Run the passes in order. ``check`` runs each pass's ``ensures`` after it; ``TP_FUSION_DUMP=1``
    prints the fusion after each pass to stderr (from rank 0 only under torch.distributed)."""
    dump = os.environ.get("TP_FUSION_DUMP", "") not in ("", "0") and os.environ.get("RANK", "0") == "0"
    for p in pipeline:
        fusion = p(fusion)
        if check:
            p.ensures(fusion)
        if dump:
            print(f"=== after {p.__name__} ===\n{fusion}", file=sys.stderr)
    return fusion


def verify(fusion: Fusion, after: str) -> None:
    """Run the ``ensures`` check of the pass named ``after`` (AssertionError naming what broke)."""
    next(p for p in PIPELINE if p.__name__ == after).ensures(fusion)


__all__ = ["PIPELINE", "run_pipeline", "verify", "remove_unused", "propagate_shardings", "insert_reshardings",
           "lower_communications", "segment", "fuse_collectives"]
