"""Insert a resharding ``set`` wherever a tensor's sharding differs from what its consumer needs."""

from __future__ import annotations

from tp_fusion.sharding.reshard import departure, free_between, held_already, on_own_devices
from tp_fusion.sharding.sharding import REPLICATE, Partial, Placement, Shard, Sharding
from tp_fusion.sharding.strategy import Strategy

from tp_fusion.ir import Fusion, Op, Tensor
from tp_fusion.ops import Trait, is_biased_gemm, traits


def insert_reshardings(fusion: Fusion) -> Fusion:
    """Requires: every tensor has a sharding and every op its ``strategy`` (propagate_shardings).
    Ensures: every op but ``set`` gets its inputs in the shardings its strategy needs and produces
    exactly its outputs' shardings (an output that nothing reads takes the sharding the op gives it);
    every change of sharding is a ``set`` of its own (one per tensor and target, reused; a pending sum
    summed once is sliced from that copy for another target); no fusion output is Partial (an output
    the user scheduled with a pending sum is summed by a ``set``, as nvFuser's device-parallel
    reduction axis finishes its reduction) and comes back in the output's memory layout; an output aliased
    to an input (written into it in place) is resharded to that input's sharding.

    A linear whose contraction is sharded and that has a bias is split into a linear without bias
    (Partial), the resharding of that result, and an add of the bias: the bias is added once. (A
    weight with leading dims, ``[*lead, out, in]``, has a bias ``[*lead, out]`` that is first broadcast
    to the output's dims, ``[*lead, 1, ..., out]``.)
    """
    if not fusion.has_meshes:
        return fusion
    tensors = list(fusion.tensors)
    ops: list[Op] = []
    cache: dict[tuple[int, Sharding], int] = {}
    read = {a for op in fusion.ops for a in op.tensor_inputs} | set(fusion.outputs)

    def new_tensor(like: int, sharding: Sharding) -> int:
        t = tensors[like]
        tensors.append(Tensor(len(tensors), t.shape, t.dtype, sharding))
        return len(tensors) - 1

    summed_whole = _read_in_many_shardings(fusion)

    def copy_of(name: int, target: Sharding) -> int | None:
        """A tensor made already that holds ``name`` as ``target``, or a sum of it a local step away."""
        whole = tensors[name].sharding.materialized()
        if name in summed_whole and target != whole and not target.has_partial:
            reshard(name, whole)  # summed whole once; the target is sliced or kept from that copy
        return cache.get((name, target)) or _local_copy(name, target, tensors, cache)

    def start_of(name: int, target: Sharding) -> int | None:
        """What a move of ``name`` to ``target`` starts from instead of ``name``: a copy made already
        (``copy_of``), or ``name`` brought to the sharding it leaves its mesh from, where ``target`` is on
        another mesh (``departure``; moves to several meshes share those steps)."""
        source = copy_of(name, target)
        if source is None and name in summed_whole and target.mesh != tensors[name].sharding.mesh:
            source = cache.get((name, tensors[name].sharding.materialized()))  # sent from the whole sum
        leave = departure(tensors[name].sharding, target, tensors[name].shape) if source is None else None
        return reshard(name, leave) if leave is not None and leave != tensors[name].sharding else source

    def reshard(name: int, target: Sharding) -> int:
        if tensors[name].sharding == target:
            return name
        if (name, target) not in cache:
            source = start_of(name, target)
            if source is not None:
                return reshard(source, target)
            cache[(name, target)] = out = new_tensor(name, target)
            ops.append(Op("set", (name,), (out,)))
        return cache[(name, target)]

    for op in fusion.ops:
        if traits(op.kind) & Trait.RESHARD:  # a set between two shardings: lowering's job
            (a,), (o,) = op.inputs, op.outputs
            target = tensors[o].sharding
            source = start_of(a, target)  # then the set is a local copy or slice of that, or the move from it
            ops.append(op if source is None else op.replace(inputs=(source,)))
            cache.setdefault((a, target), o)
            continue
        st: Strategy = op.strategy
        bias_once = is_biased_gemm(op) and st.outputs[0].has_partial  # the bias is resharded for its add
        used = op.inputs[:2] if bias_once else op.inputs
        args = tuple(reshard(a, s) if isinstance(a, int) else a for a, s in zip(used, st.inputs))
        if bias_once:
            out, target = op.outputs[0], tensors[op.outputs[0]].sharding
            partial = new_tensor(out, st.outputs[0])
            ops.append(Op(op.kind, args[:2], (partial,), strategy=Strategy(st.mesh, st.inputs[:2], st.outputs)))
            summed = reshard(partial, target)  # before the bias's resharding, as fuse_collectives expects
            bias = tensors[op.inputs[2]]
            lead, ndim = bias.ndim - 1, tensors[out].ndim  # the weight's leading dims; the output's dims
            bias_target = Sharding(target.mesh, tuple(_bias_placement(p, lead, ndim) for p in target.placements))
            bias_arg = reshard(bias.name, bias_target)
            if lead and ndim > lead + 1:  # [*lead, out] -> [*lead, 1, ..., out]: aligned with the output's dims
                shape = (*bias.shape[:-1], *(1,) * (ndim - lead - 1), bias.shape[-1])
                wide = Sharding(target.mesh, tuple(_widened_placement(p, lead, ndim) for p in bias_target.placements))
                tensors.append(Tensor(len(tensors), shape, bias.dtype, wide))
                ops.append(Op("broadcast_in_dim", (bias_arg,), (len(tensors) - 1,),
                              (("shape", shape), ("broadcast_dims", (*range(lead), ndim - 1))),
                              strategy=Strategy(st.mesh, (bias_target,), (wide,))))
                bias_arg = len(tensors) - 1
            add_in = (target, tensors[bias_arg].sharding)
            tensors[out] = _no_longer_reduced(tensors[out])
            ops.append(Op("add", (summed, bias_arg), (out,), strategy=Strategy(st.mesh, add_in, (target,))))
            continue
        outs, after = [], []
        for o, natural in zip(op.outputs, st.outputs):
            if o not in read:  # an output nothing reads (layer_norm's mean): left as the op makes it
                tensors[o] = tensors[o].replace(sharding=natural)
            if natural == tensors[o].sharding:
                outs.append(o)
            else:
                tmp = new_tensor(o, natural)
                outs.append(tmp)
                tensors[o] = _no_longer_reduced(tensors[o])
                after.append(Op("set", (tmp,), (o,)))
        ops.append(op.replace(inputs=args, outputs=tuple(outs)))
        ops.extend(after)
    # An output written into an input in place (Fusion.aliases) ends in that input's sharding.
    into = dict(fusion.aliases)
    outputs = tuple(reshard(o, tensors[into[p]].sharding if p in into else tensors[o].sharding.materialized())
                    for p, o in enumerate(fusion.outputs))
    for o, summed in zip(fusion.outputs, outputs):  # the summed copy returned keeps the output's layout
        if summed != o and tensors[summed].stride_order is None:
            tensors[summed] = tensors[summed].replace(stride_order=tensors[o].stride_order)
    return fusion.replace(tensors=tuple(tensors), ops=tuple(ops), outputs=outputs)


def _read_in_many_shardings(fusion: Fusion) -> set[int]:
    """The pending sums that ops (or users' sets) read in three or more shardings, or in two where one
    needs the whole sum (whole on its mesh, or on some of its devices, which it reaches from the whole
    sum with no communication): these are summed whole once (one allreduce) and sliced or kept for each,
    where a reduction per sharding would move more; and those needed whole on their mesh that another mesh
    reads too, which then gets the whole sum (rather than its reduce-scattered pieces, ``reshard.departure``)."""
    targets: dict[int, set[Sharding]] = {}
    whole: set[int] = set()
    elsewhere: set[int] = set()  # read on devices off its mesh too (another pipeline stage)
    for op in fusion.ops:
        reads = zip(op.inputs, (fusion.tensor(op.outputs[0]).sharding,)) if traits(op.kind) & Trait.RESHARD \
            else zip(op.inputs, op.strategy.inputs) if op.strategy is not None else ()
        for a, need in reads:
            have = fusion.tensor(a).sharding if isinstance(a, int) else None
            if have is None or not have.has_partial or need is None or need == have or need.has_partial:
                continue
            if on_own_devices(have, need):
                targets.setdefault(a, set()).add(need)
                if need == have.materialized() or need.mesh != have.mesh:
                    whole.add(a)
            else:
                elsewhere.add(a)
    return {a for a, ts in targets.items() if len(ts) >= 3 or len(ts) == 2 and a in whole
            or a in elsewhere and fusion.tensor(a).sharding.materialized() in ts}


def _local_copy(name: int, target: Sharding, tensors: list[Tensor], cache: dict) -> int | None:
    """A copy of ``name`` that a ``set`` already made (summed, where ``name`` is a pending sum) and from which
    ``target`` is a local slice away, or a local copy away (its devices hold their pieces already), so the
    move does not run again; None where there is none. (A target on some of the devices of a whole copy
    starts from that copy through ``departure``.)"""
    shape = tensors[name].shape
    for (src, have), copy in cache.items():
        if src == name and not have.has_partial and (free_between(have, target) or held_already(have, target, shape)):
            return copy
    return None


def _no_longer_reduced(t: Tensor) -> Tensor:
    """``t`` once a copy or an add produces it instead of its reduction (which now writes a new tensor):
    its loop domain without the reduction's serial axes (``r{K}``), which belong to that reduction. A
    device-parallel one stays: it says that ``t`` is a pending sum."""
    if t.loop is None:
        return t
    return t.replace(loop=tuple(a for a in t.loop if not a.reduction or a.ptype.is_device))


def _bias_placement(p: Placement, lead: int, ndim: int) -> Placement:
    """How the bias [*lead, out] (``lead`` leading dims of the weight, none for a 2-D one) must be placed
    to be added to a linear output [*lead, ..., out] of ``ndim`` dims placed ``p``: sharded as the
    output's leading or out dim is, partial (on one device) where the output is a pending sum."""
    if isinstance(p, Shard) and p.dim == ndim - 1:
        return Shard(lead, p.outer)
    if isinstance(p, Shard) and p.dim < lead:
        return p
    return p if isinstance(p, Partial) else REPLICATE


def _widened_placement(p: Placement, lead: int, ndim: int) -> Placement:
    """The placement ``p`` of the bias [*lead, out] on the bias broadcast to [*lead, 1, ..., out]."""
    return Shard(ndim - 1, p.outer) if isinstance(p, Shard) and p.dim == lead else p
