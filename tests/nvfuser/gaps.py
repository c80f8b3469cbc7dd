"""What tp_fusion still lacks for the nvFuser ports, one constant per gap (issue 14's list; closed
gaps are gone, docs/nvfuser.md lists them).

A port that fails for a known gap is marked ``@missing(GAP, ...)``: a strict xfail whose reason names
every gap the test needs (found by removing them one at a time), so a test that starts passing fails
CI until its mark is removed. docs/nvfuser.md lists the same gaps, ranked by the tests they unblock.

A gap that bites only at some world sizes is given as ``(GAP, "condition")``, e.g.
``(GAP, "world == 1")``. The condition is evaluated where the test body runs: ``world`` is the
number of ranks there (tests/nvfuser/conftest.py). In the pytest process that only spawns the gloo
ranks and collects their outcomes, ``world`` is 0 and no mark applies: the ranks judge, so a strict
xfail that passes on a rank fails the test.
"""

from __future__ import annotations

import pytest

# --- ops outside tp_fusion's op set ---
GROUPED_MM = "op outside the contract: fd.ops.grouped_mm(x, w, offsets)"


def missing(*gaps) -> pytest.MarkDecorator:
    """A strict xfail naming ``gaps``; each is a gap string or a (gap, condition on ``world``) pair."""
    reasons, conditions = [], []
    for gap in gaps:
        text, condition = gap if isinstance(gap, tuple) else (gap, None)
        reasons.append(text if condition is None else f"{text} (when {condition})")
        conditions.append("True" if condition is None else f"({condition})")
    condition = f"world > 0 and ({' or '.join(conditions)})"
    return pytest.mark.xfail(condition, reason="tp_fusion gaps: " + "; ".join(reasons), strict=True)
