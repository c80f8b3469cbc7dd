"""The user-facing DSL: FusionDefinition records ops on TensorView handles with global shapes.

The handles are mutable views over the immutable IR (``tp_fusion.ir``): recording an op appends
to the definition, a schedule call replaces one tensor's IR record with a new one.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from tp_fusion import loop as loops
from tp_fusion import ops as _ops
from tp_fusion.errors import DefinitionError, EmptyFusionError, InputError, ShardingError, UnknownOpError
from tp_fusion.ir import Const, Fusion, LoopAxis, Op, SymbolicSize, Tensor, freeze
from tp_fusion.mesh import DeviceMesh
from tp_fusion.sharding.sharding import Sharding
from tp_fusion.types import DataType, ParallelType

_creation_order = itertools.count()  # how ranks tell their fusions apart: the n-th one each created


def restart_creation_order() -> None:
    """Number the FusionDefinitions created from now on from 0 again. Every rank must create its
    fusions in the same order (execute checks it); a harness that runs many tests on the same
    ranks calls this on every rank at the start of each test (``tp_fusion.testing`` does)."""
    global _creation_order
    _creation_order = itertools.count()


class IterDomain:
    """A handle on one loop axis of a TensorView; ``parallelize`` binds it to a device dim."""

    def __init__(self, tv: TensorView, index: int):
        self._tv, self._index = tv, index

    def parallelize(self, ptype: ParallelType) -> None:
        """Bind this axis to ``ptype``: a device dim (``ParallelType.mesh_x``: one piece per device of
        the mesh's last axis; the extent must equal that axis' size, a symbolic one becomes it) or
        ``serial``. Any piece of a split may be bound (an inner one is a strided shard); a piece of a
        reduction axis ``r{K}`` leaves the tensor partial on that mesh axis (nvFuser's rfactor).

        >>> tv.outer_split(0, d); tv.axis(0).parallelize(ParallelType.mesh_x)
        """
        self._tv._parallelize(self._index, ptype)

    @property
    def extent(self) -> int:
        """The axis' global extent (-1: symbolic)."""
        return self._tv._loop()[self._index].extent

    @property
    def is_reduction(self) -> bool:
        """Whether the axis is a reduction axis ``r{K}`` (a dim its op reduced)."""
        return self._tv._loop()[self._index].reduction

    @property
    def parallel_type(self) -> ParallelType:
        """How the axis runs: ``serial`` or the device dim it is bound to."""
        return self._tv._loop()[self._index].ptype

    def __repr__(self) -> str:
        return f"IterDomain({self._tv._loop()[self._index]})"


class TensorView:
    """A tensor of a fusion: global shape, dtype, and (once scheduled) a sharding."""

    def __init__(self, fd: FusionDefinition, name: int):
        self._fd, self.name = fd, name

    @property
    def _ir(self) -> Tensor:
        return self._fd._tensors[self.name]

    def _update(self, **kw) -> None:
        new = self._ir.replace(**kw)
        if new != self._ir:  # a schedule call that changes nothing keeps the cached plans
            self._fd._tensors[self.name] = new
            self._fd._changed()

    @property
    def shape(self) -> tuple[int, ...]:
        """The GLOBAL shape (-1: a symbolic extent). Called, as nvFuser spells it, ``tv.shape()`` is
        ``fd.ops.shape(tv)``: a symbolic extent is a ``SymbolicSize`` there, which shape arguments bind at
        ``execute`` (a -1 there means something else: keep an extent, count from the end, crop)."""
        return _Shape(self._ir.shape, lambda: self._fd.ops.shape(self))

    def size(self, dim: int):
        """The GLOBAL extent of ``dim``, as ``fd.ops.size(tv, dim)``: an int, or a ``SymbolicSize``."""
        return self._fd.ops.size(self, dim)

    def is_tensor(self) -> bool:
        """True (nvFuser's Val method; scalars here are Python numbers or ``define_scalar`` constants)."""
        return True

    @property
    def dtype(self) -> DataType:
        """The element type."""
        return self._ir.dtype

    @property
    def ndim(self) -> int:
        """The number of dims."""
        return self._ir.ndim

    @property
    def sharding(self) -> Sharding | None:
        """The sharding the schedule gives (mesh and placements); None before ``set_device_mesh``."""
        return self._ir.sharding

    @property
    def mesh(self) -> DeviceMesh | None:
        """The device mesh of ``set_device_mesh``, or None."""
        return self.sharding.mesh if self.sharding else None

    def __repr__(self) -> str:
        return f"TensorView(T{self.name}: {self._ir.type_str()}{self._ir.sharding_str()})"

    # --- sharding schedule -------------------------------------------------------------------

    def _loop(self) -> tuple[LoopAxis, ...]:
        if self._ir.loop is not None:
            return self._ir.loop
        return loops.default_loop(self.shape, self._fd._producer(self.name), lambda name: self._fd._tensors[name].shape)

    def set_device_mesh(self, mesh: DeviceMesh) -> None:
        """Place the tensor on ``mesh``, replicated until an axis is parallelized. Tensors left without a
        mesh get one from propagation."""
        if not isinstance(mesh, DeviceMesh):
            raise ShardingError(f"T{self.name}.set_device_mesh: expected a tp_fusion.DeviceMesh, got "
                                f"{type(mesh).__module__}.{type(mesh).__qualname__}"
                                + (" (torch's: build tp_fusion.DeviceMesh(torch_mesh.mesh) from its ranks)"
                                   if type(mesh).__module__.startswith("torch") else ""))
        loop, before = self._loop(), self._ir
        self._update(sharding=Sharding.replicated(mesh), annotated=True)
        try:
            self._set_loop(loop)
        except Exception:
            self._fd._tensors[self.name] = before  # a rejected mesh leaves the tensor as it was
            raise

    @property
    def contiguity(self) -> tuple[bool | None, ...] | None:
        """An input's declared contiguity (``define_tensor``), one entry per dim in the allocation order
        (outermost first; the logical order without a ``stride_order``), as nvFuser states it; None for
        other tensors."""
        layout = self._fd._layouts.get(self.name)
        return layout.declared if layout else None

    @property
    def stride_order(self) -> tuple[int, ...] | None:
        """An input's declared stride order (``define_tensor``), or None when none was given."""
        layout = self._fd._layouts.get(self.name)
        return layout.stride_order if layout else None

    def set_allocation_domain(self, new_allocation_domain: Sequence[IterDomain], new_contiguity: bool) -> None:
        """nvFuser's allocation domain: the tensor's memory layout, as its loop axes (``tv.axis(i)``, each
        once) outermost first; ``new_contiguity`` True: dense in that order. An input must come in that
        layout (else ``execute`` raises InputError); an output comes back in it. Device-parallel and
        reduction axes hold no memory; the other pieces of a dim must stay adjacent (one stride per dim).
        """
        what = f"T{self.name}.set_allocation_domain"
        axes = list(new_allocation_domain)
        if not all(isinstance(a, IterDomain) and a._tv._fd is self._fd and a._tv.name == self.name for a in axes):
            raise ShardingError(f"{what}: expected this tensor's loop axes (T{self.name}.axis(i)), got {axes!r}")
        if not isinstance(new_contiguity, bool):
            raise ShardingError(f"{what}: new_contiguity must be a bool, got {new_contiguity!r}")
        order = loops.allocation_order(self._loop(), [a._index for a in axes], self.ndim, what)
        if self.name in self._fd._inputs:
            contiguity = tuple(None if e == 1 else new_contiguity for e in self.shape)
            self._fd._layouts[self.name] = Layout(contiguity, order)
        self._update(stride_order=order)

    def outer_split(self, axis: int, factor: int) -> TensorView:
        """Loop axis ``axis`` of extent n becomes [factor, n/factor]. Returns the TensorView."""
        return self.split(axis, factor, inner_split=False)

    def inner_split(self, axis: int, factor: int) -> TensorView:
        """Loop axis ``axis`` of extent n becomes [n/factor, factor]. Returns the TensorView."""
        return self.split(axis, factor, inner_split=True)

    def split(self, axis: int, factor: int, inner_split: bool = True) -> TensorView:
        """Loop axis ``axis`` of extent n becomes [n/factor, factor] (``inner_split=False``: [factor, n/factor]).
        Returns the TensorView, so calls chain."""
        loop = list(self._loop())
        axis = self._check_axis(axis, len(loop), "split")
        old = loop[axis]
        ints = _integers([factor])
        if ints is None or ints[0] < 1:
            raise ShardingError(f"T{self.name}.split: factor must be a positive int, got {factor!r}")
        factor = ints[0]
        if old.ptype.is_device:
            raise ShardingError(f"T{self.name}.split: loop axis {axis} is parallelized on {old.ptype.value}; "
                                "split before parallelizing")
        if old.extent >= 0 and old.extent % factor != 0:
            raise ShardingError(
                f"T{self.name}: split factor {factor} does not divide loop axis {axis} of extent {old.extent} "
                f"(tensor shape {list(self.shape)}); use a factor that divides {old.extent}")
        self._set_loop(loops.split(tuple(loop), axis, factor, inner_split))
        return self

    def reorder(self, old2new: dict[int, int]) -> TensorView:
        """nvFuser's ``reorder``: loop axis ``old`` moves to position ``new`` for each item of ``old2new``;
        the other axes keep their order. Only the loop order changes (not the sharding). Returns the
        TensorView."""
        if not isinstance(old2new, dict):
            raise ShardingError(f"T{self.name}.reorder: expected a dict {{old: new}}, got {old2new!r}")
        self._set_loop(loops.reorder(self._loop(), old2new, f"T{self.name}"))
        return self

    def rfactor(self, axes: Sequence[int]) -> TensorView:
        """nvFuser's manual rfactor of a reduction: a new TensorView ``partial`` takes this tensor's place as
        its op's output, reducing only ``axes`` (reduction axes of the loop domain); this tensor becomes
        a ``set`` of ``partial`` that reduces the remaining reduction axes. Parallelizing a remaining axis
        on ``partial`` leaves it Partial on that mesh axis, and the ``set`` sums it (e.g. an allreduce).

        >>> out.outer_split(-1, d); partial = out.rfactor(axes=[-1]); partial.axis(-2).parallelize(DIDx)
        """
        loop = self._loop()
        picked = {self._check_axis(a, len(loop), "rfactor") for a in axes}
        if not picked or any(not loop[i].reduction for i in picked):
            raise ShardingError(f"T{self.name}.rfactor: axes {list(axes)} must name reduction axes of the loop "
                                f"domain [{', '.join(map(str, loop))}]")
        fd = self._fd
        i, producer = next(((i, op) for i, op in enumerate(fd._ops) if self.name in op.outputs), (None, None))
        if producer is None:
            raise ShardingError(f"T{self.name}.rfactor: T{self.name} is an input; only an op's output has reduction "
                                "axes")
        partial = TensorView(fd, len(fd._tensors))
        fd._tensors.append(self._ir.replace(name=partial.name, loop=loop))
        fd._ops[i] = producer.replace(outputs=tuple(partial.name if o == self.name else o for o in producer.outputs))
        fd._ops.insert(i + 1, Op("set", (partial.name,), (self.name,)))
        partial._set_loop(loop)
        self._set_loop(tuple(ax for j, ax in enumerate(loop) if j not in picked))
        return partial

    def bound_sharding(self, shape: Sequence[int]) -> Sharding | None:
        """The sharding of a full value of global ``shape`` under this schedule: symbolic extents bound,
        and any pending sum done (what ``execute`` returns for it as an output; ``shard_tensor``)."""
        if len(shape) != len(self._ir.shape):
            n = len(self._ir.shape)
            raise ShardingError(f"T{self.name} {self._ir.type_str()} has {n} dims, got a full value of shape "
                                f"{list(shape)}; pass the whole (unsharded) tensor, of {n} dims")
        if self.sharding is None or self._ir.loop is None:
            return self.sharding and self.sharding.materialized()
        loop = loops.bind(self._ir.loop, tuple(shape), f"T{self.name} {self._ir.type_str()}", "")
        return loops.sharding(loop, self.mesh, f"T{self.name}").materialized()  # no Partial left: any op does

    def axis(self, index: int) -> IterDomain:
        """Loop axis ``index`` (after splits; reduction axes ``r{K}`` count, negative ``index`` too), to
        ``parallelize``: ``tv.axis(0).parallelize(ParallelType.mesh_x)``."""
        return IterDomain(self, self._check_axis(index, len(self._loop()), "axis"))

    def _parallelize(self, index: int, ptype: ParallelType) -> None:
        loop = list(self._loop())
        ax = loop[index]
        if not isinstance(ptype, ParallelType):
            raise ShardingError(f"T{self.name}.axis({index}).parallelize: expected a ParallelType, got {ptype!r}")
        if ptype.is_device:
            mesh = self.mesh
            if mesh is None:
                raise ShardingError(f"T{self.name}.axis({index}).parallelize({ptype.value}): the tensor has no "
                                    "device mesh; call set_device_mesh(mesh) first")
            if ptype.mesh_axis(mesh.ndim) < 0:
                raise ShardingError(f"T{self.name}.axis({index}).parallelize({ptype.value}): the mesh "
                                    f"{list(mesh.shape)} has {mesh.ndim} axis(es); {ptype.value} needs more")
            used = [i for i, a in enumerate(loop) if a.ptype is ptype and i != index and a.reduction == ax.reduction]
            if used:
                raise ShardingError(f"T{self.name}: {ptype.value} is already bound to loop axis {used[0]}; "
                                    "a device parallel type may be used once per tensor (once more on a reduction "
                                    "axis)")
        # a symbolic axis bound to a mesh axis has its size, as in nvFuser (an unsplit one: local extent 1)
        extent = self.mesh.shape[ptype.mesh_axis(self.mesh.ndim)] if ptype.is_device and ax.extent < 0 else ax.extent
        loop[index] = dataclasses.replace(ax, extent=extent, ptype=ptype)
        self._set_loop(tuple(loop))

    def _set_loop(self, loop: tuple[LoopAxis, ...]) -> None:
        """Record the loop domain and derive the placements it implies (validated)."""
        mesh = self.mesh
        if mesh is None:
            self._update(loop=loop)
            return
        self._update(loop=loop, sharding=loops.sharding(loop, mesh, f"T{self.name}",
                                                        loops.pending_of(self._fd._producer(self.name))))

    def _check_axis(self, axis: int, n: int, what: str) -> int:
        index = _integers([axis])
        if index is None:
            raise ShardingError(f"T{self.name}.{what}: the axis index must be an int (a loop axis, negative ones "
                                f"count from the end), got {axis!r}")
        if not -n <= index[0] < n:
            raise ShardingError(f"T{self.name}.{what}: axis {axis} is out of range for a loop domain of "
                                f"{n} axes (tensor shape {list(self.shape)})")
        return index[0] % n


class Scalar(TensorView):
    """A scalar known only at execute (nvFuser's symbolic scalar Val): an input that ``execute`` takes as a
    number (``define_scalar(None, dtype)``), or an op on such scalars. Ops take it as a 0-d tensor of its
    dtype (torch promotes it as one: ``mul(f32_tensor, double_scalar)`` is float32), read at every call.
    Where they take a number instead, it is read at every call if it only sets values (a fill value, a
    bound, a seed: ``OpDef.value_attrs``); otherwise (an extent, an index) its value is bound when the
    plan is built: a plan per value of the scalar inputs that those attributes read."""

    def is_tensor(self) -> bool:
        """False: a scalar (nvFuser's Val method)."""
        return False

    def __repr__(self) -> str:
        return f"Scalar(T{self.name}: {self.dtype.short})"


Operand = TensorView | Const | int | float | bool | complex


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


@dataclass(frozen=True)
class Layout:
    """An input's declared layout (``define_tensor``): per logical dim True (dense with the next faster
    dim), False (any stride) or None (broadcast); ``stride_order`` as in nvFuser, None where none was
    declared (a declared row-major order is kept: the input is then checked against it). ``declared``
    gives the contiguity as nvFuser states it, in the allocation order."""

    contiguity: tuple[bool | None, ...]
    stride_order: tuple[int, ...] | None = None

    @property
    def constrains(self) -> bool:
        return any(c is True for c in self.contiguity) or self.stride_order is not None

    @property
    def declared(self) -> tuple[bool | None, ...]:
        """The contiguity in the allocation order (outermost first), as define_tensor takes it."""
        return tuple(self.contiguity[d] for d in _outermost_first(self.stride_order, len(self.contiguity)))


def _outermost_first(stride_order: Sequence[int] | None, n: int) -> list[int]:
    """The dims in the allocation order (outermost first) of a stride order (None: row-major)."""
    return list(range(n)) if stride_order is None else sorted(range(n), key=lambda d: -stride_order[d])


class _Shape(tuple):
    """A TensorView's shape: a tuple of ints (-1: symbolic), and called (nvFuser's ``tv.shape()``) its extents as
    ``fd.ops.shape`` gives them (``SymbolicSize`` for the symbolic ones)."""

    def __new__(cls, extents: tuple[int, ...], sizes: Callable[[], list]):
        shape = super().__new__(cls, extents)
        shape._sizes = sizes
        return shape

    def __call__(self) -> list:
        return self._sizes()

    def __reduce__(self):
        return tuple, (tuple(self),)


def compute_tensor_descriptor(sizes: Sequence[int], strides: Sequence[int]) -> tuple[list, list[int]]:
    """nvFuser's ``compute_tensor_descriptor``: the (contiguity, stride_order) that ``define_tensor`` takes for a
    tensor of these sizes and strides (what ``from_pytorch`` and ``define_tensor(sizes=, strides=)`` declare).

    The dims with a stride are ordered by stride, largest first (equal strides keep their order); a dim of
    stride 0 (an expanded broadcast) keeps its logical position, so that an expanded tensor's order is not
    permuted for it. ``stride_order[i]`` is dim i's place counted from the fastest (``[n-1, ..., 0]``:
    row-major). The contiguity is in that allocation order, outermost first: None for a broadcast dim
    (extent 1 or stride 0), else whether the dim's stride is the extent times the stride of the next faster
    dim that is no broadcast (1 for the fastest)."""
    sizes, strides = [int(e) for e in sizes], [int(s) for s in strides]
    n = len(sizes)
    if len(strides) != n:
        raise DefinitionError(f"compute_tensor_descriptor: sizes {sizes} and strides {strides} differ in length")
    if any(s < 0 for s in strides):
        raise DefinitionError(f"compute_tensor_descriptor: strides {strides} has a negative stride")
    outer_first = sorted((d for d in range(n) if strides[d] != 0), key=lambda d: -strides[d])
    for d in range(n):  # the stride-0 dims at their logical positions, in order
        if strides[d] == 0:
            outer_first.insert(d, d)

    def broadcast(d: int) -> bool:
        return sizes[d] == 1 or strides[d] == 0
    contiguity, stride_order, want = [None] * n, [0] * n, 1
    for j in reversed(range(n)):  # fastest first
        d = outer_first[j]
        stride_order[d] = n - 1 - j
        if not broadcast(d):
            contiguity[j] = strides[d] == want
            want = strides[d] * sizes[d]
    return contiguity, stride_order


def _descriptor(sizes: Sequence[int], strides: Sequence[int], static_sizes: bool):
    """nvFuser's ``define_tensor(sizes=, strides=)``: (shape, contiguity in the allocation order, stride
    order or None for row-major) of a tensor laid out so (``compute_tensor_descriptor``). Extents are
    symbolic (-1) unless ``static_sizes``, except 1 (a broadcast dim)."""
    if len(strides) != len(sizes):
        raise DefinitionError(f"define_tensor: sizes {list(sizes)} and strides {list(strides)} differ in length")
    contiguity, order = compute_tensor_descriptor(sizes, strides)
    n = len(sizes)
    shape = tuple(e if static_sizes or e == 1 else -1 for e in sizes)
    return shape, contiguity, None if order == list(range(n - 1, -1, -1)) else order


def _layout(shape: tuple[int, ...], contiguity, stride_order) -> Layout:
    n = len(shape)
    order = None
    if stride_order is not None and len(stride_order) > 0:
        order = tuple(stride_order)
        if not all(isinstance(o, int) and not isinstance(o, bool) for o in order) or \
                sorted(order) != list(range(n)):
            raise DefinitionError(f"define_tensor: stride_order {list(order)} must be a permutation of "
                                  f"0..{n - 1} (dim i has the stride_order[i]-th smallest stride)")
    if contiguity is None:
        contig = tuple(None if e == 1 else False for e in shape)
    elif isinstance(contiguity, bool):
        contig = tuple(None if e == 1 else contiguity for e in shape)  # nvFuser: size-1 dims are broadcasts
    elif isinstance(contiguity, Sequence) and not isinstance(contiguity, str):
        given = tuple(contiguity)
        if len(given) != n or not all(c is None or isinstance(c, bool) for c in given):
            raise DefinitionError(f"define_tensor: contiguity {list(given)} must hold one True, False or None "
                                  f"per dim of shape {list(shape)} ({n} dims)")
        # As nvFuser's: in the allocation order (outermost first) where a stride_order is given.
        contig = [None] * n
        for d, c in zip(_outermost_first(order, n), given):
            contig[d] = c
        contig = tuple(contig)
        bad = [d for d, (c, e) in enumerate(zip(contig, shape)) if c is not None and e == 1]
        if bad:
            raise DefinitionError(f"define_tensor: dim {bad[0]} of shape {list(shape)} has extent 1, a broadcast "
                                  f"dim in nvFuser; its contiguity must be None, got {contig[bad[0]]}")
    else:
        raise DefinitionError(f"define_tensor: contiguity must be None, a bool or a list of True/False/None, "
                              f"got {contiguity!r}")
    return Layout(contig, order)


def _fixed_order(order: tuple[int, ...] | None, ndim: int) -> tuple[int, ...] | None:
    """The IR's stride order for a declared one: None for row-major (the IR's default)."""
    return None if order == tuple(range(ndim - 1, -1, -1)) else order


class FusionInputs(tuple):
    """``Fusion.inputs`` of ``fd.fusion``: the input names (a tuple), and called, nvFuser's
    ``fd.fusion.inputs()``: the input TensorViews. ``layouts`` maps names to declared layouts; ``scalars`` holds
    the inputs that execute takes as numbers (``define_scalar(None, dtype)``)."""

    _fd: FusionDefinition | None = None
    layouts: dict = {}
    scalars: frozenset = frozenset()

    def __call__(self) -> list[TensorView]:
        if self._fd is None:
            raise DefinitionError("fusion.inputs(): this snapshot has no FusionDefinition to hand out TensorViews")
        return [self._fd._view(name) for name in self]

    def __reduce__(self):
        return tuple, (tuple(self),)


class FusionDefinition:
    """Records a fusion with GLOBAL shapes; use as a context manager, then ``execute`` on every rank.

    >>> with FusionDefinition() as fd:
    ...     x = fd.define_tensor([8, 4]); w = fd.define_tensor([6, 4])
    ...     fd.add_output(fd.ops.linear(x, w))

    ``print(fd)`` shows the definition, ``fd.plan`` the program of the last ``execute``.
    """

    def __init__(self):
        self._tensors: list[Tensor] = []
        self._ops: list[Op] = []
        self._inputs: list[int] = []
        self._outputs: list[int] = []
        self._layouts: dict[int, Layout] = {}  # input name -> declared layout (define_tensor)
        self._scalars: set[int] = set()  # the 0-d tensors that stand for scalars (Scalar handles): inputs, ops on them
        self._size_scalars: dict[SymbolicSize, int] = {}  # symbolic sizes that arithmetic took, as Scalars
        self._aliases: dict[int, int] = {}  # output position -> the input it is written into (add_output)
        self.ops = _OpsNamespace(self)
        self._plan = None
        self._executor = None
        self._serial = next(_creation_order)  # the same fusion on every rank has the same serial
        self._closed = False

    def __enter__(self) -> FusionDefinition:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        """The definition is complete: recording ops or inputs and outputs afterwards is an error
        (as in nvFuser); scheduling (splits, meshes, parallelization) may go on."""
        if exc_type is None:
            self._closed = True

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise DefinitionError(f"{what}: the definition is complete (its `with FusionDefinition() as fd:` "
                                  "block has closed); record every op, input and output inside the block")

    def _changed(self) -> None:
        self._executor = None  # the definition changed: cached plans are stale

    @property
    def fusion(self) -> Fusion:
        """An immutable snapshot of the definition. Its ``inputs`` is the tuple of input names; called,
        as nvFuser spells it (``fd.fusion.inputs()``), it gives the input TensorViews."""
        inputs = FusionInputs(self._inputs)
        inputs._fd, inputs.layouts = self, dict(self._layouts)
        inputs.scalars = frozenset(self._scalars.intersection(self._inputs))
        return Fusion(tuple(self._tensors), tuple(self._ops), inputs, tuple(self._outputs),
                      aliases=tuple(self._aliases.items()))

    def __str__(self) -> str:
        return str(self.fusion)

    @property
    def plan(self):
        """The program the last ``execute`` ran on this rank (``print(fd.plan)`` shows its segments,
        ``fd.plan.collectives()`` its collectives, ``fd.plan.summary()`` bytes and FLOPs); None before
        the first ``execute``. For a plan without executing, on any machine, call
        ``fd.compile(global_input_shapes, rank=0, device="cuda")``."""
        return self._plan

    def __repr__(self) -> str:
        counts = ", ".join(_count(n, what) for n, what in
                           ((len(self._inputs), "input"), (len(self._outputs), "output"), (len(self._ops), "op")))
        plan = self.plan
        state = "not executed" if plan is None else f"executed, plan of {_count(len(plan.segments), 'segment')}"
        return f"<FusionDefinition: {counts}; {state}>"

    def _new_tensor(self, shape, dtype: DataType) -> TensorView:
        self._check_open("defining a tensor")
        name = len(self._tensors)
        self._tensors.append(Tensor(name, tuple(shape), dtype))
        self._changed()
        return TensorView(self, name)

    def _size_scalar(self, size: SymbolicSize) -> Scalar:
        """The Scalar of a symbolic size's value, for arithmetic on it: a 0-d Int ``full`` of it (compiling binds
        it), recorded once per size."""
        name = self._size_scalars.get(size)
        if name is None:
            name = self._size_scalars[size] = self._record("full", [], shape=(), fill_value=size,
                                                           dtype=DataType.Int).name
            self._scalars.add(name)
        return self._view(name)

    def _view(self, name: int) -> TensorView:
        """The handle of tensor ``name``: a Scalar where it stands for one."""
        return Scalar(self, name) if name in self._scalars else TensorView(self, name)

    def define_tensor(self, shape: Sequence[int] | None = None, contiguity=None, dtype: DataType = DataType.Float,
                      is_cpu: bool = False, stride_order: Sequence[int] | None = None, *,
                      sizes: Sequence[int] | None = None, strides: Sequence[int] | None = None,
                      static_sizes: bool = False) -> TensorView:
        """An input of GLOBAL shape ``shape`` (-1: a symbolic extent), with nvFuser's arguments:

        - ``contiguity``: None (no promise: any strides), a bool for every dim, or one entry per dim.
          ``True``: the dim's stride is the size times the stride of the next faster dim (1 for the
          fastest); ``False``: any stride; ``None``: a broadcast dim (extent 1 or expanded), any stride.
        - ``stride_order``: a permutation of the dims; dim ``i`` has the ``stride_order[i]``-th
          smallest stride (``[n-1, ..., 1, 0]`` is row-major). None: row-major, as in nvFuser.
        - ``is_cpu``: accepted for nvFuser's CPU scalar tensors; tp_fusion runs an input where it lies.

        ``execute`` checks each rank's local shard against the layout (an InputError names the dim).
        nvFuser's other form, ``define_tensor(sizes=, strides=, dtype=, static_sizes=)``, declares the
        layout of a tensor with these sizes and strides; its extents are symbolic (-1, but 1 stays 1)
        unless ``static_sizes``, where ``sizes`` is the GLOBAL shape.
        """
        if sizes is not None:
            if shape is not None or contiguity is not None or stride_order is not None or strides is None:
                raise DefinitionError("define_tensor: give sizes with strides (and no shape, contiguity or "
                                      "stride_order), or shape")
            shape, contiguity, stride_order = _descriptor(sizes, strides, static_sizes)
        if shape is None:
            raise DefinitionError("define_tensor: missing its shape")
        ints = _integers(shape)
        if ints is None or not all(e >= 0 or e == -1 for e in ints):
            raise DefinitionError(f"define_tensor: shape {shape!r} must be a list of integer extents >= 0 or -1 "
                                  "(symbolic)")
        shape = ints
        if isinstance(contiguity, DataType):
            raise DefinitionError(f"define_tensor: the second argument is contiguity (nvFuser's order: shape, "
                                  f"contiguity, dtype, is_cpu, stride_order); pass dtype={contiguity} by keyword")
        _ops.tensor_dtype("define_tensor", dtype)
        if not isinstance(is_cpu, bool):
            raise DefinitionError(f"define_tensor: is_cpu must be a bool, got {is_cpu!r}")
        layout = _layout(shape, contiguity, stride_order)
        tv = self._new_tensor(shape, dtype)
        self._inputs.append(tv.name)
        self._layouts[tv.name] = layout
        tv._update(stride_order=_fixed_order(layout.stride_order, len(shape)))
        return tv

    def from_pytorch(self, tensor: torch.Tensor, static_sizes: bool = False) -> TensorView:
        """nvFuser's ``from_pytorch``: an input with ``tensor``'s dtype and layout, its extents symbolic
        unless ``static_sizes`` (then ``tensor``'s shape is the GLOBAL shape: pass the full tensor's, or
        leave the extents symbolic for a shard)."""
        if not isinstance(tensor, torch.Tensor):
            raise DefinitionError(f"from_pytorch: expected a torch.Tensor, got {type(tensor).__name__}")
        return self.define_tensor(sizes=tensor.shape, strides=tensor.stride(), dtype=DataType.from_torch(tensor.dtype),
                                  static_sizes=static_sizes, is_cpu=tensor.device.type == "cpu")

    def define_scalar(self, value=None, dtype: DataType | None = None) -> Const | Scalar:
        """A constant operand ``value`` (a Python number, or a numpy scalar: the number it holds), converted
        to ``dtype`` when given (None or ``DataType.Null``: the value kept as it is, of the dtype nvFuser gives
        its kind: a bool is Bool, an int Int, a float Double, a complex ComplexDouble). Ops take it as the
        number, as torch does; a dtype decided by scalars alone (``where(c, s0, s1)``) is theirs. Without a
        value, nvFuser's symbolic scalar: an input of ``dtype`` (default Double) that ``execute`` takes as a number, in
        order with the other inputs (a ``Scalar``); ``define_scalar(DataType.Int)`` is one of that dtype, as in
        nvFuser."""
        if isinstance(value, DataType) and dtype is None:
            value, dtype = None, value
        if value is None:
            dtype = DataType.Double if dtype in (None, DataType.Null) else _ops.tensor_dtype("define_scalar", dtype)
            tv = self._new_tensor((), dtype)
            self._inputs.append(tv.name)
            self._scalars.add(tv.name)
            return self._view(tv.name)
        value = _ops.python_scalar(value)
        if not isinstance(value, _ops.NUMBER):
            raise DefinitionError(f"define_scalar: value must be a Python number (or None: a scalar input), got "
                                  f"{value!r}")
        if dtype in (None, DataType.Null):
            dtype = DataType.of_number(value)
        else:
            dtype = _ops.data_type("define_scalar", dtype)
            if isinstance(value, complex) and not dtype.is_complex:
                raise DefinitionError(f"define_scalar: {value!r} is complex; {dtype!r} holds no complex number (give "
                                      "DataType.ComplexFloat or DataType.ComplexDouble, or pass value.real)")
            value = dtype.python_type(value)
            if dtype in (DataType.Int, DataType.Int32) and not torch.iinfo(dtype.torch).min <= value <= \
                    torch.iinfo(dtype.torch).max:
                raise DefinitionError(f"define_scalar: {value} does not fit in {dtype.torch}")
        return Const(value, dtype)

    def define_vector(self, size: int, dtype: DataType = DataType.Int) -> list[Scalar]:
        """nvFuser's vector of ``size`` scalar inputs of ``dtype``, which ops take where they take a list of
        numbers (a shape: ``fd.ops.reshape(x, v)``). ``execute`` takes them as numbers, or as one list (or
        tuple) in their place: a list among the inputs stands for its elements."""
        n = _integers([size])
        if n is None or n[0] < 0:
            raise DefinitionError(f"define_vector: size must be an int >= 0, got {size!r}")
        return [self.define_scalar(None, dtype) for _ in range(n[0])]

    def add_output(self, tv: TensorView, alias_input: TensorView | None = None) -> None:
        """Make ``tv`` an output: ``execute`` returns this rank's local shard of it, in order of calls.

        With ``alias_input`` (an input of this fusion, of ``tv``'s shape and dtype), as nvFuser's: ``execute``
        writes ``tv``'s value into that input in place (each rank its shard, in the input's sharding: the
        plan reshards ``tv`` to it) and does not return it. ``tv`` may also be added plainly; as in nvFuser,
        a plain output of ``tv`` or of the input then comes back as the input tensor itself (holding the
        new values), where the plan gives it the input's sharding.
        """
        self._check_open("add_output")
        if not isinstance(tv, TensorView) or tv._fd is not self:
            raise DefinitionError(f"add_output: expected a TensorView of this fusion, got {tv!r}")
        if alias_input is not None:
            self._check_alias(tv, alias_input)
            self._aliases[len(self._outputs)] = alias_input.name
        self._outputs.append(tv.name)
        self._changed()

    def _check_alias(self, tv: TensorView, alias_input) -> None:
        """``add_output(tv, alias_input)`` is an in-place write that ``execute`` can make: into an input of
        this fusion of ``tv``'s shape and dtype, that no other output is written into."""
        where = f"add_output(T{tv.name}, alias_input)"
        if not isinstance(alias_input, TensorView) or alias_input._fd is not self or \
                alias_input.name not in self._inputs:
            got = repr(alias_input) if isinstance(alias_input, TensorView) else _ops.describe_value(alias_input)
            raise DefinitionError(f"{where}: alias_input must be an input of this fusion (a define_tensor), which "
                                  f"the output is written into in place; got {got}")
        out, inp = self._tensors[tv.name], self._tensors[alias_input.name]
        if out.shape != inp.shape or out.dtype != inp.dtype:
            raise DefinitionError(f"{where}: the output {out.type_str()} is written into the input in place, so it "
                                  f"must have the input's shape and dtype, {inp.type_str()}")
        for p, i in self._aliases.items():
            if i == alias_input.name or self._outputs[p] == tv.name:
                raise DefinitionError(f"{where}: output T{self._outputs[p]} is already aliased to input T{i}; an "
                                      "input takes one aliased output, and an output is aliased to one input")

    def _record(self, kind: str, inputs: Sequence[Operand], **attrs) -> TensorView | tuple:
        """Append op ``kind`` on ``inputs`` (TensorViews or numbers); shapes and dtypes are inferred
        (and checked) now. Returns the output TensorView(s)."""
        self._check_open(kind)
        op = _ops.opdef(kind)
        args: list = []
        for x in inputs:
            if isinstance(x, TensorView):
                self._check_own(x, kind)
                args.append(x.name)
            elif isinstance(x, Const):
                args.append(x)
            elif isinstance(x, _ops.NUMBER):
                args.append(Const(x))
            else:
                raise DefinitionError(f"{kind}: unsupported operand {_ops.describe_value(x)}; pass a TensorView or a "
                                      "number")
        attrs = {k: None if v is DataType.Null else freeze(v) for k, v in attrs.items()}  # Null: no dtype
        if op.has(_ops.Trait.POINTWISE):
            args = [self._rebroadcast(a, args) for a in args]
        try:
            outs = op.infer([self._operand_type(a) for a in args], attrs)
        except DefinitionError as e:
            described = ", ".join(f"T{a} {self._tensors[a].type_str()}" if isinstance(a, int) else repr(a.value)
                                  for a in args) or "no operands"
            raise DefinitionError(f"{kind}: cannot apply to {described}: {e}") from None
        tvs = [self._new_tensor(t.shape, t.dtype) for t in outs]
        self._ops.append(Op(kind, tuple(args), tuple(tv.name for tv in tvs), tuple(attrs.items())))
        tensors = [a for a in args if isinstance(a, int)]
        if tensors and all(a in self._scalars for a in tensors):  # an op on scalars: its 0-d results are scalars
            self._scalars.update(tv.name for tv, t in zip(tvs, outs) if not t.shape)
            tvs = [self._view(tv.name) for tv in tvs]
        return tvs[0] if len(tvs) == 1 else tuple(tvs)

    def _check_own(self, tv: TensorView, kind: str) -> None:
        """``tv`` is a tensor of this definition: a TensorView is a name (T0, T1, ...), which in another
        definition stands for another tensor."""
        if tv._fd is not self:
            raise DefinitionError(f"{kind}: T{tv.name} belongs to another FusionDefinition; an op takes tensors "
                                  "of the definition it is recorded in")

    def _rebroadcast(self, a, args: list):
        """Operand ``a`` of a pointwise op on ``args``, as nvFuser's expanded broadcast: a dim that
        ``broadcast_in_dim`` made new with an extent other than 1 still broadcasts, so where another
        operand's extent there differs (or is symbolic), ``a`` is broadcast again from its source to it."""
        new_dims = self._new_broadcast_dims(a)
        if not new_dims:
            return a
        producer = self._producer(a)
        mine, shape = self._tensors[a].shape, list(producer.attr("shape"))
        for d in new_dims:
            for b in args:
                other = self._tensors[b].shape if isinstance(b, int) and b != a else ()
                db = d - len(mine) + len(other)
                if db < 0 or db in self._new_broadcast_dims(b):
                    continue
                theirs = other[db]
                if theirs != 1 and theirs != mine[d] and (theirs >= 0 or mine[d] >= 0):
                    shape[d] = theirs if theirs >= 0 else SymbolicSize(b, db)
                    break
        if tuple(shape) == producer.attr("shape"):
            return a
        return self._record("broadcast_in_dim", [TensorView(self, producer.inputs[0])], shape=tuple(shape),
                            broadcast_dims=producer.attr("broadcast_dims")).name

    def _new_broadcast_dims(self, a) -> list[int]:
        """The dims of tensor ``a`` that a ``broadcast_in_dim`` made new with an extent other than 1."""
        producer = self._producer(a) if isinstance(a, int) else None
        if producer is None or producer.kind != "broadcast_in_dim":
            return []
        bdims = producer.attr("broadcast_dims")
        return [d for d, e in enumerate(self._tensors[a].shape) if d not in bdims and e != 1]

    def _producer(self, name: int) -> Op | None:
        """The recorded op that outputs tensor ``name`` (None for an input)."""
        return next((op for op in self._ops if name in op.outputs), None)

    def _operand_type(self, a):
        if isinstance(a, Const):
            return a.value
        t = self._tensors[a]
        return _ops.TensorType(t.shape, t.dtype)

    # --- execution ---------------------------------------------------------------------------

    def execute(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Run on this rank's LOCAL input shards; returns this rank's local output shards.

        Every rank of the default process group calls it, for the same fusions in the same order.
        Forward only: it runs under ``torch.no_grad``, accepts inputs that require grad and returns
        outputs that do not (``tp_fusion.autograd.function`` trains); it computes in the declared dtypes, autocast
        or not, in or out of inference mode. Inputs are never modified, except inputs that an output is aliased
        to (``add_output(tv, alias_input=)``): those are written in place. The first
        call for a new input signature compiles (and, on GPUs, times the fused segments); ``fd.plan``
        is then the program it runs. A single tensor stands for the list of it.
        """
        from tp_fusion.executor import Executor

        self._check_outputs("execute")
        inputs = self._input_list(inputs)
        if self._executor is None:
            self._executor = Executor(self.fusion, self._serial)
        outputs, self._plan = self._executor.run(inputs)
        return outputs

    def _input_list(self, inputs) -> list:
        """``inputs`` as execute takes them: a single tensor is the list of it, not its rows (anything else that
        is no iterable is checked with the inputs, so that every rank raises alike); a list among them stands
        for its elements (numbers for a ``define_vector``)."""
        inputs = list(inputs) if isinstance(inputs, Iterable) and not isinstance(inputs, torch.Tensor) else [inputs]
        if self._scalars.intersection(self._inputs):
            inputs = [v for x in inputs for v in (x if isinstance(x, (list, tuple)) else [x])]
        return inputs

    def validate(self, inputs: Sequence[torch.Tensor], reference_outputs: Sequence[torch.Tensor] | None = None, *,
                 atol: float | None = None, rtol: float | None = None) -> list[torch.Tensor]:
        """nvFuser's ``validate``: ``execute(inputs)``, then each returned output compared with its reference;
        returns the outputs. ``reference_outputs`` holds one tensor per returned output, its GLOBAL value
        (each rank compares its shard); without them the references are computed by evaluating the
        definition's ops one by one on the inputs, whole and unsharded (``tp_fusion.validate.reference``),
        which needs the inputs whole: a fusion with meshes under a process group of several ranks must be
        given references. Tolerances are nvFuser's, by dtype and by how many elements a value sums up;
        ``atol``/``rtol`` override them. A mismatch raises ``ValidationError`` (an AssertionError) naming
        the output and the largest difference.
        """
        from tp_fusion.validate import validate

        self._check_outputs("validate")
        return validate(self, inputs, reference_outputs, atol, rtol)

    def compile(self, input_shapes: Sequence[Sequence[int]], rank: int = 0, device: str | torch.device = "cpu"):
        """The plan ``execute`` would run on ``rank`` for inputs of these GLOBAL shapes, without any
        process group or communication: inspect a GPU job's plan on a laptop. Fused segments show
        ``undecided`` (their mode is measured on GPUs at the first execute). A scalar input is given its
        value (a number) instead.

        >>> plan = fd.compile([[4096, 1024], [4096, 1024], [4096], [1024, 4096]], rank=0)
        >>> print(plan); print(plan.collectives())
        """
        from tp_fusion.compile import compile_program, fits_scalar

        self._check_outputs("compile")
        if not isinstance(input_shapes, Sequence) or len(input_shapes) != len(self._inputs):
            raise InputError(f"compile: expected a list of {_count(len(self._inputs), 'global shape')}, one per input "
                             f"({', '.join(f'T{n}' for n in self._inputs)}), got {input_shapes!r}")
        ranks = _integers([rank])
        if ranks is None or ranks[0] < 0:
            raise InputError(f"compile: rank must be the rank (an int >= 0) whose plan to build, got {rank!r}")
        shapes, scalars = [], {}
        for name, given in zip(self._inputs, input_shapes):
            if name in self._scalars:  # a scalar input: its value
                value = _ops.python_scalar(given)
                if not fits_scalar(value, self._tensors[name].dtype):
                    raise InputError(f"compile: input T{name} is a scalar; give its value (a number of its kind, "
                                     f"{self._tensors[name].dtype.torch}), got {given!r}")
                shapes.append(())
                scalars[name] = value
                continue
            t, shape = self._tensors[name], _integers(given)
            if shape is None or len(shape) != t.ndim or any(d >= 0 and d != s for d, s in zip(t.shape, shape)):
                raise InputError(f"compile: input T{name} is defined as {list(t.shape)}, got global shape "
                                 f"{_shown(given)}; input_shapes holds one list of extents per input")
            if any(e < 0 for e in shape):
                raise InputError(f"compile: input T{name} is given the global shape {list(shape)}; a plan is built "
                                 f"for concrete global shapes: give each symbolic extent of {list(t.shape)} its size")
            shapes.append(shape)
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise InputError(f"compile: device must be a torch.device or its name ('cpu', 'cuda'), got {device!r}") \
                from e
        return compile_program(self.fusion, shapes, ranks[0], device, scalars)

    def _check_outputs(self, what: str) -> None:
        """A fusion without outputs computes nothing: an error at its first use (alike on every rank), not
        an empty list that a caller unpacks far from the cause. (The texts start as nvFuser's.)"""
        if not self._outputs:
            if not (self._closed or self._tensors):
                raise EmptyFusionError(f"{what}: Fusion does not exist! Use `with FusionDefinition() as fd: ...` to "
                                       "define a fusion. Record its ops and mark its results with fd.add_output(tv)")
            raise EmptyFusionError(f"{what}: Fusion is empty! It has no outputs; record its ops and mark its results "
                                   "with fd.add_output(tv) inside `with FusionDefinition() as fd:`")

    def output_shardings(self) -> list:
        """One Sharding per output, from the plan of the last ``execute``."""
        if self.plan is None:
            raise DefinitionError("output_shardings: run execute() first, or ask the plan of given global "
                                  "shapes: fd.compile(shapes).output_shardings(); shardings depend on the sizes")
        return self.plan.output_shardings()


def _shown(value) -> str:
    """A global shape as an error message shows it: a tensor given instead by its type and shape (not its
    values), and what to give."""
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {list(value.shape)} (a tensor: give its shape, list(t.shape))"
    return repr(value)


def _integers(values: Iterable) -> tuple[int, ...] | None:
    """``values`` as Python ints where each is an integer (an int or a numpy integer, not a bool);
    None otherwise."""
    try:
        values = tuple(values)
    except TypeError:
        return None
    if any(isinstance(v, bool) or not hasattr(v, "__index__") for v in values):
        return None
    try:
        return tuple(v.__index__() for v in values)
    except (TypeError, RuntimeError):  # a tensor of several elements has __index__ but refuses it
        return None


class _OpsNamespace:
    """``fd.ops``: every op of the registry (``tp_fusion.ops``); ``dir(fd.ops)`` lists them and
    ``help(fd.ops.<name>)`` documents one. Shapes and dtypes are inferred and checked when an op is
    recorded; ops take global shapes."""

    def __init__(self, fd: FusionDefinition):
        self._fd = fd

    def __getattr__(self, name):
        raise UnknownOpError(f"fd.ops has no op {name!r}; the ops are: {', '.join(_ops.user_ops())}")

    def __dir__(self):
        return _ops.user_ops()


def _method(name: str, front):
    def method(self, *args, **kwargs):
        rec = _ops.Recorder(self._fd, name)
        args, kwargs = [rec.argument(a) for a in args], {k: rec.argument(v) for k, v in kwargs.items()}
        return front(rec, *args, **kwargs)
    sig = _ops.front_signature(front)
    method.__signature__ = sig.replace(parameters=[inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY),
                                                   *sig.parameters.values()])
    method.__name__ = method.__qualname__ = name
    method.__doc__ = front.__doc__
    return method


for _name, _front in _ops.fronts().items():
    setattr(_OpsNamespace, _name, _method(_name, _front))
