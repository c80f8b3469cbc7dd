"""Lower each resharding ``set`` into communications, one mesh axis at a time.

Per mesh axis (DTensor's redistribute table): Shard->Replicate allgather, Partial->Replicate
allreduce, Partial->Shard reduce_scatter, Shard(i)->Shard(j) all_to_all, Replicate->Shard a local
slice and Replicate->Partial a local ``to_partial`` (the value on mesh index 0, zeros elsewhere; no
communication). A change on several mesh axes becomes a sequence: free local steps first (less
data to move afterwards), then the rest; a step that would shard one dim on two mesh axes
waits, and if every remaining step waits, one axis is gathered first. A change of mesh moves
the data with send_recv (meshes of one shape, placements kept) or broadcast (otherwise, from the
source mesh's first device, replicated), with same-mesh steps before and after.
"""

from __future__ import annotations

from tp_fusion.sharding.sharding import REPLICATE, Partial, Replicate, Shard, Sharding
from tp_fusion.errors import LoweringError
from tp_fusion.ir import Fusion, Op, Tensor

# Op kinds that communicate (each becomes a communication segment), and those that stay local.
COLLECTIVES = ("allgather", "allreduce", "reduce_scatter", "all_to_all", "send_recv", "broadcast")
LOCAL_RESHARDS = ("slice", "to_partial")


def _step(src, dst) -> tuple[str, dict] | None:
    """The one-axis communication from placement ``src`` to ``dst``."""
    match src, dst:
        case Shard(), Replicate():
            return "allgather", {"dim": src.dim}
        case Partial(), Replicate():
            return "allreduce", {}
        case Partial(), Shard():
            return "reduce_scatter", {"dim": dst.dim}
        case Shard(), Shard():
            return "all_to_all", {"src_dim": src.dim, "dim": dst.dim}
        case Replicate(), Shard():
            return "slice", {"dim": dst.dim}
        case Replicate(), Partial():  # local: the value on mesh index 0, zeros elsewhere
            return "to_partial", {}
    return None


def same_mesh_steps(src: Sharding, dst: Sharding, what: str) -> list[tuple[str, dict, Sharding]]:
    """(kind, attrs, sharding after the step) for each step from ``src`` to ``dst`` on one mesh."""
    cur, steps = list(src.placements), []
    while cur != list(dst.placements):
        progressed = False
        for slices_only in (True, False):
            for axis in reversed(range(len(cur))):
                a, b = cur[axis], dst.placements[axis]
                if a == b or (slices_only and not isinstance(a, Replicate)):
                    continue
                if isinstance(b, Shard) and any(cur[o] == b for o in range(len(cur)) if o != axis):
                    continue  # would shard b.dim twice: wait for the other axis to let go of it
                step = _step(a, b)
                if step is None:
                    raise LoweringError(f"{what}: cannot reshard {src} -> {dst}: no lowering for {a} -> {b} "
                                        f"on mesh axis {axis}")
                cur[axis] = b
                steps.append((step[0], {"mesh_axis": axis, **step[1]}, Sharding(src.mesh, tuple(cur))))
                progressed = True
        if not progressed:  # every step waits on another: gather one axis first
            axis = next(a for a in reversed(range(len(cur))) if cur[a] != dst.placements[a])
            kind, attrs = _step(cur[axis], REPLICATE)
            cur[axis] = REPLICATE
            steps.append((kind, {"mesh_axis": axis, **attrs}, Sharding(src.mesh, tuple(cur))))
    return steps


def reshard_steps(src: Sharding, dst: Sharding, what: str) -> list[tuple[str, dict, Sharding]]:
    if src.mesh == dst.mesh:
        return same_mesh_steps(src, dst, what)
    if src.mesh.shape == dst.mesh.shape:
        moved = Sharding(dst.mesh, tuple(REPLICATE if isinstance(p, Partial) else p for p in src.placements))
        before = same_mesh_steps(src, Sharding(src.mesh, moved.placements), what)
        return before + [("send_recv", {"src_mesh": src.mesh, "dst_mesh": dst.mesh}, moved)] + \
            same_mesh_steps(moved, dst, what)
    replicated_src, replicated_dst = Sharding.replicated(src.mesh), Sharding.replicated(dst.mesh)
    before = same_mesh_steps(src, replicated_src, what)
    move = ("broadcast", {"src_mesh": src.mesh, "dst_mesh": dst.mesh}, replicated_dst)
    return before + [move] + same_mesh_steps(replicated_dst, dst, what)


def lower_communications(fusion: Fusion) -> Fusion:
    """Requires: insert_reshardings ran. Ensures: every ``set`` whose input and output shardings
    differ is replaced by a chain of communication ops (``COLLECTIVES``) and local slices, each
    acting on one mesh axis (or moving between meshes); intermediate tensors are new."""
    if not fusion.has_meshes:
        return fusion
    tensors, ops = list(fusion.tensors), []
    for op in fusion.ops:
        src_t, dst_t = (tensors[op.inputs[0]], tensors[op.outputs[0]]) if op.kind == "set" else (None, None)
        if src_t is None or src_t.sharding == dst_t.sharding:
            ops.append(op)
            continue
        steps = reshard_steps(src_t.sharding, dst_t.sharding, f"set T{src_t.name} -> T{dst_t.name}")
        cur = src_t.name
        for i, (kind, attrs, after) in enumerate(steps):
            if i == len(steps) - 1:
                out = dst_t.name
            else:
                out = len(tensors)
                tensors.append(Tensor(out, dst_t.shape, dst_t.dtype, after))
            ops.append(Op(kind, (cur,), (out,), tuple(attrs.items())))
            cur = out
    return fusion.replace(tensors=tuple(tensors), ops=tuple(ops))
