"""What tp_fusion still lacks for the nvFuser ports, one constant per gap (issue 14's list).

A port that fails for a known gap is marked ``@missing(GAP, ...)``: a strict xfail whose reason names
every gap the test needs (found by removing them one at a time), so a test that starts passing fails
CI until its mark is removed. docs/nvfuser.md lists the same gaps, ranked by the tests they unblock.

A gap that bites only at some world sizes is given as ``(GAP, "condition")``, e.g.
``(SIZE1_MESH, "world == 1")``. The condition is evaluated where the test body runs: ``world`` is the
number of ranks there (tests/nvfuser/conftest.py). In the pytest process that only spawns the gloo
ranks and collects their outcomes, ``world`` is 0 and no mark applies: the ranks judge, so a strict
xfail that passes on a rank fails the test.
"""

from __future__ import annotations

import pytest

# --- define_tensor layout arguments ---
LAYOUT = "layout args: define_tensor(contiguity=, stride_order=) raise TypeError"
ALLOCATION_DOMAIN = "layout: tv.set_allocation_domain(axes, new_contiguity) is missing"
OUTPUT_LAYOUT = "layout: fusion outputs come back contiguous (an output does not keep its operands' stride order)"

# --- loop domains ---
REDUCTION_AXES = ("reduction axes: loop domains of linear/matmul/sum outputs lack r{K}, so split(-1)/axis(-2) "
                  "shard another dim (nvFuser's rfactor: a split reduction axis makes the output partial)")
RFACTOR = "missing spelling: tv.rfactor(axes) (nvFuser's manual rFactor of a split reduction axis)"

# --- symbolic extents ---
SYMBOLIC_UNSPLIT = ("symbolic extents: parallelizing an unsplit -1 axis (extent = mesh axis size, local "
                    "extent 1) is refused")
SYMBOLIC_LINEAR_BIAS = ("symbolic extents: a weight [-1, k] with a bias [n] is rejected at definition "
                        "(placeholder numbers in shape inference)")
SYMBOLIC_MANY = "symbolic extents: three or more -1 dims overflow shape inference (placeholder numbers)"
SYMBOLIC_SCALARS = ("symbolic extents: scalars from fd.ops.size/shape as broadcast_in_dim shapes and slice "
                    "bounds")

# --- device splits ---
DEVICE_SPLITS = "device splits: only the outermost piece of a split may be device-parallel (no strided shards)"
TWO_MESH_AXES = "device splits: two mesh axes cannot split the same dim"

# --- size-1 mesh axes ---
SIZE1_MESH = "size-1 mesh axes: a 1-device mesh axis still runs a collective"

# --- missing spellings ---
FUSION_INPUTS = "missing spelling: fd.fusion.inputs() (the input TensorViews)"
INNER_SPLIT = "missing spelling: tv.inner_split(axis, factor)"
REORDER = "missing spelling: tv.reorder({old: new})"
BROADCAST = "missing spelling: fd.ops.broadcast(x, is_broadcast_dim)"
SIZE_SHAPE_SLICE = "missing spelling: fd.ops.size, fd.ops.shape, fd.ops.slice"
DTYPE_METHOD = "missing spelling: tv.dtype() (a method in nvFuser, a property here)"
NEGATIVE_BROADCAST_DIMS = "missing spelling: negative broadcast_dims in broadcast_in_dim"
EXPANDED_BROADCAST = ("broadcast: a dim that broadcast_in_dim expands (to c_z) does not broadcast against "
                      "another extent (2 * c_z) in a pointwise op, as nvFuser's expanded broadcast does")

# --- ops outside tp_fusion's op set ---
LINEAR_3D_WEIGHT = ("op outside the contract: linear with a weight of more than 2 dims (nvFuser's logical-split "
                    "linear: [d, e, e] weight -> [d, b, s, e] output)")
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
