"""Per-op sharding rules: for one mesh axis, the placements an op can run with.

A rule returns candidates, each a (placement per input, placement per output) pair that the op
computes correctly on local shards. Most ops are described einsum-style (``LabelSpec``): every
tensor dim carries a label; a label shared by an output passes a Shard through, a summed label
(a contraction, a sum; a max, min or prod reduction) yields Partial, a ``whole`` label (a
normalized dim, a variance's) must stay unsharded. Which inputs may be Partial is listed per op
(only where the op is linear in them, or commutes with the pending reduction).
Each op's entry in the op registry (``tp_fusion.ops``) names its rule, built here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from tp_fusion.sharding.sharding import PARTIAL_SUM, REPLICATE, Partial, Placement, Shard

from tp_fusion.ir import Fusion, Op
from tp_fusion.types import DataType

Rule = Callable[[Op, Fusion, int], list["Candidate"]]


@dataclass(frozen=True, slots=True)
class Candidate:
    """One way an op runs on a mesh axis: the placement it needs of each operand and gives each output."""

    inputs: tuple[Placement | None, ...]  # None for a non-tensor operand
    outputs: tuple[Placement, ...]
    asked: bool = False  # taken only where the result is asked for so (its annotation, a hint): a way to run
    #                      whose worth only the whole plan's bytes tell (``propagate_shardings`` tries it, for
    #                      the rules marked ``asks``)


@dataclass(frozen=True)
class LabelSpec:
    """An einsum-style description of an op's dims (see the module docstring)."""

    inputs: tuple[tuple[int | None, ...] | None, ...]  # per operand, a label per dim (None: not shardable)
    outputs: tuple[tuple[int | None, ...], ...]
    summed: frozenset[int] = frozenset()  # contracted (reduced) labels whose local results combine by ``partial``
    whole: frozenset[int] = frozenset()  # labels that must stay unsharded
    partial_sets: tuple[frozenset[int], ...] = ()  # operand sets that may be ``partial`` together
    partial: Partial = PARTIAL_SUM  # how local results combine: a sum, or a max/min/prod reduction's own op


def _shapes(op: Op, fusion: Fusion):
    ins = [fusion.tensor(a).shape if isinstance(a, int) else None for a in op.inputs]
    outs = [fusion.tensor(o).shape for o in op.outputs]
    return ins, outs


def label_candidates(spec: LabelSpec, extents: dict[int, int], n: int) -> list[Candidate]:
    """Candidates from a LabelSpec on a mesh axis of ``n`` devices."""
    no_in = tuple(None if labels is None else REPLICATE for labels in spec.inputs)
    cands = [Candidate(no_in, (REPLICATE,) * len(spec.outputs))]
    labels = sorted({lab for seq in (*spec.inputs, *spec.outputs) if seq for lab in seq if lab is not None})
    for lab in labels:
        if lab in spec.whole or extents[lab] % n != 0:
            continue
        outs = []
        for seq in spec.outputs:
            if lab in seq:
                outs.append(Shard(seq.index(lab)))
            elif lab in spec.summed:
                outs.append(spec.partial)
            else:
                break
        if len(outs) != len(spec.outputs):
            continue
        ins = tuple(None if seq is None else Shard(seq.index(lab)) if lab in seq else REPLICATE
                    for seq in spec.inputs)
        cands.append(Candidate(ins, tuple(outs)))
    for group in spec.partial_sets:
        ins = tuple(None if seq is None else spec.partial if i in group else REPLICATE
                    for i, seq in enumerate(spec.inputs))
        cands.append(Candidate(ins, (spec.partial,) * len(spec.outputs)))
    return cands


def _extents(spec: LabelSpec, op: Op, fusion: Fusion) -> dict[int, int]:
    ins, outs = _shapes(op, fusion)
    ext: dict[int, int] = {}
    for seq, shape in zip((*spec.inputs, *spec.outputs), (*ins, *outs)):
        for lab, e in zip(seq or (), shape or ()):
            if lab is not None:
                ext[lab] = max(ext.get(lab, 0), e)
    return ext


def _tensor_positions(op: Op) -> frozenset[int]:
    return frozenset(i for i, a in enumerate(op.inputs) if isinstance(a, int))


def linear_in_all(op: Op, fusion: Fusion) -> tuple[frozenset[int], ...]:
    """add/sub: every tensor operand Partial together (not with a constant operand: it would be
    added once per device)."""
    tensors = _tensor_positions(op)
    return () if len(tensors) < len(op.inputs) else (tensors,)


def linear_in_each(op: Op, fusion: Fusion) -> tuple[frozenset[int], ...]:
    """mul: any one tensor operand Partial, the others Replicate."""
    return tuple(frozenset({i}) for i in sorted(_tensor_positions(op)))


def linear_in_first(op: Op, fusion: Fusion) -> tuple[frozenset[int], ...]:
    """div, neg, set, ...: the first operand Partial (when it is a tensor)."""
    return (frozenset({0}),) if 0 in _tensor_positions(op) else ()


def linear_in_choices(op: Op, fusion: Fusion) -> tuple[frozenset[int], ...]:
    """where(cond, a, b): a and b Partial together (each rank picks from its own parts; a replicated one joins
    by ``TO_PARTIAL``), or one of them Partial where the other is the constant 0 (a sum of zeros). Never cond."""
    tensors = _tensor_positions(op) - {0}
    beside_zero = any(i not in tensors and op.inputs[i].value == 0 for i in (1, 2))
    return (frozenset(tensors),) if len(tensors) == 2 or tensors and beside_zero else ()


def pointwise(partial: Callable[[Op, Fusion], tuple[frozenset[int], ...]] | None = None,
              pending: Partial = PARTIAL_SUM) -> Rule:
    """Pointwise ops: dims aligned from the right; an operand dim of extent 1 under a larger output
    dim is broadcast and carries no label. ``partial(op, fusion)`` says which operands may be ``pending``
    together: those the op is linear in for a sum, or that it combines as the reduction does (``maximum`` of
    pending maxima is the pending maximum: a loss scaler's overflow check over many gradients, one allreduce)."""
    def build(op: Op, fusion: Fusion) -> LabelSpec:
        ins, (out,) = _shapes(op, fusion)
        labels_in = []
        for shape in ins:
            if shape is None:
                labels_in.append(None)
                continue
            offset = len(out) - len(shape)
            labels_in.append(tuple(None if e == 1 and out[offset + d] != 1 else offset + d
                                   for d, e in enumerate(shape)))
        return LabelSpec(tuple(labels_in), (tuple(range(len(out))),),
                         partial_sets=partial(op, fusion) if partial else (), partial=pending)
    return from_spec(build)


def reduction(pending: str | None) -> Rule:
    """Reductions over ``dims``. Where the reduction's result over the whole dim is the ``pending``
    reduction of its results over pieces (sum and mean: ``sum``; max, min, prod: their own op), a sharded
    reduced dim gives ``Partial(pending)``, and an input ``Partial(pending)`` stays so (the two reductions
    commute). Otherwise (``pending`` None: var, var_mean; or a prod of complex values, which the collectives
    combine by sums only: ``runtime.dist._wire``) a reduced dim must stay unsharded."""
    def build(op: Op, fusion: Fusion) -> LabelSpec:
        (shape, *_), outs = _shapes(op, fusion)
        pend = pending if pending == "sum" or not fusion.tensor(op.inputs[0]).dtype.is_complex else None
        dims, keepdim = op.attr("dims"), op.attr("keepdim")
        kept = tuple(None if d in dims else d for d in range(len(shape)))
        out = kept if keepdim else tuple(d for d in kept if d is not None)
        return LabelSpec((tuple(range(len(shape))),), (out,) * len(outs),
                         summed=frozenset(dims) if pend else frozenset(),
                         whole=frozenset() if pend else frozenset(dims),
                         partial_sets=(frozenset({0}),) if pend else (),
                         partial=Partial(pend or "sum"))
    return from_spec(build)


def _linear_spec(op: Op, fusion: Fusion) -> LabelSpec:
    """x[..., k] @ w[n, k]^T (+ b[n]): batch labels 0.., n = -1, k = -2 (summed). A weight with leading
    dims w[*l, n, k] (b[*l, n]) gives out[*l, ..., n]: the leading labels -3, -4, ... pass through. With a
    bias the output cannot be Partial (the bias would be added once per device)."""
    (x, w, *bias), _ = _shapes(op, fusion)
    batch = tuple(range(len(x) - 1))
    N, K = -1, -2
    lead = tuple(-3 - i for i in range(len(w) - 2))
    return LabelSpec(((*batch, K), (*lead, N, K), *((*lead, N) for _ in bias)), ((*lead, *batch, N),),
                     summed=frozenset({K}),
                     partial_sets=() if bias else (frozenset({0}), frozenset({1})))


def _grouped_mm_spec(op: Op, fusion: Fusion) -> LabelSpec:
    """mat1[m, k] by mat2[g, k, n] with offsets[g] -> out[m, n]: n passes through, k is summed; so is g, the
    experts: on a shard of them each rank multiplies the rows of the groups it holds, zeros for the others
    (``ops._grouped_mm``), a part of a sum over the ranks (expert parallelism with the tokens on every rank, as
    Megatron's all-gather token dispatcher). m stays whole and the offsets replicated (global row positions)."""
    M, N, K, G = -1, -2, -3, -4
    return LabelSpec(((M, K), (G, K, N), (None,)), ((M, N),), summed=frozenset({K, G}), whole=frozenset({M}),
                     partial_sets=(frozenset({0}), frozenset({1})))


def _matmul_spec(op: Op, fusion: Fusion) -> LabelSpec:
    """torch.matmul: a[..., m, k] @ b[..., k, n] with broadcast batch dims; 1-D operands lose m or n."""
    (a, b), (out,) = _shapes(op, fusion)
    M, N, K = -1, -2, -3
    nb = len(out) - (len(a) > 1) - (len(b) > 1)

    def batch_labels(shape):
        lead = shape[:-2]
        off = nb - len(lead)
        return tuple(None if e == 1 and out[off + i] != 1 else off + i for i, e in enumerate(lead))
    la = (K,) if len(a) == 1 else (*batch_labels(a), M, K)
    lb = (K,) if len(b) == 1 else (*batch_labels(b), K, N)
    lo = tuple(range(nb)) + ((M,) if len(a) > 1 else ()) + ((N,) if len(b) > 1 else ())
    return LabelSpec((la, lb), (lo,), summed=frozenset({K}),
                     partial_sets=(frozenset({0}), frozenset({1})))


def _permute_spec(op: Op, fusion: Fusion) -> LabelSpec:
    (x,), _ = _shapes(op, fusion)
    return LabelSpec((tuple(range(len(x))),), (tuple(op.attr("dims")),), partial_sets=(frozenset({0}),))


def _squeeze_spec(op: Op, fusion: Fusion) -> LabelSpec:
    (x,), _ = _shapes(op, fusion)
    dims = op.attr("dims")
    return LabelSpec((tuple(range(len(x))),), (tuple(d for d in range(len(x)) if d not in dims),),
                     partial_sets=(frozenset({0}),))


def _unsqueeze_spec(op: Op, fusion: Fusion) -> LabelSpec:
    (x,), _ = _shapes(op, fusion)
    out = list(range(len(x)))
    out.insert(op.attr("dim"), None)
    return LabelSpec((tuple(range(len(x))),), (tuple(out),), partial_sets=(frozenset({0}),))


def _broadcast_in_dim_spec(op: Op, fusion: Fusion) -> LabelSpec:
    """Input dim i lands on output dim broadcast_dims[i]; new and expanded output dims are labels
    of the output alone (the op can produce any slice of them from a replicated input). A pending sum
    passes through only where no dim grows: one that did would be summed at the larger size (e.g. the
    row sums of a softmax over a sharded dim: an allreduce of [rows] then, not a reduce_scatter of the
    broadcast [rows, vocab])."""
    (x,), (out,) = _shapes(op, fusion)
    bdims = op.attr("broadcast_dims")
    lin = tuple(d if x[i] == out[d] else None for i, d in enumerate(bdims))
    kept = {d for i, d in enumerate(bdims) if x[i] == out[d]}
    grows = any(e != 1 for d, e in enumerate(out) if d not in kept)
    return LabelSpec((lin,), (tuple(range(len(out))),), partial_sets=() if grows else (frozenset({0}),))


def normalization(whole_dims: Callable[[Op, int], tuple[int, ...]]) -> Rule:
    """layer_norm, softmax, native_layer_norm: the normalized dims ``whole_dims(op, ndim)`` stay whole;
    parameters (weight, bias) span the trailing normalized dims. Every output is labeled as the input:
    native_layer_norm's statistics (mean, rstd: [rows..., 1...]) have extent 1 on the whole dims and
    follow a shard of the other dims."""
    def build(op: Op, fusion: Fusion) -> LabelSpec:
        ins, outs = _shapes(op, fusion)
        x = ins[0]
        whole = whole_dims(op, len(x))
        labels = tuple(range(len(x)))
        params = tuple(None if s is None else whole[len(whole) - len(s):] for s in ins[1:])
        return LabelSpec((labels, *params), (labels,) * len(outs), whole=frozenset(whole))
    return from_spec(build)


def normalization_backward(whole_dims: Callable[[Op, int], tuple[int, ...]], stats: int) -> Rule:
    """native_layer_norm_backward(grad_y, x, *stats, *params) -> (grad_x, *grad_params): grad_y, x, the
    ``stats`` statistics (labeled as x; extent 1 on the whole dims) and grad_x share the labels; the
    normalized dims ``whole_dims(op, ndim)`` stay whole; the parameters and their gradients span the
    trailing normalized dims. A parameter's gradient is a sum over the other dims (the rows), so where
    a row dim is sharded it is Partial, as a ``sum``'s. The gradients are linear in grad_y, which may be
    Partial (then all are)."""
    def build(op: Op, fusion: Fusion) -> LabelSpec:
        ins, outs = _shapes(op, fusion)
        x = ins[1]
        whole = whole_dims(op, len(x))
        labels = tuple(range(len(x)))
        params = tuple(None if s is None else whole[len(whole) - len(s):] for s in ins[2 + stats:])
        return LabelSpec((labels, labels, *(labels,) * stats, *params), (labels, *params[:len(outs) - 1]),
                         summed=frozenset(labels) - frozenset(whole), whole=frozenset(whole),
                         partial_sets=(frozenset({0}),))
    return from_spec(build)


def along(whole_dims: Callable[[Op, tuple[int, ...]], Iterable[int]],
          linear: Callable[[Op], bool] | None = None) -> Rule:
    """Ops whose outputs keep the input's dims (scans, pad, triu, topk, argsort): the dims
    ``whole_dims(op, shape)`` of the input stay whole, the others pass a Shard through; where ``linear(op)``
    holds, the input may be Partial."""
    def build(op: Op, fusion: Fusion) -> LabelSpec:
        (x, *_), outs = _shapes(op, fusion)
        labels = tuple(range(len(x)))
        return LabelSpec((labels,), (labels,) * len(outs), whole=frozenset(whole_dims(op, x)),
                         partial_sets=(frozenset({0}),) if linear is not None and linear(op) else ())
    return from_spec(build)


def _alike(a: tuple[int, ...], b: tuple[int, ...], d: int) -> bool:
    """Whether dim ``d`` of two shapes is known to have one extent (a symbolic one is not)."""
    return a[d] == b[d] >= 0


def _take_along_spec(op: Op, fusion: Fusion) -> LabelSpec:
    """take_along_axis / gather: out[..., j, ...] = x[..., index[..., j, ...], ...] along ``dim``. The index
    and the output share every label: a shard of the index along ``dim`` shards the output; x's ``dim``
    sharded makes a partial sum (``_looked_up``). Another dim passes a Shard through x, the index and the output
    where the index spans it alike with x; where it covers a prefix of it, the dim stays whole in all three
    (a block of the index would need rows of x at other places). x may be Partial: the op is linear in it."""
    (x, idx), _ = _shapes(op, fusion)
    dim, rows = op.attr("dim"), -1 - len(x)
    labels = tuple(d if d == dim or _alike(x, idx, d) else -1 - d for d in range(len(idx)))
    lx = tuple(rows if d == dim else labels[d] for d in range(len(x)))
    summed = _looked_up(op, fusion, rows)
    return LabelSpec((lx, labels), (labels,), summed=summed,
                     whole=frozenset(lab for lab in (*lx, *labels) if lab < 0) - summed, partial_sets=(frozenset({0}),))


def _scatter_spec(op: Op, fusion: Fusion) -> LabelSpec:
    """scatter: out = x with out[..., index[..., j, ...], ...] = src[..., j, ...] along ``dim``. The output
    shares x's labels; ``dim`` stays whole everywhere (an index may name any row), and so does every dim that
    the index and src do not span alike with x. x and a tensor src may be Partial together (each position of
    the output is either x's or src's)."""
    (x, idx, src), _ = _shapes(op, fusion)
    dim = op.attr("dim")
    shared = [d != dim and _alike(x, idx, d) and (src is None or _alike(x, src, d)) for d in range(len(x))]
    lx = tuple(d if shared[d] else -1 - d for d in range(len(x)))
    lidx = tuple(d if shared[d] else -1 - len(x) - d for d in range(len(idx)))
    whole = frozenset(lab for lab in (*lx, *lidx) if lab < 0)
    return LabelSpec((lx, lidx, None if src is None else lidx), (lx,), whole=whole,
                     partial_sets=(frozenset({0, 2}),) if src is not None else ())


def _index_select_spec(op: Op, fusion: Fusion) -> LabelSpec:
    """x[..., n, ...] indexed along ``dim`` by index[m] -> out[..., m, ...]: x's indexed dim sharded makes a
    partial sum (``_looked_up``), a shard of the index shards the output's dim; x may be Partial (a gather is
    linear)."""
    (x, _), _ = _shapes(op, fusion)
    dim, picked, rows = op.attr("dim"), -1, -2
    lx = tuple(rows if d == dim else d for d in range(len(x)))
    lo = tuple(picked if d == dim else d for d in range(len(x)))
    summed = _looked_up(op, fusion, rows)
    return LabelSpec((lx, (picked,)), (lo,), summed=summed, whole=frozenset({rows}) - summed,
                     partial_sets=(frozenset({0}),))


def _looked_up(op: Op, fusion: Fusion, rows: int) -> frozenset[int]:
    """The label ``rows`` of the dim an indexing op looks x up along, as summed: on its shards each rank looks
    up the rows it holds, zeros for the others (``ops._look_up_held``), a part of a sum over the ranks, as
    Megatron's vocab-parallel embedding (an embedding, or a cross entropy's target logit, of a vocabulary-
    sharded table or logits: an allreduce of the result, not a gather of the table). Not for bool x (no sum)."""
    return frozenset() if fusion.tensor(op.inputs[0]).dtype is DataType.Bool else frozenset({rows})


def _select_spec(op: Op, fusion: Fusion) -> LabelSpec:
    """x[..., n, ...] at one index of ``dim`` -> out without that dim, which stays whole."""
    (x,), _ = _shapes(op, fusion)
    dim = op.attr("dim")
    return LabelSpec((tuple(range(len(x))),), (tuple(d for d in range(len(x)) if d != dim),),
                     whole=frozenset({dim}), partial_sets=(frozenset({0}),))


def _embedding_spec(op: Op, fusion: Fusion) -> LabelSpec:
    """indices[*b] into weight[v, h] -> out[*b, h]: the index dims and the embedding dim h pass a Shard
    through; a sharded vocabulary v is summed (each rank looks up the rows it holds, zeros for the others:
    Megatron's vocab-parallel embedding); the weight may be Partial where the lookup is linear in it. With
    ``max_norm`` the rows are renormalized by their norm, so h stays whole."""
    (idx, _), _ = _shapes(op, fusion)
    batch, V, H = tuple(range(len(idx))), -1, -2
    linear = op.attr("max_norm") is None
    return LabelSpec((batch, (V, H)), ((*batch, H),), summed=frozenset({V}),
                     whole=frozenset() if linear else frozenset({H}),  # max_norm: the norm of a whole row
                     partial_sets=(frozenset({1}),) if linear else ())


def index_put_accumulate(op: Op, fusion: Fusion, n: int) -> list[Candidate]:
    """acc[v, *h] with value[j, *h] added at row index[j]: h passes a Shard through; a sharded v has each rank
    add into the rows it holds (``ops._index_put_accumulate``); acc and value may be Partial together (the op
    is linear in them); sharded rows j sum into a Partial acc, which must then be Partial too (each rank
    adds its rows to its part of acc: a replicated acc would be counted on every rank)."""
    (acc, _, _), _ = _shapes(op, fusion)
    rows, v, h = -1, -2, tuple(range(1, len(acc)))
    spec = LabelSpec(((v, *h), (rows,), (rows, *h)), ((v, *h),), whole=frozenset({rows}),
                     partial_sets=(frozenset({0, 2}),))
    extents = _extents(spec, op, fusion)
    cands = label_candidates(spec, extents, n)
    if extents[rows] % n == 0:
        cands.append(Candidate((PARTIAL_SUM, Shard(0), Shard(0)), (PARTIAL_SUM,)))
    return cands


def _factory_spec(op: Op, fusion: Fusion) -> LabelSpec:
    _, (out,) = _shapes(op, fusion)
    return LabelSpec((), (tuple(range(len(out))),))


def _slice_spec(op: Op, fusion: Fusion) -> LabelSpec:
    """A dim that the slice narrows stays whole; the others pass a Shard through."""
    (x,), (out,) = _shapes(op, fusion)
    labels = tuple(range(len(x)))
    narrowed = frozenset(d for d in labels if out[d] != x[d])
    return LabelSpec((labels,), (labels,), whole=narrowed, partial_sets=(frozenset({0}),))


def slice_candidates(op: Op, fusion: Fusion, n: int) -> list[Candidate]:
    """``_slice_spec``'s candidates, and a narrowed dim's strided shard where the slice takes whole
    blocks: ``Shard(d, outer=k)`` holds [k, n, e/(k n)] of extent e, so bounds on multiples of e/k keep
    a piece of each block taken: ``Shard(d, (end - start) k / e)`` (one block: a block shard). So a fused
    gate/up activation sharded with its halves interleaved slices into two block-sharded halves."""
    cands = from_spec(_slice_spec)(op, fusion, n)
    (x,), (out,) = _shapes(op, fusion)
    for d, (start, end, stride) in enumerate(zip(op.attr("starts"), op.attr("ends"), op.attr("strides"))):
        if out[d] == x[d] or stride != 1 or x[d] < 0 or not isinstance(start, int) or not isinstance(end, int):
            continue
        start, end, _ = slice(start, end).indices(x[d])  # bounds on an extent bound at execute: as Python's
        for k in _divisors(x[d]):
            block = x[d] // k
            if k > 1 and block % n == 0 and start % block == 0 and end % block == 0 and end > start:
                cands.append(Candidate((Shard(d, k),), (Shard(d, (end - start) // block),)))
    return cands


def _cat_spec(op: Op, fusion: Fusion) -> LabelSpec:
    """The concatenated dim stays whole; the others pass a Shard through; Partial operands sum."""
    ins, (out,) = _shapes(op, fusion)
    labels = tuple(range(len(out)))
    return LabelSpec(tuple(labels for _ in ins), (labels,), whole=frozenset({op.attr("dim")}),
                     partial_sets=(frozenset(range(len(ins))),))


def cat_candidates(op: Op, fusion: Fusion, n: int) -> list[Candidate]:
    """``_cat_spec``'s candidates, and, where asked for, k operands of one extent block-sharded on the
    concatenated dim d giving ``Shard(d, outer=k)``: [k, n, e/n] holds block r of each operand on rank r,
    the local cat of the local blocks (the gradient of a fused QKV or gate/up weight from gradients on heads
    or features is in the fused weight's strided layout already). Asked for only: where the result is then
    needed whole, gathering the operands moves less."""
    cands = from_spec(_cat_spec)(op, fusion, n)
    if len(op.inputs) > 1 and (extent := _cat_extent(op, fusion)) is not None and extent % n == 0:
        d = op.attr("dim")
        cands.append(Candidate((Shard(d),) * len(op.inputs), (Shard(d, len(op.inputs)),), asked=True))
    return cands


cat_candidates.asks = True  # it may give a candidate ``asked`` for only (``propagate_shardings`` looks for them)


def _cat_extent(op: Op, fusion: Fusion) -> int | None:
    """The one known extent of a cat's operands on the concatenated dim, if they all have it."""
    ins, _ = _shapes(op, fusion)
    extents = {shape[op.attr("dim")] for shape in ins}
    return extents.pop() if len(extents) == 1 and min(extents) > 0 else None


def reshape_candidates(op: Op, fusion: Fusion, n: int) -> list[Candidate]:
    """A reshape keeps a Shard where the elements each rank holds are one piece of an output dim too.
    Within a group of merged or split dims, viewed as one flat dim, ``Shard(d, outer=k)`` holds the
    blocks [O, n, rest] with O = k times the extents before d in the group. The output dim d' holds the
    same blocks as ``Shard(d', O // Q)``, where Q, the extents before d', divides O and the extent of d'
    divides by ``O // Q * n`` (at most one d' does). So a leading dim's block stays a block, splitting
    the outer factor off a middle piece leaves a block, and merging a sharded dim into the dims before
    it leaves a middle piece. Otherwise (a piece would straddle output dims) the input is gathered
    first. Groups with a symbolic extent keep nothing."""
    (x,), (out,) = _shapes(op, fusion)
    cands = [Candidate((REPLICATE,), (REPLICATE,)), Candidate((PARTIAL_SUM,), (PARTIAL_SUM,))]
    for gi, go in _reshape_groups(x, out):
        if any(x[d] < 0 for d in gi) or any(out[d] < 0 for d in go):
            continue
        for d in gi:
            for k in _divisors(x[d] // n) if x[d] % n == 0 else ():
                blocks = math.prod(x[gi[0]:d]) * k
                for d2 in go:
                    before = math.prod(out[go[0]:d2])
                    if blocks % before == 0 and out[d2] % (blocks // before * n) == 0:
                        cands.append(Candidate((Shard(d, k),), (Shard(d2, blocks // before),)))
    return cands


def _reshape_groups(x: tuple[int, ...], out: tuple[int, ...]) -> Iterable[tuple[list[int], list[int]]]:
    """The groups of a reshape's dims, input and output side, that hold the same elements (``[a, b]`` merged
    into ``[a * b]``, ``[a * b]`` split into ``[a, b]``, or one dim kept). None for a tensor without elements:
    a 0 extent makes every product 0, so its dims cannot be matched (the walk would run off the end), and
    there is nothing to keep sharded."""
    if 0 in x or 0 in out:
        return
    i = o = 0
    while i < len(x) and o < len(out):
        gi, go = [i], [o]
        pi, po = x[i], out[o]
        while pi != po:
            if pi < po:
                i += 1
                gi.append(i)
                pi *= x[i]
            else:
                o += 1
                go.append(o)
                po *= out[o]
        yield gi, go
        i, o = i + 1, o + 1


def _divisors(m: int) -> list[int]:
    """The divisors of ``m`` in increasing order (none for m < 1)."""
    small = [k for k in range(1, math.isqrt(max(m, 0)) + 1) if m % k == 0]
    return small + [m // k for k in reversed(small) if k * k != m]


def attention(free_inputs: tuple[int, ...], free_outputs: tuple[int, ...], query_rows: bool = False,
              scores_from: int | None = None) -> Rule:
    """Attention (sdpfa_fwd/bwd) on [N*, H, S, E] tensors: the leading dims (batch and heads) of the
    operands at ``free_inputs`` and the outputs at ``free_outputs`` are free (a shard passes through
    with no communication); the head dim stays whole. Every query attends to every key, so the keys'
    sequence stays whole; with ``query_rows`` (the forward), the query's rows may be sharded, and the
    output's and logsumexp's rows with them, where no causal mask (aligned to the local rows' start)
    and no dropout (drawn over the whole output) needs the global row. The operands from ``scores_from``
    on are [N*, H, Q, K] terms of the scores (sdpfa_fwd's bias and mask): their dims follow the query's
    shard, a broadcast (extent 1) dim staying replicated, and their keys' dim stays whole. Other tensor
    operands and outputs (philox seed and offset) stay replicated. No operand may be Partial: softmax is
    not linear."""
    def rule(op: Op, fusion: Fusion, n: int) -> list[Candidate]:
        ins, outs = _shapes(op, fusion)
        first = ins[free_inputs[0]]
        terms = range(len(ins) if scores_from is None else scores_from, len(ins))
        tensors_in = tuple(None if s is None else REPLICATE for s in ins)
        cands = [Candidate(tensors_in, (REPLICATE,) * len(outs))]

        def sharded(d: int, free: tuple[int, ...]):
            """The operands' placements with dim ``d`` of those at ``free`` and of the terms that span it
            sharded; None where a term's extent there is neither the query's nor 1."""
            if any(ins[i][d] not in (1, first[d]) for i in terms):
                return None
            return tuple(Shard(d) if i in free or (i in terms and ins[i][d] != 1) else p
                         for i, p in enumerate(tensors_in))

        for d in range(len(first) - 2):
            if first[d] < 0 or first[d] % n or (ins_d := sharded(d, free_inputs)) is None:
                continue
            cands.append(Candidate(ins_d, tuple(Shard(d) if j in free_outputs else REPLICATE
                                                for j in range(len(outs)))))
        rows = len(first) - 2
        if query_rows and not op.attr("is_causal") and not op.attr("dropout_p") and first[rows] >= 0 \
                and first[rows] % n == 0 and (ins_rows := sharded(rows, (0,))) is not None:
            cands.append(Candidate(ins_rows, (Shard(rows), Shard(len(outs[1]) - 1),
                                              *(REPLICATE,) * (len(outs) - 2))))
        return cands
    return rule


def _replicated_spec(op: Op, fusion: Fusion) -> LabelSpec:
    """Every dim of the output whole: the op runs on the full (global) tensor on every rank."""
    _, (out,) = _shapes(op, fusion)
    return LabelSpec((), (tuple(range(len(out))),), whole=frozenset(range(len(out))))


def from_spec(build: Callable[[Op, Fusion], LabelSpec]) -> Rule:
    """A rule from a LabelSpec builder."""
    def rule(op: Op, fusion: Fusion, n: int) -> list[Candidate]:
        spec = build(op, fusion)
        return label_candidates(spec, _extents(spec, op, fusion), n)
    return rule


linear = from_spec(_linear_spec)
grouped_mm = from_spec(_grouped_mm_spec)
matmul = from_spec(_matmul_spec)
permute = from_spec(_permute_spec)
squeeze = from_spec(_squeeze_spec)
unsqueeze = from_spec(_unsqueeze_spec)
broadcast_in_dim = from_spec(_broadcast_in_dim_spec)
factory = from_spec(_factory_spec)
# Random factories: each rank draws the whole tensor and keeps its slice (a free local slice), so a
# sharded draw equals the matching slice of the unsharded one.
replicated_factory = from_spec(_replicated_spec)
slice_ = slice_candidates
index_select = from_spec(_index_select_spec)
select = from_spec(_select_spec)
embedding = from_spec(_embedding_spec)
take_along = from_spec(_take_along_spec)
scatter = from_spec(_scatter_spec)
cat = cat_candidates
reshape = reshape_candidates
