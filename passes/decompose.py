"""Composite ops replaced by the simpler ops they are made of, where propagation asks for it.

An op whose registry entry has a ``decompose`` recipe (``tp_fusion.ops``: softmax, var, var_mean, layer_norm,
native_layer_norm and its backward, topk) can run as that recipe's ops. Whole, the op gathers a dim it
normalizes or reduces over; as its parts, each part reduces its pieces locally and leaves pending sums or maxima
of a few bytes (Megatron's vocab-parallel softmax: an allreduce of each row's max and of its sum of
exponentials, not a gather of the logits; a top-k of each rank's block of the vocabulary, then of those
candidates). Propagation tries it and keeps it where the plan moves fewer bytes
(``propagate_shardings._could_decompose``).
"""

from __future__ import annotations

from tp_fusion.passes.remove_unused import remove_unused

from tp_fusion.ir import Const, Fusion, Op, Tensor
from tp_fusion.mesh import DeviceMesh
from tp_fusion.ops import opdef, operand_types


class Builder:
    """Appends ops to a copy of a fusion's tensors, inferring each result's shape and dtype as recording does.
    ``builder(kind, *operands, out=name, **attrs)``: an operand is a tensor name or a ``Const``; the result is
    a new tensor, or ``out`` (a result of the decomposed op, which keeps its name); an op of several results
    gives a tuple of them (``out`` a tuple, None for a new tensor)."""

    def __init__(self, tensors: tuple[Tensor, ...], mesh: DeviceMesh | None = None):
        self.tensors = list(tensors)
        self.ops: list[Op] = []
        self.mesh = mesh  # the fusion's default mesh: a recipe may cut a dim into as many blocks as it has devices

    def dtype(self, name: int):
        return self.tensors[name].dtype

    def __call__(self, kind: str, *operands: int | Const, out: int | tuple[int | None, ...] | None = None,
                 **attrs) -> int | tuple[int, ...]:
        results = opdef(kind).infer(operand_types(Op(kind, operands, ()), self.tensors.__getitem__), attrs)
        outs = out if isinstance(out, tuple) else (out,) * len(results)
        names = []
        for result, o in zip(results, outs):
            if o is None:
                o = len(self.tensors)
                self.tensors.append(Tensor(o, tuple(result.shape), result.dtype))
            elif (self.tensors[o].shape, self.tensors[o].dtype) != (tuple(result.shape), result.dtype):
                raise AssertionError(f"{kind}: the decomposition gives {result}, not {self.tensors[o].type_str()}")
            names.append(o)
        self.ops.append(Op(kind, operands, tuple(names), tuple(attrs.items())))
        return names[0] if len(names) == 1 else tuple(names)

    def blocks(self, x: int, dim: int, at_least: int = 1) -> int | None:
        """``x`` reshaped with ``dim`` cut into one block per shard of it (a new dim before it; where it is not
        sharded, one per device of the mesh), where the blocks divide it and hold ``at_least`` elements each;
        else None, and nothing is written."""
        shape, sharding = self.tensors[x].shape, self.tensors[x].sharding
        n = sharding.dim_factor(dim) if sharding is not None and sharding.dim_factor(dim) > 1 else self.mesh.size
        if shape[dim] % n or shape[dim] // n < at_least:
            return None
        return self("reshape", x, shape=(*shape[:dim], n, shape[dim] // n, *shape[dim + 1:]))

    def finish(self, name: int, out: int) -> None:
        """Make ``name`` the decomposed op's result ``out``: the op that made it writes ``out`` where it is the
        last op and ``name`` has ``out``'s dtype, else a cast writes ``out`` (a recipe may compute half
        precision in float32, or hand back one of its operands)."""
        assert self.tensors[name].shape == self.tensors[out].shape, "a decomposition keeps its op's shapes"
        last = self.ops[-1] if self.ops else None
        if last is None or last.outputs != (name,) or name != len(self.tensors) - 1 \
                or self.tensors[name].dtype != self.tensors[out].dtype:
            self("cast", name, dtype=self.tensors[out].dtype, out=out)
            return
        self.tensors.pop()
        self.ops[-1] = last.replace(outputs=(out,))


def decomposed(fusion: Fusion, names: frozenset[int], mesh: DeviceMesh) -> Fusion:
    """``fusion`` with the ops whose result is in ``names`` replaced by their ``decompose`` recipes' ops (new
    tensors appended, in op order; the result keeps its name); ``mesh`` is its default mesh. A recipe's ops
    for results that nothing reads (attention's logsumexp in a forward alone) are dropped."""
    if not names:
        return fusion
    builder = Builder(fusion.tensors, mesh)
    for op in fusion.ops:
        written = len(builder.ops)
        if op.outputs[0] in names:
            opdef(op.kind).decompose(op, builder)
        if len(builder.ops) == written:  # not asked for, or the recipe does not apply: the op whole
            builder.ops.append(op)
    return remove_unused(fusion.replace(tensors=tuple(builder.tensors), ops=tuple(builder.ops)))


def decomposes(op: Op, fusion: Fusion, mesh: DeviceMesh) -> bool:
    """Whether ``op``'s recipe applies to it in ``fusion`` (it writes ops: a top-k whose k exceeds a device's
    block, or an unsorted one, stays whole), so that propagation does not plan the fusion again for nothing."""
    builder = Builder(fusion.tensors, mesh)
    opdef(op.kind).decompose(op, builder)
    return bool(builder.ops)
