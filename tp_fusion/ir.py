"""The immutable IR under the FusionDefinition handles.

A ``Fusion`` is a tuple of tensors (index = name: ``T3`` is ``tensors[3]``), a tuple of ops in
topological order, the input and output names, and (after segmentation) its segments. Passes
return new Fusions; nothing here is mutated in place.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from tp_fusion.sharding.sharding import Sharding  # noqa: F401 (the type of Tensor.sharding)
from tp_fusion.types import DataType, ParallelType


@dataclass(frozen=True, slots=True)
class LoopAxis:
    """One axis of a tensor's loop domain (nvFuser's IterDomain) as the user scheduled it.

    ``dim`` is the logical dim the axis is a piece of, or for a ``reduction`` axis (``r{K}``: a dim its
    op reduced, e.g. a GEMM's contraction) the index of that reduced dim among the op's. ``piece`` is
    the axis' place in its dim's splits (one 0 for an outer, one 1 for an inner piece per split), so
    the pieces of a dim sort outermost first whatever the loop order. ``extent`` is -1 when it
    depends on a symbolic size.
    """

    dim: int
    extent: int
    ptype: ParallelType = ParallelType.serial
    reduction: bool = False
    piece: tuple[int, ...] = ()

    def __str__(self) -> str:
        extent = "?" if self.extent < 0 else str(self.extent)
        r = "r" if self.reduction else ""
        if self.ptype.is_device:
            return f"{r}{self.ptype.value}{{{extent}}}"
        return f"r{{{extent}}}" if self.reduction else extent


@dataclass(frozen=True, slots=True)
class Tensor:
    name: int
    shape: tuple[int, ...]  # global shape; -1 = symbolic extent
    dtype: DataType
    sharding: Sharding | None = None
    annotated: bool = False  # the user scheduled it: propagation never changes it
    loop: tuple[LoopAxis, ...] | None = None  # the user's loop domain, when scheduled
    # memory layout (nvFuser's allocation domain) as define_tensor's stride_order: dim i has the
    # stride_order[i]-th smallest stride; None: not fixed (row-major, or what the producer's op gives)
    stride_order: tuple[int, ...] | None = None

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def held_by(self, rank: int) -> bool:
        """Whether ``rank`` holds a part of this tensor (an unsharded tensor is held by every rank)."""
        return self.sharding is None or rank in self.sharding.mesh

    def replace(self, **kw) -> Tensor:
        return dataclasses.replace(self, **kw)

    def type_str(self) -> str:
        return f"{self.dtype.short}[{', '.join('?' if e < 0 else str(e) for e in self.shape)}]"

    def loop_str(self) -> str:
        """The user's loop domain as it prints (``[mesh_x{2}, 4, r{8}]``); it must have one."""
        return "[" + ", ".join(map(str, self.loop)) + "]"

    def sharding_str(self) -> str:
        if self.sharding is None:
            return ""
        if self.loop is not None:
            loop = self.loop_str()
        else:
            loop = self.sharding.loop_axes_str(self.shape)
        return f" @{self.sharding.mesh.short()}{loop}{self.sharding.partial_str()}"

    def __str__(self) -> str:
        return f"T{self.name}"


@dataclass(frozen=True, slots=True)
class Const:
    """A scalar operand (a Python number or a ``define_scalar``)."""

    value: float | int | bool | complex
    dtype: DataType | None = None

    def is_tensor(self) -> bool:
        """False (nvFuser's Val method)."""
        return False

    def __str__(self) -> str:
        return repr(self.value)


@dataclass(frozen=True, slots=True)
class SymbolicSize:
    """nvFuser's symbolic scalar of ``fd.ops.size``/``shape``: the global extent of dim ``dim`` of tensor
    ``tensor``, known once execute binds the inputs' sizes. Ops take it where they take an extent
    (broadcast_in_dim's shape, slice's bounds); compiling replaces it with the extent."""

    tensor: int
    dim: int

    def __repr__(self) -> str:
        return f"T{self.tensor}.size({self.dim})"


@dataclass(frozen=True, slots=True)
class ScalarRef:
    """A number an op takes as an attribute (an extent, a fill value, a seed) given by a scalar known only at
    execute: the value of 0-d tensor ``tensor`` (a ``define_scalar(None, dtype)`` input, or an op on such
    scalars), as ``dtype`` (an extent is an Int, whatever the scalar's dtype; a whole number). Compiling
    replaces it with the value, so a plan is built per value of the scalar inputs it depends on; in a value
    attribute (``OpDef.value_attrs``) it stays, and each call gives its number (``compile.per_call_numbers``)."""

    tensor: int
    dtype: DataType

    def __repr__(self) -> str:
        return f"T{self.tensor}.item()"


Symbol = SymbolicSize | ScalarRef  # an attribute's number known at execute


def resolve_symbols(value, shape_of, value_of):
    """An attribute with each symbol replaced by its number: a SymbolicSize by ``shape_of(tensor)[dim]``, a
    ScalarRef by ``value_of(ref)``."""
    if isinstance(value, SymbolicSize):
        return shape_of(value.tensor)[value.dim]
    if isinstance(value, ScalarRef):
        return value_of(value)
    if isinstance(value, tuple):
        return tuple(resolve_symbols(v, shape_of, value_of) for v in value)
    return value


def symbols_of(value) -> list[ScalarRef]:
    """The ScalarRefs in an attribute (nested in tuples too)."""
    if isinstance(value, ScalarRef):
        return [value]
    if isinstance(value, tuple):
        return [r for v in value for r in symbols_of(v)]
    return []


Arg = int | Const  # an op input: a tensor name or a constant


@dataclass(frozen=True, slots=True)
class Op:
    """One recorded op. ``kind`` names its entry in the op registry (``tp_fusion.ops.OPS``).
    ``strategy`` (a ``tp_fusion.sharding.strategy.Strategy``) is what propagation chose: the
    shardings the op needs of its operands and gives its outputs; later passes read it."""

    kind: str
    inputs: tuple[Arg, ...]
    outputs: tuple[int, ...]
    attrs: tuple[tuple[str, Any], ...] = ()
    strategy: Any = field(default=None, compare=False)

    def attr(self, key: str, default=None):
        for k, v in self.attrs:
            if k == key:
                return v
        return default

    @property
    def tensor_inputs(self) -> tuple[int, ...]:
        return tuple(a for a in self.inputs if isinstance(a, int))

    def replace(self, **kw) -> Op:
        return dataclasses.replace(self, **kw)

    def __str__(self) -> str:
        args = [f"T{a}" if isinstance(a, int) else str(a) for a in self.inputs]
        args += [f"{k}={_fmt_attr(v)}" for k, v in self.attrs]
        outs = ", ".join(f"T{o}" for o in self.outputs)
        return f"{outs} = {self.kind}({', '.join(args)})"


def _fmt_attr(v) -> str:
    if isinstance(v, DataType):
        return f"DataType.{v.name}"
    if isinstance(v, tuple):
        return "[" + ", ".join(_fmt_attr(x) for x in v) + "]"
    return repr(v)


def freeze(value):
    """Lists become tuples, recursively, so attributes stay hashable and immutable."""
    if isinstance(value, (list, tuple)):
        return tuple(freeze(v) for v in value)
    return value


@dataclass(frozen=True, slots=True)
class Segment:
    """A run of ops executed together. ``kind``: compute, communication or fused."""

    kind: str
    ops: tuple[int, ...]  # indices into Fusion.ops
    note: str = ""


@dataclass(frozen=True, slots=True)
class Fusion:
    tensors: tuple[Tensor, ...]
    ops: tuple[Op, ...]
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    segments: tuple[Segment, ...] | None = None
    # (output position, input name): that output is written into that input in place, and not returned
    # (``add_output(tv, alias_input=)``); positions, as passes may rename the outputs
    aliases: tuple[tuple[int, int], ...] = ()
    _producers: dict = field(default=None, compare=False, repr=False)
    _consumers: dict = field(default=None, compare=False, repr=False)

    def replace(self, **kw) -> Fusion:
        if "ops" in kw:
            kw.setdefault("_producers", None)
            kw.setdefault("_consumers", None)
        return dataclasses.replace(self, **kw)

    def tensor(self, name: int) -> Tensor:
        return self.tensors[name]

    @property
    def returned(self) -> tuple[int, ...]:
        """The positions of the outputs ``execute`` returns: all but those aliased to an input."""
        aliased = {p for p, _ in self.aliases}
        return tuple(p for p in range(len(self.outputs)) if p not in aliased)

    @property
    def has_meshes(self) -> bool:
        return any(t.sharding is not None for t in self.tensors)

    def producer(self, name: int) -> Op | None:
        if self._producers is None:
            object.__setattr__(self, "_producers", {o: op for op in self.ops for o in op.outputs})
        return self._producers.get(name)

    def consumers(self, name: int) -> list[Op]:
        """The ops that read tensor ``name``, in order (an op reading it twice appears once)."""
        if self._consumers is None:
            users: dict[int, list[Op]] = {}
            for op in self.ops:
                for a in dict.fromkeys(op.tensor_inputs):
                    users.setdefault(a, []).append(op)
            object.__setattr__(self, "_consumers", users)
        return self._consumers.get(name, [])

    def with_tensors(self, updates: dict[int, Tensor]) -> Fusion:
        return self.replace(tensors=tuple(updates.get(t.name, t) for t in self.tensors))

    def __str__(self) -> str:
        lines = [f"Fusion(inputs=[{', '.join(f'T{i}' for i in self.inputs)}], "
                 f"outputs=[{', '.join(f'T{o}' for o in self.outputs)}])"]
        for i in self.inputs:
            t = self.tensors[i]
            lines.append(f"  T{i} = input : {t.type_str()}{t.sharding_str()}")
        for op in self.ops:
            outs = " ".join(f"{self.tensors[o].type_str()}{self.tensors[o].sharding_str()}" for o in op.outputs)
            lines.append(f"  {op} : {outs}")
        lines += [f"  output {p} (T{self.outputs[p]}) aliased to input T{i}" for p, i in self.aliases]
        return "\n".join(lines)
