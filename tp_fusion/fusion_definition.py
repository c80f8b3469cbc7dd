"""The user-facing DSL: FusionDefinition records ops on TensorView handles with global shapes.

The handles are mutable views over the immutable IR (``tp_fusion.ir``): recording an op appends
to the definition, a schedule call replaces one tensor's IR record with a new one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tp_fusion.sharding.sharding import REPLICATE, Shard, Sharding
from tp_fusion import ops as _ops
from tp_fusion.errors import DefinitionError, LoweringError, ShardingError
from tp_fusion.ir import Const, Fusion, LoopAxis, Op, Tensor, freeze
from tp_fusion.mesh import DeviceMesh
from tp_fusion.types import DataType, ParallelType


class IterDomain:
    """A handle on one loop axis of a TensorView; ``parallelize`` binds it to a device dim."""

    def __init__(self, tv: TensorView, index: int):
        self._tv, self._index = tv, index

    def parallelize(self, ptype: ParallelType) -> None:
        self._tv._parallelize(self._index, ptype)

    @property
    def extent(self) -> int:
        return self._tv._loop()[self._index].extent

    @property
    def parallel_type(self) -> ParallelType:
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
        self._fd._tensors[self.name] = self._ir.replace(**kw)
        self._fd._changed()

    @property
    def shape(self) -> tuple[int, ...]:
        return self._ir.shape

    @property
    def dtype(self) -> DataType:
        return self._ir.dtype

    @property
    def ndim(self) -> int:
        return self._ir.ndim

    @property
    def sharding(self) -> Sharding | None:
        return self._ir.sharding

    @property
    def mesh(self) -> DeviceMesh | None:
        return self.sharding.mesh if self.sharding else None

    def __repr__(self) -> str:
        return f"TensorView(T{self.name}: {self._ir.type_str()}{self._ir.sharding_str()})"

    # --- sharding schedule -------------------------------------------------------------------

    def _loop(self) -> tuple[LoopAxis, ...]:
        return self._ir.loop or tuple(LoopAxis(d, e) for d, e in enumerate(self.shape))

    def set_device_mesh(self, mesh: DeviceMesh) -> None:
        if not isinstance(mesh, DeviceMesh):
            raise ShardingError(f"T{self.name}.set_device_mesh: expected a DeviceMesh, got {type(mesh).__name__}")
        loop, before = self._loop(), self._ir
        self._update(sharding=Sharding.replicated(mesh), annotated=True)
        try:
            self._set_loop(loop)
        except Exception:
            self._fd._tensors[self.name] = before  # a rejected mesh leaves the tensor as it was
            raise

    def outer_split(self, axis: int, factor: int) -> None:
        """Loop axis ``axis`` of extent n becomes [factor, n/factor]."""
        self.split(axis, factor, inner_split=False)

    def split(self, axis: int, factor: int, inner_split: bool = True) -> None:
        """Loop axis ``axis`` of extent n becomes [n/factor, factor] (``inner_split=False``: [factor, n/factor])."""
        loop = list(self._loop())
        axis = self._check_axis(axis, len(loop), "split")
        old = loop[axis]
        if not isinstance(factor, int) or factor < 1:
            raise ShardingError(f"T{self.name}.split: factor must be a positive int, got {factor!r}")
        if old.ptype.is_device:
            raise ShardingError(f"T{self.name}.split: loop axis {axis} is parallelized on {old.ptype.value}; "
                                "split before parallelizing")
        if old.extent >= 0 and old.extent % factor != 0:
            raise ShardingError(
                f"T{self.name}: split factor {factor} does not divide loop axis {axis} of extent {old.extent} "
                f"(tensor shape {list(self.shape)}); use a factor that divides {old.extent}")
        rest = -1 if old.extent < 0 else old.extent // factor
        outer, inner = (rest, factor) if inner_split else (factor, rest)
        loop[axis:axis + 1] = [LoopAxis(old.dim, outer, outermost=old.outermost),
                               LoopAxis(old.dim, inner, outermost=False)]
        self._set_loop(tuple(loop))

    def axis(self, index: int) -> IterDomain:
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
            used = [i for i, a in enumerate(loop) if a.ptype is ptype and i != index]
            if used:
                raise ShardingError(f"T{self.name}: {ptype.value} is already bound to loop axis {used[0]}; "
                                    "a device parallel type may be used once per tensor")
        loop[index] = LoopAxis(ax.dim, ax.extent, ptype, ax.outermost)
        self._set_loop(tuple(loop))

    def _set_loop(self, loop: tuple[LoopAxis, ...]) -> None:
        """Record the loop domain and derive the placements it implies (validated)."""
        mesh = self.mesh
        if mesh is None:
            self._update(loop=loop)
            return
        placements = [REPLICATE] * mesh.ndim
        for i, ax in enumerate(loop):
            if not ax.ptype.is_device:
                continue
            mesh_axis = ax.ptype.mesh_axis(mesh.ndim)
            where = f"T{self.name} loop axis {i} ({ax.ptype.value})"
            if mesh_axis < 0:
                raise ShardingError(f"{where}: the mesh {list(mesh.shape)} has no such axis")
            if not ax.outermost:
                raise LoweringError(f"{where}: only the outermost piece of a dim can be device-parallel; "
                                    f"use outer_split({i}, {mesh.shape[mesh_axis]}) on dim {ax.dim}")
            if ax.extent != mesh.shape[mesh_axis]:
                raise ShardingError(
                    f"{where}: extent {ax.extent} must equal the mesh axis size {mesh.shape[mesh_axis]}; "
                    f"use outer_split(axis, {mesh.shape[mesh_axis]})")
            if any(p == Shard(ax.dim) for p in placements):
                raise LoweringError(f"{where}: dim {ax.dim} is already sharded on another mesh axis; "
                                    "sharding one dim on two mesh axes is not supported")
            placements[mesh_axis] = Shard(ax.dim)
        self._update(loop=loop, sharding=Sharding(mesh, tuple(placements)))

    def _check_axis(self, axis: int, n: int, what: str) -> int:
        if not isinstance(axis, int) or not -n <= axis < n:
            raise ShardingError(f"T{self.name}.{what}: axis {axis} is out of range for a loop domain of "
                                f"{n} axes (tensor shape {list(self.shape)})")
        return axis % n


Operand = TensorView | Const | int | float | bool


class FusionDefinition:
    """Records a fusion with global shapes; see API.md. Use as a context manager."""

    def __init__(self):
        self._tensors: list[Tensor] = []
        self._ops: list[Op] = []
        self._inputs: list[int] = []
        self._outputs: list[int] = []
        self.ops = _OpsNamespace(self)
        self.plan = None
        self._executor = None

    def __enter__(self) -> FusionDefinition:
        return self

    def __exit__(self, *exc) -> None:
        return None

    def _changed(self) -> None:
        self._executor = None  # the definition changed: cached plans are stale

    @property
    def fusion(self) -> Fusion:
        """An immutable snapshot of the definition."""
        return Fusion(tuple(self._tensors), tuple(self._ops), tuple(self._inputs), tuple(self._outputs))

    def __str__(self) -> str:
        return str(self.fusion)

    def _new_tensor(self, shape, dtype: DataType) -> TensorView:
        name = len(self._tensors)
        self._tensors.append(Tensor(name, tuple(shape), dtype))
        self._changed()
        return TensorView(self, name)

    def define_tensor(self, shape: Sequence[int], dtype: DataType = DataType.Float) -> TensorView:
        shape = tuple(shape)
        if not all(isinstance(e, int) and (e >= 0 or e == -1) for e in shape):
            raise DefinitionError(f"define_tensor: shape {list(shape)} must hold extents >= 0 or -1 (symbolic)")
        if not isinstance(dtype, DataType):
            raise DefinitionError(f"define_tensor: dtype must be a DataType, got {dtype!r}")
        tv = self._new_tensor(shape, dtype)
        self._inputs.append(tv.name)
        return tv

    def define_scalar(self, value, dtype: DataType | None = None) -> Const:
        if not isinstance(value, (int, float, bool)):
            raise DefinitionError(f"define_scalar: value must be a Python number, got {value!r}")
        if dtype is not None:
            value = {DataType.Bool: bool, DataType.Int: int, DataType.Int32: int}.get(dtype, float)(value)
        return Const(value, dtype)

    def add_output(self, tv: TensorView) -> None:
        if not isinstance(tv, TensorView) or tv._fd is not self:
            raise DefinitionError(f"add_output: expected a TensorView of this fusion, got {tv!r}")
        self._outputs.append(tv.name)
        self._changed()

    def _record(self, kind: str, inputs: Sequence[Operand | None], **attrs) -> TensorView | tuple:
        args: list = []
        for x in inputs:
            if isinstance(x, TensorView):
                if x._fd is not self:
                    raise DefinitionError(f"{kind}: T{x.name} belongs to another FusionDefinition")
                args.append(x.name)
            elif x is None or isinstance(x, Const):
                args.append(Const(x) if x is None else x)
            elif isinstance(x, (int, float, bool)):
                args.append(Const(x))
            else:
                raise DefinitionError(f"{kind}: unsupported operand {x!r}; pass a TensorView or a number")
        attrs = {k: freeze(v) for k, v in attrs.items()}
        infer_args = [(self._tensors[a].shape, self._tensors[a].dtype) if isinstance(a, int) else a.value
                      for a in args]

        def describe():
            return ", ".join(f"T{a} {self._tensors[a].type_str()}" if isinstance(a, int) else repr(a.value)
                             for a in args) or "no operands"
        outs = _ops.infer(kind, infer_args, attrs, describe)
        tvs = [self._new_tensor(shape, dtype) for shape, dtype in outs]
        self._ops.append(Op(kind, tuple(args), tuple(tv.name for tv in tvs), tuple(attrs.items())))
        return tvs[0] if len(tvs) == 1 else tuple(tvs)

    # --- execution ---------------------------------------------------------------------------

    def execute(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Run on this rank's LOCAL input shards; returns this rank's local output shards."""
        from tp_fusion.executor import Executor

        if self._executor is None:
            self._executor = Executor(self.fusion)
        outputs, self.plan = self._executor.run(list(inputs))
        return outputs

    def output_shardings(self) -> list:
        """One Sharding per output, from the plan of the last ``execute``."""
        if self.plan is None:
            raise DefinitionError("output_shardings: run execute() first; shardings depend on the inputs' sizes")
        return self.plan.output_shardings()


def _dims(x: TensorView, dims, op: str) -> tuple[int, ...]:
    dims = (dims,) if isinstance(dims, int) else tuple(dims)
    n = x.ndim
    for d in dims:
        if not isinstance(d, int) or not -n <= d < n:
            raise DefinitionError(f"{op}: dim {d} is out of range for T{x.name} {x._ir.type_str()}")
    out = tuple(sorted({d % n for d in dims}))
    if len(out) != len(dims):
        raise DefinitionError(f"{op}: dims {list(dims)} repeat a dim of T{x.name}")
    return out


def _tv(x, op: str) -> TensorView:
    if not isinstance(x, TensorView):
        raise DefinitionError(f"{op}: expected a TensorView, got {x!r}")
    return x


class _OpsNamespace:
    """``fd.ops``: every op of API.md. Shapes and dtypes are inferred (and checked) when recorded."""

    def __init__(self, fd: FusionDefinition):
        self._fd = fd

    def _r(self, kind, *inputs, **attrs):
        return self._fd._record(kind, inputs, **attrs)

    def __getattr__(self, name):
        if name in _ops.UNARY_OPS:
            return lambda x: self._r(name, _tv(x, name))
        if name in _ops.BINARY_OPS:
            def binary(a, b):
                if not isinstance(a, TensorView) and not isinstance(b, TensorView):
                    raise DefinitionError(f"{name}: at least one operand must be a TensorView, got {a!r}, {b!r}")
                return self._r(name, a, b)
            return binary
        raise AttributeError(f"fd.ops has no op {name!r}")

    def gelu(self, x, approximate: str = "none"):
        if approximate not in ("none", "tanh"):
            raise DefinitionError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
        return self._r("gelu", _tv(x, "gelu"), approximate=approximate)

    def cast(self, x, dtype: DataType):
        if not isinstance(dtype, DataType):
            raise DefinitionError(f"cast: dtype must be a DataType, got {dtype!r}")
        return self._r("cast", _tv(x, "cast"), dtype=dtype)

    def where(self, cond, a, b):
        return self._r("where", _tv(cond, "where"), a, b)

    def sum(self, x, dims, keepdim: bool = False, dtype: DataType | None = None):
        return self._r("sum", x, dims=_dims(_tv(x, "sum"), dims, "sum"), keepdim=keepdim, dtype=dtype)

    def mean(self, x, dims, keepdim: bool = False, dtype: DataType | None = None):
        return self._r("mean", x, dims=_dims(_tv(x, "mean"), dims, "mean"), keepdim=keepdim, dtype=dtype)

    def amax(self, x, dims, keepdim: bool = False):
        return self._r("amax", x, dims=_dims(_tv(x, "amax"), dims, "amax"), keepdim=keepdim)

    def var_mean(self, x, dims, correction: int = 1, keepdim: bool = False):
        return self._r("var_mean", x, dims=_dims(_tv(x, "var_mean"), dims, "var_mean"),
                       correction=correction, keepdim=keepdim)

    def linear(self, x, w, b=None):
        x, w = _tv(x, "linear"), _tv(w, "linear")
        if w.ndim != 2 or x.ndim < 1 or (x.shape[-1] >= 0 and w.shape[1] >= 0 and x.shape[-1] != w.shape[1]):
            raise DefinitionError(
                f"linear: the in extent of T{x.name} {x._ir.type_str()} (last dim) must match dim 1 of the "
                f"weight T{w.name} {w._ir.type_str()}, which must be 2-D [out, in]")
        if b is not None and (_tv(b, "linear").ndim != 1
                              or (b.shape[0] >= 0 and w.shape[0] >= 0 and b.shape[0] != w.shape[0])):
            raise DefinitionError(f"linear: bias T{b.name} {b._ir.type_str()} must be 1-D [out] with out = "
                                  f"{w.shape[0]} (dim 0 of the weight T{w.name} {w._ir.type_str()})")
        return self._r("linear", x, w, b)

    def matmul(self, a, b):
        return self._r("matmul", _tv(a, "matmul"), _tv(b, "matmul"))

    def reshape(self, x, shape):
        return self._r("reshape", _tv(x, "reshape"), shape=tuple(shape))

    def permute(self, x, dims):
        x = _tv(x, "permute")
        dims = tuple(dims)
        if (not all(isinstance(d, int) and -x.ndim <= d < x.ndim for d in dims)
                or sorted(d % x.ndim for d in dims) != list(range(x.ndim))):
            raise DefinitionError(f"permute: dims {list(dims)} are not a permutation of T{x.name}'s "
                                  f"{x.ndim} dims {x._ir.type_str()}")
        return self._r("permute", x, dims=tuple(d % x.ndim for d in dims))

    def broadcast_in_dim(self, x, shape, broadcast_dims):
        x = _tv(x, "broadcast_in_dim")
        shape, bdims = tuple(shape), tuple(broadcast_dims)
        ok = len(bdims) == x.ndim and list(bdims) == sorted(set(bdims)) and all(0 <= d < len(shape) for d in bdims)
        ok = ok and all(shape[d] in (-1, x.shape[i]) or x.shape[i] == 1 for i, d in enumerate(bdims))
        if not ok:
            raise DefinitionError(
                f"broadcast_in_dim: T{x.name} {x._ir.type_str()} cannot broadcast to {list(shape)} with "
                f"broadcast_dims {list(bdims)} (one increasing output dim per input dim, extents equal or 1)")
        return self._r("broadcast_in_dim", x, shape=shape, broadcast_dims=bdims)

    def squeeze(self, x, dims):
        x = _tv(x, "squeeze")
        dims = _dims(x, dims, "squeeze")
        bad = [d for d in dims if x.shape[d] != 1]
        if bad:
            raise DefinitionError(f"squeeze: dims {bad} of T{x.name} {x._ir.type_str()} are not of extent 1")
        return self._r("squeeze", x, dims=dims)

    def unsqueeze(self, x, dim: int):
        x = _tv(x, "unsqueeze")
        if not -x.ndim - 1 <= dim <= x.ndim:
            raise DefinitionError(f"unsqueeze: dim {dim} is out of range for T{x.name} {x._ir.type_str()}")
        return self._r("unsqueeze", x, dim=dim % (x.ndim + 1))

    def set(self, x):
        return self._r("set", _tv(x, "set"))

    def layer_norm(self, x, normalized_shape, weight=None, bias=None, eps: float = 1e-5):
        x = _tv(x, "layer_norm")
        ns = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        return self._r("layer_norm", x, weight, bias, normalized_shape=ns, eps=eps)

    def softmax(self, x, dim: int):
        x = _tv(x, "softmax")
        return self._r("softmax", x, dim=_dims(x, dim, "softmax")[0])

    def full(self, shape, fill_value, dtype: DataType):
        """A tensor of ``shape`` filled with ``fill_value`` (nvFuser's ``full``)."""
        if any(e < 0 for e in shape):
            raise DefinitionError(f"full: shape {list(shape)} must be concrete")
        return self._r("full", shape=tuple(shape), fill_value=fill_value, dtype=dtype)
