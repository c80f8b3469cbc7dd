"""Composite ops replaced by the simpler ops they are made of, where propagation asks for it.

An op whose registry entry has a ``decompose`` recipe (``tp_fusion.ops``: softmax, var, var_mean, layer_norm,
native_layer_norm and its backward) can run as that recipe's ops. Whole, the op gathers a dim it normalizes or
reduces over; as its parts, each part reduces its pieces locally and leaves pending sums or maxima of a few
bytes (Megatron's vocab-parallel softmax: an allreduce of each row's max and of its sum of exponentials, not a
gather of the logits). Propagation tries it and keeps it where the plan moves fewer bytes
(``propagate_shardings._could_decompose``).
"""

from __future__ import annotations

from tp_fusion.ir import Const, Fusion, Op, Tensor
from tp_fusion.ops import opdef, operand_types


class Builder:
    """Appends ops to a copy of a fusion's tensors, inferring each result's shape and dtype as recording does.
    ``builder(kind, *operands, out=name, **attrs)``: an operand is a tensor name or a ``Const``; the result is
    a new tensor, or ``out`` (a result of the decomposed op, which keeps its name)."""

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
