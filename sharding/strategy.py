"""Choosing how an op runs on a mesh: the placements it needs of its inputs and gives its outputs.

The propagation pass calls ``choose`` once per op and records the result on the op
(``Op.strategy``); the resharding pass and the checks read that record. A candidate is chosen
only if the resharding table (``tp_fusion.sharding.reshard``) can bring every operand to what it
needs, so propagation and lowering agree by construction.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from tp_fusion.sharding.reshard import gathered, is_free, is_local, step_collective
from tp_fusion.sharding.rules import Candidate
from tp_fusion.sharding.sharding import REPLICATE, Partial, Placement, Replicate, Shard, Sharding

from tp_fusion.errors import LoweringError
from tp_fusion.ir import Fusion, Op
from tp_fusion.mesh import DeviceMesh
from tp_fusion.ops import Trait, opdef, traits


@dataclass(frozen=True)
class Strategy:
    """How one op runs: on ``mesh``, with operands in ``inputs`` and results in ``outputs``."""

    mesh: DeviceMesh
    inputs: tuple[Sharding | None, ...]  # what each operand must be (None: not a tensor)
    outputs: tuple[Sharding, ...]  # what the op produces


def preference(op: Op, fusion: Fusion) -> list[int]:
    """Operand positions in the order whose sharding an op follows: the op's ``follow`` (linear:
    the weight, then the bias, then the input, as nvFuser; matmul: B then A), else the most
    device-parallel operand first, the larger of two alike (the smaller one moves: a cross entropy's
    ``where(hit, logits, 0)`` keeps the logits' vocabulary shards and moves the boolean ``hit``)."""
    tensors = [i for i, a in enumerate(op.inputs) if isinstance(a, int)]
    follow = opdef(op.kind).follow
    if follow is not None:
        return [i for i in follow if i in tensors]

    def parallel_axes(i):
        s = fusion.tensor(op.inputs[i]).sharding
        return s.num_device_axes() if s else 0
    return sorted(tensors, key=lambda i: (-parallel_axes(i), -nbytes(fusion, op.inputs[i])))


def _reachable(have: Placement, need: Placement) -> bool:
    return have == need or step_collective(have, need) is not None


def op_mesh(op: Op, fusion: Fusion, hint: Sharding | None, default: DeviceMesh) -> DeviceMesh:
    """The mesh an op runs on: its output's assigned mesh, else the mesh of its first operand in
    preference order that has one, else ``default``. An op whose output goes to one device of the
    1-D mesh that holds every operand, some sharded, runs on that mesh instead where its outputs are
    smaller than those operands: then only the result moves to the device (a reduction's partial
    sums with one ``reduce``, its shards with one ``gather``), not the operands."""
    held = [fusion.tensor(op.inputs[i]).sharding for i in preference(op, fusion)]
    if hint is None:
        return next((s.mesh for s in held if s is not None), default)
    if _result_moves_less(op, fusion, hint, held):
        return held[0].mesh
    return hint.mesh


def _result_moves_less(op: Op, fusion: Fusion, hint: Sharding, held: list[Sharding | None]) -> bool:
    """See ``op_mesh``: the operands (sharded as ``held``) share a 1-D mesh, ``hint`` is one of its devices,
    and the op's outputs have fewer bytes than its operands that are not replicated."""
    if not held or any(s is None or s.mesh != held[0].mesh for s in held):
        return False
    mesh = held[0].mesh
    if hint.mesh.size != 1 or mesh.ndim != 1 or hint.mesh.devices[0] not in mesh or mesh == hint.mesh \
            or all(s.is_replicated for s in held):
        return False

    operands = sum(nbytes(fusion, a) for a in op.tensor_inputs if not fusion.tensor(a).sharding.is_replicated)
    outputs = sum(nbytes(fusion, o) for o in op.outputs)
    return outputs < operands < math.inf


def nbytes(fusion: Fusion, name: int) -> float:
    """The bytes of tensor ``name``; infinite where an extent is symbolic (then no size comparison holds)."""
    t = fusion.tensor(name)
    return math.inf if any(e < 0 for e in t.shape) else math.prod(t.shape) * t.dtype.torch.itemsize


def choose(op: Op, fusion: Fusion, hint: Sharding | None, default_mesh: DeviceMesh,
           copies: Mapping[int, Sharding] | None = None, reads_copies: bool = False) -> Strategy:
    """Pick, mesh axis by mesh axis (mesh_x first), a candidate of the op's rule:
    1. one that produces ``hint`` (the output's assigned sharding) with only free input transitions;
    2. else one that keeps the sharding of the first operand, in preference order, that is sharded;
       with no ``hint``, where the ops that read the result cannot take it so (``_taken``), the one of
       those that keep some operand's sharding that moves the fewest bytes, the result's included
       (scores ``q @ k^T`` kept on q's rows for a softmax over keys: k is gathered, not q and the scores);
       where the ops that read it can, one that sums a pending operand instead of keeping it pending, if that
       moves no more bytes (``_sums_operand``: an RMSNorm backward's ``gy * xhat`` reduce-scatters gy, which
       ``gy * g`` then reads, rather than gathering xhat and reduce-scattering ``gy * g`` as well);
    3. else one that produces ``hint`` (e.g. a max the user parallelized over the dim it reduces, of a
       pending sum: a reduce_scatter of its operand to that dim, not an allreduce of it and then of the
       max's result); also instead of 2's where it moves fewer bytes (``_moved``), or as many by summing
       a pending operand (``_sums_operand``), and ``hint`` is not replicated on the axis, so the op's
       work stays split (``g^T @ x`` with g sharded on its columns, x on its rows and the output on its
       rows gathers x, not an all_to_all of g and a reduce_scatter of the result), or 2's pick saves no work
       over running the op whole (``_saves_work``: a per-token scale ``y * s[:, None]`` wanted whole gathers
       s, not the product; a layer norm backward of a pending sum with three results wanted whole sums its
       operand once, not each result);
    4. else replicate everything.
    Candidates that would shard one dim on two mesh axes with overlapping pieces are skipped.

    ``copies`` maps a tensor to the sharding another op needs it moved to (the move runs anyway; the resharding
    pass makes it once; propagation walks the ops twice, so later ops' moves count). A pending sum with such a
    copy counts as held that way, so it is summed once; so does a tensor a view (``permute``, ``reshape``, ...)
    reads, where the copy gathers some of its mesh axes (``reshard.gathered``: ``g @ w`` and ``permute(g) @ r``
    gather ``g`` once, on a 2-D mesh too, where ``g`` stays split on the other axis). A pending sum that
    is two operands of the op gets one placement for both (``y * y``: both summed, not one kept pending, which
    would sum the product again), also where one operand is a pointwise op of it (``y * neg(y)``).
    ``reads_copies``: any op, not only a view, reads the copies that gather some mesh axes of its operands,
    and keeps a pending operand pending (not held as its copy: ``sum(g * y)`` of a gathered g and a pending y).
    """
    rule = opdef(op.kind).rule
    if rule is None:
        raise LoweringError(f"{op.kind}: no sharding rule for this op")
    mesh = op_mesh(op, fusion, hint, default_mesh)
    hint = hint if hint is not None and hint.mesh == mesh else None
    have, copied = [], []  # per operand: its placements here (None: not a tensor); those of its copy here
    for a in op.inputs:
        s = fusion.tensor(a).sharding if isinstance(a, int) else None
        copy = copies.get(a) if copies and s is not None else None
        copy = copy if copy is not None and copy.mesh == mesh and not (reads_copies and s.has_partial) else None
        copied.append(None if copy is None else copy.placements)
        if copy is not None and (s.has_partial or (reads_copies or traits(op.kind) & Trait.VIEW) and gathered(s, copy)):
            s = copy
        have.append(None if not isinstance(a, int) else
                    s.placements if s is not None and s.mesh == mesh else (REPLICATE,) * mesh.ndim)
    need_in = [None if h is None else [None] * mesh.ndim for h in have]
    need_out = [[None] * mesh.ndim for _ in op.outputs]
    order = preference(op, fusion)
    sums = tuple(_pending_source(fusion, a) for a in op.inputs)
    for axis in reversed(range(mesh.ndim)):
        n = mesh.shape[axis]
        cands = rule(op, fusion, n)
        cands = cands + _strided(cands, [h[axis] for h in have if h is not None], op, fusion, n)
        cands = [c for c in cands if _compatible(c, need_in, need_out, mesh, axis)
                 and all(h is None or _reachable(h[axis], p) for h, p in zip(have, c.inputs))
                 and (hint is None or _reachable(c.outputs[0], hint.placements[axis]))]
        cands = [c for c in cands if _sums_once(c, sums, have, axis)] or cands
        cands = [c for c in cands if not c.asked or hint is not None and c.outputs[0] == hint.placements[axis]]
        pick = None
        if hint is not None:
            pick = next((c for c in cands if c.outputs[0] == hint.placements[axis]
                         and all(h is None or is_free(h[axis], p) for h, p in zip(have, c.inputs))), None)
        follows = []  # per sharded operand, in preference order: the candidate that keeps its placement
        for i in order if pick is None else ():
            p = have[i][axis]
            matching = [c for c in cands if c.inputs[i] == p and not isinstance(p, Replicate)]
            if matching:
                follows.append(min(matching, key=lambda c: sum(h is not None and not is_free(h[axis], q)
                                                               for h, q in zip(have, c.inputs))))
        if follows:
            pick = follows[0] if hint is not None else _follow(follows, cands, op, fusion, mesh, have, copied, axis, n)
        if hint is not None:  # produce the hint, from operands that reach its inputs, where that moves less
            target = hint.placements[axis]
            produce = next((c for c in cands if c.outputs[0] == target), None)
            args = (op, fusion, mesh, have, copied, target, axis, n)
            if pick is None:
                pick = produce
            elif produce is not None and (not isinstance(target, Replicate) or not _saves_work(op, pick)):
                moved, kept = _moved(produce, *args), _moved(pick, *args)
                if moved < kept or moved == kept < math.inf and _sums_operand(produce, have, axis):
                    pick = produce
        pick = pick or cands[0]
        for i, p in enumerate(pick.inputs):
            if need_in[i] is not None:
                need_in[i][axis] = p
        for j, p in enumerate(pick.outputs):
            need_out[j][axis] = p
    return Strategy(mesh, tuple(None if p is None else Sharding(mesh, tuple(p)) for p in need_in),
                    tuple(Sharding(mesh, tuple(placements)) for placements in need_out))


def _follow(follows: list[Candidate], cands: list[Candidate], op: Op, fusion: Fusion, mesh: DeviceMesh, have: list,
            copied: list, axis: int, n: int) -> Candidate:
    """Of the candidates that keep an operand's placement (``follows``, in preference order), the one an op
    without an assigned sharding runs: the first, unless the ops that read the result cannot take it so
    (then the one that moves the fewest bytes, of those and of the ``cands`` that sum a pending operand
    and move no other), or one that sums a pending operand moves no more bytes."""
    def moved(c):
        return _moved(c, op, fusion, mesh, have, copied, None, axis, n)
    summing = [c for c in cands if _sums_operand(c, have, axis) and all(
        h is None or isinstance(h[axis], Partial) or is_free(h[axis], p) for h, p in zip(have, c.inputs))]
    pick = follows[0]
    if not _taken(pick.outputs[0], op, fusion, n):
        return min(follows + summing, key=moved)
    if _sums_operand(pick, have, axis):
        return pick
    return next((c for c in follows + summing if _sums_operand(c, have, axis) and moved(c) <= moved(pick)), pick)


def _moved(c: Candidate, op: Op, fusion: Fusion, mesh: DeviceMesh, have: list, copied: list,
           hint: Placement | None, axis: int, n: int) -> float:
    """The bytes candidate ``c`` moves on mesh axis ``axis``: every operand that must communicate to reach
    its placement (``reshard.is_local``: a replicated operand joins a pending sum for free; unless the copy
    another op needs, ``copied``, has it so), and each output where it
    must communicate to reach its assigned placement (``hint`` for the first; assigned on another mesh than
    the op's, ``mesh``: always; no assigned one: where a consumer cannot take it as it is, ``_taken`` on an
    axis of ``n`` devices). Infinite where an extent is symbolic (no comparison then)."""
    moved = sum(_move_nbytes(fusion, a) for a, h, copy, p in zip(op.inputs, have, copied, c.inputs)
                if h is not None and not is_local(h[axis], p) and not (copy is not None and copy[axis] == p))
    for j, (o, p) in enumerate(zip(op.outputs, c.outputs)):
        t = fusion.tensor(o)
        if j > 0 and t.annotated and t.sharding.mesh != mesh:
            stays = False
        else:
            target = hint if j == 0 else t.sharding.placements[axis] if t.annotated else None
            stays = is_free(p, target) if target is not None else _taken(p, op, fusion, n, j)
        moved += 0 if stays else nbytes(fusion, o)
    return moved


def is_cheap(op: Op) -> bool:
    """Whether ``op`` costs about its bytes to run (a pointwise op or a view), so running it whole on every
    rank costs less than moving a larger result: only bytes decide where it runs."""
    return bool(traits(op.kind) & (Trait.POINTWISE | Trait.VIEW)) and len(op.outputs) == 1


def _saves_work(op: Op, c: Candidate) -> bool:
    """Whether running ``op`` as candidate ``c`` saves work over running it whole on every device: ``c``
    shards an operand or a result (one that keeps a pending sum runs the whole op on every device), and
    the op costs more than its bytes (not ``is_cheap``)."""
    return not is_cheap(op) and any(isinstance(p, Shard) for p in (*c.inputs, *c.outputs))


def _move_nbytes(fusion: Fusion, name: int) -> float:
    """The bytes that moving tensor ``name`` costs: its own, or where fewer those of the one operand that
    is not held whole of the cheap op that made it (``is_cheap``: a view or a pointwise op), moved instead
    and the op run again on it (``propagate_shardings``: a broadcast that is then gathered is made whole
    from its gathered source; a one-hot ``iota == broadcast(ids)`` wanted on vocabulary shards is made
    there from the gathered ids)."""
    op = fusion.producer(name)
    own = nbytes(fusion, name)
    if op is None or not is_cheap(op):
        return own
    moving = {a for a in op.tensor_inputs
              if fusion.tensor(a).sharding is None or not fusion.tensor(a).sharding.is_replicated}
    if not moving:
        return 0
    return min(own, _move_nbytes(fusion, moving.pop())) if len(moving) == 1 else own


def _taken(p: Placement, op: Op, fusion: Fusion, n: int, j: int = 0) -> bool:
    """Whether every op that reads ``op``'s output ``j`` has a candidate (on a mesh axis of ``n`` devices)
    that takes it as ``p``, so the output need not move before its next use: the one step of look-ahead
    that keeps an attention's scores ``q @ k^T`` on the query rows, which the softmax over keys takes,
    and gathers k, rather than sharding the scores on keys and gathering them for the softmax."""
    out = op.outputs[j]
    if isinstance(p, Partial) and out in fusion.outputs:  # a fusion's output is summed
        return False
    for consumer in fusion.consumers(out):
        rule = opdef(consumer.kind).rule
        if rule is None:
            continue
        cands = [c for c in rule(consumer, fusion, n) if not c.asked]
        cands = cands + _strided(cands, [p], consumer, fusion, n)
        at = [k for k, a in enumerate(consumer.inputs) if a == out]
        if not any(all(c.inputs[k] == p for k in at) for c in cands):
            return False
    return True


def _sums_operand(c: Candidate, have: list, axis: int) -> bool:
    """Whether candidate ``c`` sums an operand that is a pending sum on mesh axis ``axis``. Where producing
    an op's assigned sharding so moves as many bytes as keeping the sum pending and summing the result,
    the operand is summed: other ops that read it share that sum (an RMSNorm backward's ``gy * g`` and
    ``gy * xhat``: one reduce_scatter of ``gy``, and a GEMM's result summed beside it fuses with it)."""
    return any(h is not None and isinstance(h[axis], Partial) and not isinstance(p, Partial)
               for h, p in zip(have, c.inputs))


def _sums_once(c: Candidate, sums: tuple, have: list, axis: int) -> bool:
    """Whether candidate ``c`` gives operands that are pending sums on mesh axis ``axis`` of one source
    (``sums``: ``_pending_source`` of each operand) one placement."""
    placed = {}
    for a, h, p in zip(sums, have, c.inputs):
        if h is not None and isinstance(h[axis], Partial) and placed.setdefault(a, p) != p:
            return False
    return True


def _pending_source(fusion: Fusion, a):
    """The pending sum that operand ``a`` carries: that of the one operand of the pointwise op that made ``a``
    where both are pending sums (``neg(y)`` carries ``y``'s), else ``a``. Summing ``y`` and reading ``neg`` of
    the sum (``_copy_read``) sums both operands of ``y * neg(y)`` at once."""
    while isinstance(a, int) and fusion.tensor(a).sharding is not None and fusion.tensor(a).sharding.has_partial:
        op = fusion.producer(a)
        if op is None or not traits(op.kind) & Trait.POINTWISE or len(op.tensor_inputs) != 1 \
                or not fusion.tensor(op.tensor_inputs[0]).sharding.has_partial:
            break
        a = op.tensor_inputs[0]
    return a


def _strided(cands: list[Candidate], have: list[Placement], op: Op, fusion: Fusion, n: int) -> list[Candidate]:
    """Each candidate that shards dims as blocks again at the place (``Shard(d, outer)``: the dim viewed as
    [outer, n, rest]) an operand's strided shard has, where every dim it shards divides into ``outer * n``
    pieces. An op maps each index of a dim it keeps sharded to the same index of its output (or sums over
    it), so any piece works as the block does. (A reshape moves indices between dims: its rule places its
    pieces itself, and its candidates of a block to a block lead their groups, where the same holds.)"""
    outers = sorted({p.outer for p in have if isinstance(p, Shard) and p.outer != 1})
    shapes = [fusion.tensor(a).shape if isinstance(a, int) else None for a in op.inputs]
    shapes += [fusion.tensor(o).shape for o in op.outputs]

    def at(p: Placement | None, outer: int) -> Placement | None:
        return Shard(p.dim, outer) if isinstance(p, Shard) else p

    def divides(c: Candidate, outer: int) -> bool:  # an extent or an outer still symbolic is checked when bound
        return all(not isinstance(p, Shard) or outer < 0 or shape[p.dim] < 0 or shape[p.dim] % (outer * n) == 0
                   for p, shape in zip((*c.inputs, *c.outputs), shapes))
    return [Candidate(tuple(at(p, k) for p in c.inputs), tuple(at(p, k) for p in c.outputs))
            for k in outers for c in cands if _blocks(c) and divides(c, k)]


def _blocks(c: Candidate) -> bool:
    """Whether candidate ``c`` shards some operand, and every dim it shards as one block per device."""
    shards = [p for p in (*c.inputs, *c.outputs) if isinstance(p, Shard)]
    return any(isinstance(p, Shard) for p in c.inputs) and all(p.outer == 1 for p in shards)


def _compatible(c: Candidate, need_in, need_out, mesh: DeviceMesh, axis: int) -> bool:
    """Whether candidate ``c`` on mesh axis ``axis`` leaves every operand and output a sharding that can
    exist with what the other mesh axes chose already: a dim sharded on two mesh axes needs pieces
    that nest (``Sharding.nests``; S(0) on one axis of 2 and S(0, outer=3) on another would overlap)."""
    for p, chosen in zip((*c.inputs, *c.outputs), (*need_in, *need_out)):
        if isinstance(p, Shard) and chosen is not None:
            trial = [REPLICATE if q is None else q for q in chosen]
            trial[axis] = p
            if not Sharding(mesh, tuple(trial)).nests(p.dim):
                return False
    return True
