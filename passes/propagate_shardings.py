"""Give every tensor of a fusion with meshes a sharding, and every op the strategy it runs with."""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from dataclasses import dataclass

from tp_fusion.passes.decompose import decomposed, decomposes
from tp_fusion.sharding.reshard import free_between, gathered, local_between
from tp_fusion.sharding.sharding import REPLICATE, Partial, Replicate, Shard, Sharding
from tp_fusion.sharding.strategy import Strategy, choose, is_cheap, nbytes

from tp_fusion.ir import Fusion
from tp_fusion.mesh import DeviceMesh
from tp_fusion.ops import Trait, is_biased_gemm, opdef, traits


def default_mesh(fusion: Fusion) -> DeviceMesh | None:
    """The mesh of the first tensor that has one (the fusion's mesh for unannotated inputs)."""
    return next((t.sharding.mesh for t in fusion.tensors if t.sharding is not None), None)


class _Draft:
    """The tensors of a fusion, updated in place while a pass walks its ops (what ``choose`` reads)."""

    def __init__(self, fusion: Fusion):
        self.fusion = fusion
        self.tensors = list(fusion.tensors)
        self.copies: dict[int, Sharding] = {}  # tensors an op needs moved (summed, gathered): the first need

    def tensor(self, name: int):
        return self.tensors[name]

    def consumers(self, name: int):
        return self.fusion.consumers(name)

    def producer(self, name: int):
        return self.fusion.producer(name)

    @property
    def outputs(self):
        return self.fusion.outputs

    def set_sharding(self, name: int, sharding: Sharding) -> None:
        self.tensors[name] = self.tensors[name].replace(sharding=sharding)


def propagate_shardings(fusion: Fusion) -> Fusion:
    """Requires: annotated tensors carry their sharding. Ensures: every tensor has a sharding and
    every op a ``strategy``; annotated tensors are unchanged; unannotated inputs are replicated on the
    fusion's mesh; no fusion output and no biased GEMM output is Partial (they are materialized).

    Forward: each op's unannotated outputs get what ``choose`` says the op produces. Backward:
    an unannotated replicated tensor that an op computes from whole operands (replicated, or
    gathered or summed for it; or from nothing, like ``full``) takes the sharding all its consumers
    need, so it is computed sharded instead of computed whole and sliced: its operands are then
    sliced, or summed by a reduce_scatter rather than an allreduce (RMSNorm of a row-parallel
    linear's output with the result on rows). A pointwise op or a view whose result every consumer
    needs in another sharding, where its operands move fewer bytes than that result, runs so on moved
    operands (a per-token scale: ``y * broadcast(s)`` wanted whole gathers s, not the product; a one-hot
    ``iota == broadcast(tgt)`` of token-sharded targets wanted on vocabulary shards gathers tgt).
    An op that costs more than its bytes and could run whole on copies of its operands that other ops
    gather runs so where the plan then moves fewer bytes in all (``_could_run_on_copies``); so do cheap ops
    that could share one gather of an operand instead of each moving its result (``_could_gather_once``),
    and such an op's result is made in the annotation that pointwise ops of its shape lead to
    (``_could_take_hint``); a chain of adds sums its pending terms first (``_could_sum_pending_first``); a
    softmax, variance or layer norm over a sharded dim runs as its parts (``_could_decompose``).
    Choices are found again on the plan a round kept some in, as one can open another (cheap ops that
    share a gather of ``g`` then read that copy beside a pending sum: ``sum(g * y)`` keeps ``y`` pending).
    """
    mesh = default_mesh(fusion)
    if mesh is None:
        return fusion
    chosen = _Choices()
    draft, ops = _plan(fusion, mesh, chosen)
    moved, tried = _moved_bytes(draft, ops), {chosen}
    for _ in range(_MAX_ROUNDS):  # again while a round keeps a choice: one may open another (a gather seeded)
        kept = chosen
        for find in (_could_run_on_copies, _could_gather_once, _could_take_hint, _could_run_as_asked,
                     _could_sum_pending_first, _could_decompose, _could_run_on_another_mesh):
            found = find(draft.fusion, draft, ops)
            # All at once (a stack of alike layers), else one by one where they are few: each try plans the
            # whole fusion again, so that compile time stays linear in its size.
            alone = found if 1 < len(found) <= _MAX_TRIES else []
            for trying in [chosen | functools.reduce(operator.or_, found, _Choices())] + [chosen | c for c in alone]:
                if trying in tried:
                    continue
                tried.add(trying)
                trial = _plan(fusion, mesh, trying)
                trial_moved = _moved_bytes(*trial)
                if trial_moved < moved:
                    chosen, (draft, ops), moved = trying, trial, trial_moved
        if chosen == kept:
            break
    return fusion.replace(tensors=tuple(draft.tensors), ops=tuple(ops))


_MAX_TRIES = 4  # the most choices of one kind ``propagate_shardings`` tries one by one
_MAX_ROUNDS = 3  # the most rounds of finding choices


@dataclass(frozen=True)
class _Choices:
    """What a plan is made with beyond the rules: each kind is tried where it could move fewer bytes, and
    kept where the whole plan then does (``propagate_shardings``)."""

    on_copies: frozenset[int] = frozenset()  # results of ops that run whole on the gathered copies of their
    #                                          operands (``_could_run_on_copies``)
    seeds: frozenset[tuple[int, Sharding]] = frozenset()  # (tensor, sharding): gathered so once for the cheap
    #                                                       ops that read it (``_could_gather_once``)
    hinted: frozenset[int] = frozenset()  # tensors made in the one annotation that the pointwise ops reading
    #                                       them lead to (``_could_take_hint``)
    made_as: frozenset[tuple[int, Sharding]] = frozenset()  # (tensor, sharding): made so, by a way to run its op
    #                                                         that is taken where asked for (``_could_run_as_asked``)
    regrouped: frozenset[tuple[int, tuple[int, ...]]] = frozenset()  # (a chain of adds' result, its terms in the
    #                                                                  order summed: ``_could_sum_pending_first``)
    decomposed: frozenset[int] = frozenset()  # results of ops run as their ``decompose`` recipe (``_could_decompose``)

    def __or__(self, other: _Choices) -> _Choices:
        return _Choices(*(getattr(self, f.name) | getattr(other, f.name) for f in dataclasses.fields(self)))


def _plan(fusion: Fusion, mesh: DeviceMesh, choices: _Choices) -> tuple[_Draft, list]:
    """The shardings and strategies, with ``choices`` made (the draft's fusion has the adds regrouped and the
    ops decomposed)."""
    fusion = decomposed(_regrouped(fusion, dict(choices.regrouped)), choices.decomposed, mesh)
    draft, ops = _walks(fusion, mesh, {}, choices)
    summed = _summed_at_source(fusion, draft, ops)
    if summed:  # again, with those pending sums summed where they are made
        draft, ops = _walks(fusion, mesh, summed, choices)
    _backward(fusion, draft, ops, mesh, dict(choices.seeds))
    return draft, ops


def _could_run_on_copies(fusion: Fusion, draft: _Draft, ops: list) -> list[_Choices]:
    """The results of ops that could run, with no communication, on copies of their operands that other
    ops gather anyway, but run on their shards (a GEMM or another op that costs more than its bytes; cheap
    ops read such copies where their consumers want it, ``_copy_read``). Run whole instead, their results
    may need no move later: under SP, with k's weight replicated (fewer kv heads than ranks), ``linear(x,
    wk)`` on the x gathered for q gives k for every token, and the attention runs on heads, where k on
    token shards gathered q and the [heads, T, T] scores. So may ops, cheap ones too, whose other operands
    are pending sums that they keep pending: a MoE gate's gradient ``sum(go * y_e)`` under SP, with ``go``
    gathered for the experts' GEMMs and ``y_e`` a row-parallel product, reduce-scatters the [T] result, not
    ``y_e``. ``propagate_shardings`` keeps what moves fewer bytes, as the work whole costs more."""
    found = []
    for op in ops:
        if len(op.outputs) != 1 or op.strategy.outputs[0].is_replicated:
            continue
        operands = [(a, need) for a, need in _operand_needs(op, op.strategy, draft) if need is not None]
        reads = [_copy_gathered(draft, a) not in (None, need) for a, need in operands]
        pending = [draft.tensor(a).sharding.has_partial for a, _ in operands]
        if (is_cheap(op) or op.strategy.outputs[0].has_partial) and not any(pending):
            continue
        if any(reads) and all(read or draft.tensor(a).sharding.is_replicated or summed
                              for (a, _), read, summed in zip(operands, reads, pending)):
            found.append(_Choices(on_copies=frozenset({op.outputs[0]})))
    return found


def _copy_gathered(draft: _Draft, a: int) -> Sharding | None:
    """The copy that another op makes of ``a`` with some of its mesh axes gathered (whole on a 1-D mesh; on
    a DP x SP mesh, gathered over SP and still split over DP), if any."""
    copy, have = draft.copies.get(a), draft.tensor(a).sharding
    return copy if copy is not None and copy != have and gathered(have, copy) else None


def _could_gather_once(fusion: Fusion, draft: _Draft, ops: list) -> list[_Choices]:
    """(tensor, the sharding that gathers it) for each tensor that several cheap ops read whose results are
    each gathered on those mesh axes (another op that gathers the tensor so counts as one of them): one
    gather of the tensor could serve them all, each op then run whole on it (``_run_as_needed`` reads the
    copy). Each op alone moves its result, as its operands together are larger (per-token scales
    ``g * s_e`` of one token-sharded g, each product read by a column-parallel linear, gather g once and
    each small ``s_e``, not every product)."""
    index = {id(op): i for i, op in enumerate(fusion.ops)}
    readers = {(a, copy): 1 for a, copy in draft.copies.items()  # the op that gathers it anyway
               if not draft.tensor(a).sharding.has_partial and copy != draft.tensor(a).sharding
               and gathered(draft.tensor(a).sharding, copy)}
    for op in ops:
        o, made = op.outputs[0], op.strategy.outputs[0]
        if not is_cheap(op) or draft.tensor(o).annotated:
            continue
        need = _single_need(fusion, ops, index, o)
        if need is None or need.mesh != made.mesh or need.has_partial or made.has_partial or free_between(made, need):
            continue
        for a in _cheap_sources(fusion, op, draft):
            have = draft.tensor(a).sharding
            if have.mesh != need.mesh or have.has_partial:
                continue
            whole = Sharding(have.mesh, tuple(q if isinstance(q, Replicate) else p
                                              for p, q in zip(have.placements, need.placements)))
            if whole != have:
                readers[a, whole] = readers.get((a, whole), 0) + 1
    return [_Choices(seeds=frozenset({key})) for key, n in readers.items() if n > 1]


def _cheap_sources(fusion: Fusion, op, draft: _Draft, depth: int = 4) -> set[int]:
    """The tensors ``op`` computes from through ``_private_step``s, in turn (``1 - h * h`` of a token shard
    ``h``: h, not the product): where its result is gathered, it could run whole on their gathered copies (the
    backward walk runs the steps whole, ``_computable_from``). ``depth`` bounds the walk."""
    found = set()
    for a in op.tensor_inputs:
        if depth and _private_step(fusion, draft, a):
            found |= _cheap_sources(fusion, fusion.producer(a), draft, depth - 1)
        else:
            found.add(a)
    return found


def _private_step(fusion: Fusion, draft: _Draft, a: int) -> bool:
    """Whether ``a`` is made by a cheap pointwise op and read by one op only, neither annotated nor an output:
    a step that may run wherever its reader wants it."""
    producer = fusion.producer(a)
    return producer is not None and len(producer.outputs) == 1 and is_cheap(producer) \
        and bool(traits(producer.kind) & Trait.POINTWISE) and len(fusion.consumers(a)) == 1 \
        and not draft.tensor(a).annotated and a not in fusion.outputs


def _single_need(fusion: Fusion, ops: list, index: dict[int, int], o: int) -> Sharding | None:
    """The one sharding that every op reading ``o`` needs it in (``index``: an op's place in ``ops`` by the
    id of the fusion's op), else None."""
    needs = set()
    for consumer in fusion.consumers(o):
        st: Strategy = ops[index[id(consumer)]].strategy
        needs |= {st.inputs[k] for k, a in enumerate(consumer.inputs) if a == o}
    return needs.pop() if len(needs) == 1 else None


def _operand_needs(op, st: Strategy, draft: _Draft):
    """(operand, the sharding ``op`` run as ``st`` needs it in) for each operand (None: not a tensor); a
    user's ``set`` needs its operand as its result."""
    return zip(op.inputs, (draft.tensor(op.outputs[0]).sharding,) if traits(op.kind) & Trait.RESHARD else st.inputs)


def _moved_bytes(draft: _Draft, ops: list) -> float:
    """The bytes of every move the plan makes: of operands to what their ops need, each tensor to each
    sharding once, and of results made otherwise than assigned (a move that slices is free); each priced by
    ``_move_price``."""
    moves = {}
    for op in ops:
        for a, need in _operand_moves(op, draft):
            moves[a, need] = _move_price(nbytes(draft, a), draft.tensor(a).sharding, need)
        for o, made in zip(op.outputs, op.strategy.outputs):
            if not local_between(made, draft.tensor(o).sharding):
                moves[o, made] = _move_price(nbytes(draft, o), made, draft.tensor(o).sharding)
    return sum(moves.values())


def _operand_moves(op, draft: _Draft):
    """(operand, the sharding ``op`` needs it in) for each operand that must communicate to get there."""
    return ((a, need) for a, need in _operand_needs(op, op.strategy, draft)
            if need is not None and not local_between(draft.tensor(a).sharding, need))


def _move_price(nbytes: float, have: Sharding, need: Sharding) -> float:
    """What moving a tensor of ``nbytes`` from ``have`` to ``need`` costs a group of devices: the bytes of the
    piece the group moves (on a 2-D mesh, a tensor that stays split on one axis moves its pieces on the other),
    twice where a pending sum is made whole (an allreduce sends what a reduce_scatter and an allgather would:
    a softmax run as its parts, an allreduce of each row's max and sum, is weighed fairly against a gather)."""
    if have.mesh != need.mesh:
        return nbytes
    pieces = math.prod(n for n, a, b in zip(have.mesh.shape, have.placements, need.placements)
                       if isinstance(b, Shard) and (a == b or isinstance(a, Replicate)))
    summed = any(isinstance(a, Partial) and isinstance(b, Replicate) for a, b in zip(have.placements, need.placements))
    return nbytes / pieces * (2 if summed else 1)


def _walks(fusion: Fusion, mesh: DeviceMesh, summed: dict[int, Sharding], choices: _Choices) -> tuple[_Draft, list]:
    """The forward walk, and again where the first found moves, so that every op sees the moves the ops
    after it need too."""
    draft, ops = _forward(fusion, mesh, dict(choices.seeds), summed, choices)
    if draft.copies:
        draft, ops = _forward(fusion, mesh, draft.copies, summed, choices)
    return draft, ops


def _forward(fusion: Fusion, mesh: DeviceMesh, copies: dict[int, Sharding],
             summed: dict[int, Sharding], choices: _Choices) -> tuple[_Draft, list]:
    """Each op's strategy, in order, and its unannotated outputs' shardings; ``copies`` holds the moves
    that the ops of an earlier walk needed, or the ``choices`` seed (the draft's ``copies`` adds this
    walk's); ``summed`` the pending sums to sum where they are made (``_summed_at_source``), as if
    annotated so."""
    draft = _Draft(fusion)
    draft.copies.update(copies)
    for i in fusion.inputs:
        if draft.tensor(i).sharding is None:
            draft.set_sharding(i, Sharding.replicated(mesh))
    outputs, made_as = set(fusion.outputs), dict(choices.made_as)
    ops = []
    for op in fusion.ops:
        o = op.outputs[0]
        hint = _hint(draft, o, o in choices.hinted) or made_as.get(o) or summed.get(o)
        st = choose(op, draft, hint, mesh, draft.copies, reads_copies=o in choices.on_copies)
        for a, need in _operand_needs(op, st, draft):  # a move on the operand's own mesh that communicates
            if need is not None and not need.has_partial and draft.tensor(a).sharding.mesh == need.mesh \
                    and not free_between(draft.tensor(a).sharding, need):
                draft.copies.setdefault(a, need)
        for o, s in zip(op.outputs, st.outputs):
            if draft.tensor(o).annotated:
                continue
            if o in outputs or is_biased_gemm(op):
                s = s.materialized()
            draft.set_sharding(o, summed.get(o, s))
        ops.append(op.replace(strategy=st))
    return draft, ops


def _summed_at_source(fusion: Fusion, draft: _Draft, ops: list) -> dict[int, Sharding]:
    """The pending sums to sum where they are made, each with the sharding to sum it to: those whose sum
    flows through ops that keep it pending (``x * w``, a mean, a layer norm backward written from them) to
    places where it is summed (results the ops after need summed, fusion outputs), together more bytes
    than the source, where one sharding of the source serves them all, mesh axis by mesh axis of its
    pending sums: on each, all of them whole (a hand-written layer norm backward of a row-parallel
    linear's gradient then runs one allreduce of it, not one of grad_x and one of each of grad_w, grad_b;
    on a DP x TP mesh too, where grad_x stays on the DP axis's token shards), or all summed to one shard
    and made from the source by pointwise ops alone, so that its dims are theirs (a bf16 gradient cast to
    f32 for an RMSNorm backward on token shards is reduce-scattered in bf16, half the bytes), or all
    summed to one shard through other ops, where an allreduce of the source moves less than their
    reduce_scatter (the source is summed whole and those ops then run on the shard: a tied embedding and
    LM head's TP backward allreduces grad_h [T, H], not the [V, H] weight gradient)."""
    source: dict[int, int] = {}  # a pending tensor -> the source whose sum it carries
    aligned: set[int] = set()  # pending tensors made from their source by pointwise ops of its shape
    exits: dict[int, dict[int, Sharding]] = {}  # a source -> the tensors summed, each to what it is summed to
    for op in ops:
        st = op.strategy
        carried = set()
        for a, need in zip(op.inputs, st.inputs):
            if need is not None and draft.tensor(a).sharding.has_partial:
                if need.has_partial:
                    carried.add(source.get(a, a))
                else:  # summed for this op
                    exits.setdefault(source.get(a, a), {})[a] = need
        for o, made in zip(op.outputs, st.outputs):
            if made.has_partial:
                source[o] = next(iter(carried)) if len(carried) == 1 else o
                if source[o] != o and traits(op.kind) & Trait.POINTWISE \
                        and draft.tensor(o).shape == draft.tensor(source[o]).shape \
                        and all(a in aligned or a == source[o] for a in op.tensor_inputs
                                if draft.tensor(a).sharding.has_partial):
                    aligned.add(o)
                if not draft.tensor(o).sharding.has_partial:  # materialized where it is made (an output)
                    exits.setdefault(source[o], {})[o] = draft.tensor(o).sharding
    summed_to = {}
    for src, summed in exits.items():
        have, summed_bytes = draft.tensor(src).sharding, sum(nbytes(draft, t) for t in summed)
        if draft.tensor(src).annotated or src in fusion.inputs or not nbytes(draft, src) < summed_bytes:
            continue
        target = list(have.placements)
        for axis, p in enumerate(have.placements):
            if not isinstance(p, Partial):
                continue
            wanted = {s.placements[axis] if s.mesh == have.mesh else None for s in summed.values()}
            one = next(iter(wanted)) if len(wanted) == 1 else None
            if one == REPLICATE or isinstance(one, Shard) and all(t in aligned or t == src for t in summed):
                target[axis] = one
            elif isinstance(one, Shard) and 2 * nbytes(draft, src) < summed_bytes:
                target[axis] = REPLICATE  # an allreduce of the source; what reads it runs on its shards
            else:
                break
        else:
            sharding = Sharding(have.mesh, tuple(target))
            # Chosen axis by axis: a dim sharded on two mesh axes must take nesting pieces (the Shard an axis is
            # summed to beside another axis' Shard of the same dim, S(1, outer=4) on both, would overlap)
            if all(sharding.nests(p.dim) for p in target if isinstance(p, Shard)):
                summed_to[src] = sharding
    return summed_to


def _hint(draft: _Draft, name: int, through: bool = False, memo: dict | None = None) -> Sharding | None:
    """The sharding ``name`` should be made in: its annotation, else the one annotation of the dtype
    conversions (``_converts``) that are all that read it, where that is on the mesh of its producer's
    operands: an f32 master weight's gradient ``cast(permute(g) @ x, f32)`` annotated on its features
    is made so by the GEMM (gathering x once) as an annotated ``permute(g) @ x`` is, rather than kept on
    x's token shards and its product moved. ``through``: through any pointwise ops of its shape too
    (``_could_take_hint``; else a hint on a GEMM or a chain of pointwise ops takes the choice of what to
    move from the bytes). ``memo`` keeps each tensor's hint for calls with the same ``through`` on the same
    draft (pointwise ops that read a tensor twice, in a chain, would otherwise be visited exponentially often)."""
    memo = {} if memo is None else memo
    if name not in memo:
        memo[name] = _hint_uncached(draft, name, through, memo)
    return memo[name]


def _hint_uncached(draft: _Draft, name: int, through: bool, memo: dict) -> Sharding | None:
    """``_hint``, computed from the hints of what reads ``name``."""
    t = draft.tensor(name)
    if t.annotated:
        return t.sharding
    readers = draft.consumers(name)
    passes_on = _keeps_shape if through else _converts
    if not readers or name in draft.outputs or not all(passes_on(draft, op, name) for op in readers):
        return None
    hints = {_hint(draft, op.outputs[0], through, memo) for op in readers}
    hint = hints.pop() if len(hints) == 1 else None
    producer = draft.producer(name)
    operands = producer.tensor_inputs if producer is not None else ()  # those the walk has given a sharding
    if hint is None or any(draft.tensor(a).sharding is not None and draft.tensor(a).sharding.mesh != hint.mesh
                           for a in operands):
        return None
    return hint


def _could_take_hint(fusion: Fusion, draft: _Draft, ops: list) -> list[_Choices]:
    """The results of ops that cost more than their bytes (a GEMM) made otherwise than the one annotation
    that the pointwise ops of their shape reading them lead to: made so, the op may move less than its
    result would (an SP weight gradient scaled, negated or accumulated, ``acc + permute(g) @ x`` annotated
    on its features, gathers x rather than an all_to_all of g and a reduce_scatter of the product). Not a
    rule: a residual add after a row-parallel GEMM keeps its pending sum, reduce-scattered with the GEMM,
    where moving the activation and the weight instead would move more (at real sizes, ffn >= hidden)."""
    found, narrow, through = [], {}, {}  # the memos of the two kinds of hint
    for op in ops:
        o = op.outputs[0]
        if is_cheap(op) or len(op.outputs) != 1 or draft.tensor(o).annotated \
                or _hint(draft, o, memo=narrow) is not None:
            continue
        hint = _hint(draft, o, True, through)
        if hint is not None and hint != op.strategy.outputs[0]:
            found.append(_Choices(hinted=frozenset({o})))
    return found


def _could_run_as_asked(fusion: Fusion, draft: _Draft, ops: list) -> list[_Choices]:
    """Results of ops whose rule has a way to run taken only where asked for (``Candidate.asked``) that their
    operands fit as they are: a cat of block shards made strided with no communication (the gradient of a
    fused QKV weight, in the weight's strided layout already), where otherwise its operands are gathered.
    Made so, the ops after may move more (a result needed whole then moves whole), so the plan decides."""
    found = []
    for op in ops:
        o, st, rule = op.outputs[0], op.strategy, opdef(op.kind).rule
        if len(op.outputs) != 1 or draft.tensor(o).annotated or not getattr(rule, "asks", False):
            continue
        have = [draft.tensor(a).sharding if isinstance(a, int) else None for a in op.inputs]
        if any(h is not None and h.mesh != st.mesh for h in have):
            continue
        made = list(st.outputs[0].placements)
        for axis, n in enumerate(st.mesh.shape):
            for c in rule(op, draft, n):
                if c.asked and all(h is None or h.placements[axis] == p for h, p in zip(have, c.inputs)):
                    made[axis] = c.outputs[0]
        if tuple(made) != st.outputs[0].placements:
            found.append(_Choices(made_as=frozenset({(o, Sharding(st.mesh, tuple(made)))})))
    return found


def _could_sum_pending_first(fusion: Fusion, draft: _Draft, ops: list) -> list[_Choices]:
    """Chains of adds (``_sums``) with two or more pending sums among their terms, summed after a term that is
    not pending: regrouped to sum the pending terms first, one collective sums them all, where otherwise each is
    summed to meet the other term (under SP, a transformer backward's ``gy + gq @ wq + gk @ wk + gv @ wv`` with
    ``gy`` on token shards reduce-scatters each product; a parallel block's ``x + attn + mlp`` each branch).
    Regrouped, the sum is rounded in another order, as every pending sum is; the plan decides."""
    found = []
    for root, (terms, _) in _sums(fusion).items():
        pending = [a for a in terms if draft.tensor(a).sharding.has_partial]
        order = pending + [a for a in terms if a not in pending]
        if len(pending) > 1 and order != terms:
            found.append(_Choices(regrouped=frozenset({(root, tuple(order))})))
    return found


def _could_decompose(fusion: Fusion, draft: _Draft, ops: list) -> list[_Choices]:
    """Results of ops with a ``decompose`` recipe that applies (softmax, var, layer norms, sorted top-k, scans),
    of operands of concrete shapes, that move an operand, or whose operand's producer does: run as the recipe's
    ops, a dim the op normalizes over may stay sharded, its reductions leaving pending sums or maxima of a value
    per row (``passes.decompose``). Whether that moves less depends on the ops around it: a softmax of the logits
    of a vocabulary-parallel LM head gathers the tokens for the head and keeps the logits on vocabulary shards,
    where the op whole would gather the head's weight (a move of its operand's producer). An attention's softmax
    over keys that nothing moves for is left whole (each try plans the fusion again)."""
    made_by, mesh = {o: op for op in ops for o in op.outputs}, default_mesh(fusion)

    def moves(op) -> bool:
        return op is not None and any(_operand_moves(op, draft))
    return [_Choices(decomposed=frozenset({op.outputs[0]})) for op in ops
            if opdef(op.kind).decompose is not None and op.strategy.mesh.size > 1
            and all(e >= 0 for a in op.tensor_inputs for e in draft.tensor(a).shape)
            and (moves(op) or moves(made_by.get(op.inputs[0]))) and decomposes(op, fusion, mesh)]


def _could_run_on_another_mesh(fusion: Fusion, draft: _Draft, ops: list) -> list[_Choices]:
    """Results of ops whose operands lie on several disjoint meshes (pipeline stages), made replicated on another
    of those meshes than the one the op runs on (its first operand's): the op then moves its other operands there
    rather than its result afterwards. A pipeline stage's ``add(set(x), h)``, x from the stage before and h of
    this stage, runs on this stage, where its result is read, instead of sending h back and the sum forward
    again."""
    found = []
    for op in ops:
        o = op.outputs[0]
        if len(op.outputs) != 1 or draft.tensor(o).annotated:
            continue
        meshes = {draft.tensor(a).sharding.mesh for a in op.tensor_inputs
                  if not set(draft.tensor(a).sharding.mesh.devices) & set(op.strategy.mesh.devices)}
        found += [_Choices(made_as=frozenset({(o, Sharding.replicated(m))})) for m in sorted(meshes, key=str)]
    return found


def _sums(fusion: Fusion) -> dict[int, tuple[list[int], list[int]]]:
    """Each chain of two or more adds of tensors of one shape and dtype whose results but the last only the
    next add reads (unannotated, not outputs): the last result -> (the terms in the order the adds read them,
    the adds' results in op order)."""
    place = {o: i for i, op in enumerate(fusion.ops) for o in op.outputs}
    outputs = set(fusion.outputs)

    def plain(op) -> bool:
        out = fusion.tensor(op.outputs[0])
        return op.kind == "add" and len(op.tensor_inputs) == len(op.inputs) == 2 and all(
            fusion.tensor(a).shape == out.shape and fusion.tensor(a).dtype == out.dtype for a in op.inputs)

    def inner(name: int) -> bool:
        producer, readers = fusion.producer(name), fusion.consumers(name)
        return producer is not None and plain(producer) and not fusion.tensor(name).annotated \
            and name not in outputs and len(readers) == 1 and plain(readers[0]) and readers[0].inputs.count(name) == 1

    chains = {}
    for op in fusion.ops:
        root = op.outputs[0]
        if not plain(op) or inner(root):
            continue
        terms, results, stack = [], [], [root]
        while stack:
            a = stack.pop()
            if a == root or inner(a):
                results.append(a)
                stack.extend(reversed(fusion.producer(a).inputs))
            else:
                terms.append(a)
        if len(terms) > 2:
            chains[root] = (terms, sorted(results, key=place.__getitem__))
    return chains


def _regrouped(fusion: Fusion, orders: dict[int, tuple[int, ...]]) -> Fusion:
    """``fusion`` with each chain of adds ``orders`` names (by its last result) summing its terms in the order
    given, left to right; its adds keep their results' names and run where the last one ran."""
    if not orders:
        return fusion
    chains, ops, gone = _sums(fusion), [], set()
    for root in orders:
        gone |= set(chains[root][1])
    for op in fusion.ops:
        root = op.outputs[0]
        if root in orders:
            acc, results = orders[root][0], chains[root][1]
            for term, out in zip(orders[root][1:], results):
                ops.append(fusion.producer(out).replace(inputs=(acc, term)))
                acc = out
        elif root not in gone:
            ops.append(op)
    return fusion.replace(ops=tuple(ops))


def _keeps_shape(draft: _Draft, op, name: int) -> bool:
    """Whether ``op`` is a pointwise op (not a ``set``) with one result of ``name``'s shape."""
    return bool(traits(op.kind) & Trait.POINTWISE) and not traits(op.kind) & Trait.RESHARD \
        and len(op.outputs) == 1 and draft.tensor(op.outputs[0]).shape == draft.tensor(name).shape


def _converts(draft: _Draft, op, name: int) -> bool:
    """Whether ``op`` converts ``name`` to another dtype and nothing else: a pointwise op (not a ``set``)
    whose one input is ``name`` and whose one result has its shape and another dtype (a cast)."""
    if not traits(op.kind) & Trait.POINTWISE or traits(op.kind) & Trait.RESHARD \
            or op.inputs != (name,) or len(op.outputs) != 1:
        return False
    out, t = draft.tensor(op.outputs[0]), draft.tensor(name)
    return out.shape == t.shape and out.dtype != t.dtype


def _backward(fusion: Fusion, draft: _Draft, ops: list, mesh: DeviceMesh, seeds: dict[int, Sharding]) -> None:
    """See ``propagate_shardings``; updates ``draft`` and the producers' strategies in ``ops``; cheap ops
    read the copies ``seeds`` makes (``_could_gather_once``).
    Fusion outputs take part (an output may come back sharded, as in nvFuser). A tensor materialized
    from a pending sum (a row-parallel linear's output) takes a Shard that all its consumers need
    too: the sum is then a reduce_scatter, not an allreduce and a slice."""
    single_need = functools.partial(_single_need, fusion, ops, {id(op): i for i, op in enumerate(fusion.ops)})
    seeds = _computable_from(fusion, draft, ops, seeds)
    for i in reversed(range(len(ops))):
        op = ops[i]
        whole = all(need is None or need.is_replicated for need in op.strategy.inputs)
        summed = {o for o, s in zip(op.outputs, op.strategy.outputs) if s.has_partial}
        read = _copy_read(op, draft)
        changed = False
        for o, made in zip(op.outputs, op.strategy.outputs):
            t = draft.tensor(o)
            if o in fusion.inputs:
                continue
            need = t.sharding if t.annotated else single_need(o)
            if need is None or need.has_partial:
                continue
            computed_whole = not t.annotated and t.sharding.is_replicated and (whole or o in summed)
            if read is not None and need == read != made or computed_whole and not need.is_replicated:
                draft.set_sharding(o, need)
                changed = True
        if changed and (whole or read is not None):
            hint = draft.tensor(op.outputs[0]).sharding
            ops[i] = op.replace(strategy=choose(op, draft, hint, mesh, draft.copies if read is not None else None))
        elif is_cheap(op) and not draft.tensor(op.outputs[0]).annotated:
            ops[i] = _run_as_needed(op, single_need(op.outputs[0]), draft, mesh, seeds)


def _computable_from(fusion: Fusion, draft: _Draft, ops: list, seeds: dict[int, Sharding]) -> dict[int, Sharding]:
    """``seeds`` with the results of ``_private_step``s whose operands are all in it in one sharding, in that
    sharding: computed from those copies, as the backward walk re-chooses their ops after
    their readers (``1 - h * h`` of a gathered h: its reader takes it whole, then the product runs whole)."""
    out = dict(seeds)
    for op in ops:
        found = {out.get(a) for a in op.tensor_inputs}
        if len(found) == 1 and None not in found and _private_step(fusion, draft, op.outputs[0]):
            out[op.outputs[0]] = found.pop()
    return out


def _run_as_needed(op, need: Sharding | None, draft: _Draft, mesh: DeviceMesh, copies: dict[int, Sharding]):
    """``op`` (cheap, computed on shards) re-chosen to give ``need``, what its consumers need, where
    ``choose`` finds its operands move fewer bytes than its result would (a move to ``copies`` is made
    anyway: free); else ``op`` as it is. (A pending sum is left to the rules on sums: summed before the op
    or after it moves the same bytes.)"""
    made = op.strategy.outputs[0]
    if need is None or need == made or made.is_replicated or made.has_partial or need.has_partial \
            or need.mesh != made.mesh:
        return op
    st = choose(op, draft, need, mesh, copies)
    if st.outputs[0] != need:
        return op
    draft.set_sharding(op.outputs[0], need)
    return op.replace(strategy=st)


def _copy_read(op, draft: _Draft) -> Sharding | None:
    """The sharding of the copy that another op makes of this op's one tensor operand, where this op can
    read that copy and give its result so: a view or a pointwise op of a gathered copy (``reshard.gathered``;
    a view of ``g`` that is then gathered, where ``g @ w`` gathers ``g`` too, reads the one gathered copy;
    ``cat([x, neg(x)])`` gathers x once and negates the whole), or a pointwise op of a pending sum's summed
    copy (``lerp(y, -y, w)``: ``neg`` reads the sum that the lerp needs). Else None."""
    if len(op.tensor_inputs) != 1:
        return None
    (a,) = op.tensor_inputs
    copy, have = draft.copies.get(a), draft.tensor(a).sharding
    if copy is None:
        return None
    if is_cheap(op) and gathered(have, copy) \
            or traits(op.kind) & Trait.POINTWISE and have.has_partial and copy.mesh == have.mesh:
        return copy
    return None
