"""Fusion -> Fusion passes and the pipeline that runs them."""

from __future__ import annotations

import os
import sys

from tp_fusion.passes.fuse_collectives import fuse_collectives
from tp_fusion.passes.insert_reshardings import insert_reshardings
from tp_fusion.passes.lower_communications import lower_communications
from tp_fusion.passes.propagate_shardings import propagate_shardings
from tp_fusion.passes.segment import segment
from tp_fusion.passes.verify import verify
from tp_fusion.ir import Fusion

PIPELINE = (propagate_shardings, insert_reshardings, lower_communications, segment, fuse_collectives)


def run_pipeline(fusion: Fusion, check: bool = False, pipeline=PIPELINE) -> Fusion:
    """Run the passes in order. ``check`` runs ``verify`` after each; ``TP_FUSION_DUMP=1`` prints
    the fusion after each pass to stderr (from rank 0 only under torch.distributed)."""
    dump = os.environ.get("TP_FUSION_DUMP", "") not in ("", "0") and os.environ.get("RANK", "0") == "0"
    for p in pipeline:
        fusion = p(fusion)
        if check:
            verify(fusion, p.__name__)
        if dump:
            print(f"=== after {p.__name__} ===\n{fusion}", file=sys.stderr)
    return fusion


__all__ = ["PIPELINE", "run_pipeline", "verify", "propagate_shardings", "insert_reshardings",
           "lower_communications", "segment", "fuse_collectives"]
