"""Composite ops replaced by the simpler ops they are made of, where propagation asks for it.

An op whose registry entry has a ``decompose`` recipe (``tp_fusion.ops``: softmax) can run as that recipe's
ops. Propagation tries this where the op would gather a dim it normalizes over: its pieces then reduce
locally and leave pending sums or maxima of a few bytes (Megatron's vocab-parallel softmax: an allreduce of
each row's max and of its sum of exponentials, not a gather of the logits), and keeps it where the plan
moves fewer bytes (``propagate_shardings._could_decompose``).
"""

from __future__ import annotations

from tp_fusion.ir import Const, Fusion, Op, Tensor
from tp_fusion.ops import opdef, operand_types


class Builder:
    """Appends ops to a copy of a fusion's tensors, inferring each result's shape and dtype as recording does.
    ``builder(kind, *operands, out=name, **attrs)``: an operand is a tensor name or a ``Const``; the result is
    a new tensor, or ``out`` (the decomposed op's result, which keeps its name)."""

    def __init__(self, tensors: tuple[Tensor, ...]):
        self.tensors = list(tensors)
        self.ops: list[Op] = []

    def dtype(self, name: int):
        return self.tensors[name].dtype

    def __call__(self, kind: str, *operands: int | Const, out: int | None = None, **attrs) -> int:
        (result,) = opdef(kind).infer(operand_types(Op(kind, operands, ()), self.tensors.__getitem__), attrs)
        if out is None:
            out = len(self.tensors)
            self.tensors.append(Tensor(out, tuple(result.shape), result.dtype))
        elif (self.tensors[out].shape, self.tensors[out].dtype) != (tuple(result.shape), result.dtype):
            raise AssertionError(f"{kind}: the decomposition gives {result}, not {self.tensors[out].type_str()}")
        self.ops.append(Op(kind, operands, (out,), tuple(attrs.items())))
        return out


def decomposed(fusion: Fusion, names: frozenset[int]) -> Fusion:
    """``fusion`` with the ops whose result is in ``names`` replaced by their ``decompose`` recipes' ops (new
    tensors appended, in op order; the result keeps its name)."""
    if not names:
        return fusion
    builder = Builder(fusion.tensors)
    for op in fusion.ops:
        if op.outputs[0] in names:
            opdef(op.kind).decompose(op, builder)
        else:
            builder.ops.append(op)
    return fusion.replace(tensors=tuple(builder.tensors), ops=tuple(builder.ops))
