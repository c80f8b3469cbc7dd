"""Per-op sharding rules: for one mesh axis, the placements an op can run with.

A rule returns candidates, each a (placement per input, placement per output) pair that the op
computes correctly on local shards. Most ops are described einsum-style (``LabelSpec``): every
tensor dim carries a label; a label shared by an output passes a Shard through, a summed label
(a contraction, a sum) yields Partial, a ``whole`` label (a normalized dim, a max) must stay
unsharded. Which inputs may be Partial is listed per op (only where the op is linear in them).
The registry ``RULES`` maps an op kind to a function building its candidates.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tp_fusion.sharding.sharding import PARTIAL_SUM, REPLICATE, Placement, Shard
from tp_fusion.ir import Fusion, Op


@dataclass(frozen=True, slots=True)
class Candidate:
    inputs: tuple[Placement | None, ...]  # None for a non-tensor operand
    outputs: tuple[Placement, ...]


@dataclass(frozen=True)
class LabelSpec:
    inputs: tuple[tuple[int | None, ...] | None, ...]  # per operand, a label per dim (None: not shardable)
    outputs: tuple[tuple[int | None, ...], ...]
    summed: frozenset[int] = frozenset()  # contracted labels whose local results add up
    whole: frozenset[int] = frozenset()  # labels that must stay unsharded
    partial_sets: tuple[frozenset[int], ...] = ()  # operand sets that may be Partial together


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
                outs.append(PARTIAL_SUM)
            else:
                break
        if len(outs) != len(spec.outputs):
            continue
        ins = tuple(None if seq is None else Shard(seq.index(lab)) if lab in seq else REPLICATE
                    for seq in spec.inputs)
        cands.append(Candidate(ins, tuple(outs)))
    for group in spec.partial_sets:
        ins = tuple(None if seq is None else PARTIAL_SUM if i in group else REPLICATE
                    for i, seq in enumerate(spec.inputs))
        cands.append(Candidate(ins, (PARTIAL_SUM,) * len(spec.outputs)))
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


def _broadcast_spec(op: Op, fusion: Fusion) -> LabelSpec:
    """Pointwise ops: dims aligned from the right; an operand dim of extent 1 under a larger output
    dim is broadcast and carries no label."""
    ins, (out,) = _shapes(op, fusion)
    labels_in = []
    for shape in ins:
        if shape is None:
            labels_in.append(None)
            continue
        offset = len(out) - len(shape)
        labels_in.append(tuple(None if e == 1 and out[offset + d] != 1 else offset + d
                               for d, e in enumerate(shape)))
    tensors = _tensor_positions(op)
    consts = len(tensors) < len(op.inputs)
    partial = {
        "add": () if consts else (tensors,), "sub": () if consts else (tensors,),
        "mul": tuple(frozenset({i}) for i in sorted(tensors)),
        "div": (frozenset({0}),) if 0 in tensors else (),
        "neg": (frozenset({0}),), "set": (frozenset({0}),),
        "cast": (frozenset({0}),) if op.attr("dtype") and op.attr("dtype").is_floating else (),
    }.get(op.kind, ())
    return LabelSpec(tuple(labels_in), (tuple(range(len(out))),), partial_sets=partial)


def _reduction_spec(op: Op, fusion: Fusion) -> LabelSpec:
    (shape, *_), outs = _shapes(op, fusion)
    dims, keepdim = op.attr("dims"), op.attr("keepdim")
    kept = tuple(None if d in dims else d for d in range(len(shape)))
    out = kept if keepdim else tuple(d for d in kept if d is not None)
    linear = op.kind in ("sum", "mean")
    return LabelSpec((tuple(range(len(shape))),), (out,) * len(outs),
                     summed=frozenset(dims) if linear else frozenset(),
                     whole=frozenset() if linear else frozenset(dims),
                     partial_sets=(frozenset({0}),) if linear else ())


def _linear_spec(op: Op, fusion: Fusion) -> LabelSpec:
    """x[..., k] @ w[n, k]^T + b[n]: batch labels 0.., n = -1, k = -2 (summed)."""
    (x, _w, b), _ = _shapes(op, fusion)
    batch = tuple(range(len(x) - 1))
    N, K = -1, -2
    has_bias = b is not None
    return LabelSpec(((*batch, K), (N, K), (N,) if has_bias else None), ((*batch, N),),
                     summed=frozenset({K}),
                     partial_sets=() if has_bias else (frozenset({0}), frozenset({1})))


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
    of the output alone (the op can produce any slice of them from a replicated input)."""
    (x,), (out,) = _shapes(op, fusion)
    bdims = op.attr("broadcast_dims")
    lin = tuple(d if x[i] == out[d] else None for i, d in enumerate(bdims))
    return LabelSpec((lin,), (tuple(range(len(out))),), partial_sets=(frozenset({0}),))


def _normalization_spec(op: Op, fusion: Fusion) -> LabelSpec:
    ins, _ = _shapes(op, fusion)
    x = ins[0]
    if op.kind == "softmax":
        whole = (op.attr("dim"),)
    else:
        whole = tuple(range(len(x) - len(op.attr("normalized_shape")), len(x)))
    labels = tuple(range(len(x)))
    params = tuple(None if s is None else whole[len(whole) - len(s):] for s in ins[1:])
    return LabelSpec((labels, *params), (labels,), whole=frozenset(whole))


def _full_spec(op: Op, fusion: Fusion) -> LabelSpec:
    _, (out,) = _shapes(op, fusion)
    return LabelSpec((), (tuple(range(len(out))),))


def reshape_candidates(op: Op, fusion: Fusion, n: int) -> list[Candidate]:
    """A reshape keeps a Shard when the sharded dim leads its group of merged/split dims on both
    sides and both leading extents divide by ``n`` (the local reshape is then the same reshape on
    1/n of the leading dim). Otherwise the input must be gathered first."""
    (x,), (out,) = _shapes(op, fusion)
    cands = [Candidate((REPLICATE,), (REPLICATE,)), Candidate((PARTIAL_SUM,), (PARTIAL_SUM,))]
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
        lead_i = next((d for d in gi if x[d] != 1), None)
        lead_o = next((d for d in go if out[d] != 1), None)
        if lead_i is not None and lead_o is not None and x[lead_i] % n == 0 and out[lead_o] % n == 0:
            cands.append(Candidate((Shard(lead_i),), (Shard(lead_o),)))
        i, o = i + 1, o + 1
    return cands


def _from_spec(build: Callable[[Op, Fusion], LabelSpec]):
    def rule(op: Op, fusion: Fusion, n: int) -> list[Candidate]:
        spec = build(op, fusion)
        return label_candidates(spec, _extents(spec, op, fusion), n)
    return rule


RULES: dict[str, Callable[[Op, Fusion, int], list[Candidate]]] = {
    **{k: _from_spec(_broadcast_spec) for k in (
        "neg", "abs", "exp", "log", "tanh", "sigmoid", "relu", "silu", "sqrt", "rsqrt", "gelu", "cast", "set",
        "add", "sub", "mul", "div", "pow", "maximum", "minimum", "where")},
    **{k: _from_spec(_reduction_spec) for k in ("sum", "mean", "amax", "var_mean")},
    "linear": _from_spec(_linear_spec),
    "matmul": _from_spec(_matmul_spec),
    "permute": _from_spec(_permute_spec),
    "squeeze": _from_spec(_squeeze_spec),
    "unsqueeze": _from_spec(_unsqueeze_spec),
    "broadcast_in_dim": _from_spec(_broadcast_in_dim_spec),
    "layer_norm": _from_spec(_normalization_spec),
    "softmax": _from_spec(_normalization_spec),
    "full": _from_spec(_full_spec),
    "reshape": reshape_candidates,
}


def preference(op: Op, fusion: Fusion) -> list[int]:
    """Operand positions in the order whose sharding an op follows: linear the weight, then the
    bias, then the input (as nvFuser); matmul B then A; otherwise the most device-parallel first."""
    tensors = [i for i, a in enumerate(op.inputs) if isinstance(a, int)]
    if op.kind == "linear":
        return [i for i in (1, 2, 0) if i in tensors]
    if op.kind == "matmul":
        return [1, 0]

    def parallel_axes(i):
        s = fusion.tensor(op.inputs[i]).sharding
        return s.num_device_axes() if s else 0
    return sorted(tensors, key=lambda i: -parallel_axes(i))
