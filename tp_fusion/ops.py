"""The op registry: every op is declared once, here.

An ``OpDef`` holds all that tp_fusion knows of one op: its aten implementation, its shape and dtype
inference, its sharding rule (``tp_fusion.sharding.rules``), its traits, its FLOPs, how its
attributes become local ones, and the front end that ``fd.ops.<name>`` calls (argument checks and
docstring). ``fd.ops`` is generated from this table; the passes, the runtime and the summary ask
an op's traits, never its name. Adding an op is one ``register`` call plus its tests.

Shapes are inferred in Python, so symbolic extents (-1) stay symbolic. Dtypes follow torch: where
torch's promotion decides, the implementation runs once on one-element CPU tensors of the
operands' dtypes and ranks (``_torch_dtype``); ops that need equal dtypes (GEMMs, normalizations)
check it here, as torch would only at run time.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from tp_fusion.errors import DefinitionError, LoweringError
from tp_fusion.ir import Const, ScalarRef, Symbol, SymbolicSize, symbols_of
from tp_fusion.sharding import rules
from tp_fusion.sharding.sharding import PARTIAL_SUM, Partial
from tp_fusion.types import DataType


class Trait(enum.Flag):
    """What kind of op this is; passes and the runtime test these, never names."""

    NONE = 0
    POINTWISE = enum.auto()  # elementwise over broadcast operands
    VIEW = enum.auto()  # the result may be a view of an operand (never reduced in place)
    GEMM = enum.auto()  # a matrix product over a contracted extent K: inputs[0] is the left operand (K last),
    #                     inputs[1] the right one (linear's w[..., out, in], matmul's b, grouped_mm's mat2)
    REDUCTION = enum.auto()
    NORMALIZATION = enum.auto()
    FACTORY = enum.auto()  # creates a tensor from attributes alone
    COLLECTIVE = enum.auto()  # communicates between ranks (lowered from a resharding)
    LOCAL_RESHARD = enum.auto()  # a resharding step that needs no communication
    EPILOGUE = enum.auto()  # unary pointwise that a fused GEMM may apply to its output
    RESHARD = enum.auto()  # ``set``: its output may be sharded otherwise than its input (lowering's job)


@dataclass(frozen=True, slots=True)
class TensorType:
    """What inference knows of a tensor operand: its global shape (-1: symbolic) and dtype."""

    shape: tuple[int, ...]
    dtype: DataType

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __str__(self) -> str:
        return f"{self.dtype.short}[{', '.join('?' if e < 0 else str(e) for e in self.shape)}]"


Operand = TensorType | int | float | bool | complex  # what inference sees: a tensor's type, or a scalar value
NUMBER = (int, float, bool, complex)  # the Python numbers that ops take as operands (and define_scalar as values)
Infer = Callable[[list[Operand], dict], list[TensorType]]
Flops = Callable[[list[tuple[int, ...]], list[tuple[int, ...]]], int]  # (local in shapes, local out shapes)


@dataclass(frozen=True)
class OpDef:
    name: str
    impl: Callable | None  # impl(*operands, **local attrs) -> tensor or tuple; None: run by the runtime
    infer: Infer
    traits: Trait
    rule: rules.Rule | None = None  # sharding rule; None for resharding ops (the table handles them)
    flops: Flops = lambda ins, outs: 0
    localize: Callable[[dict, Localize], dict] | None = None  # global attributes -> local ones
    follow: tuple[int, ...] | None = None  # operands whose sharding the op follows first (None: most sharded)
    num_outputs: int = 1
    front: Callable | None = None  # the fd.ops function (first argument: a Recorder); None: internal op
    # a GEMM or a reduction: how the devices' results combine where a device-parallel reduced axis of the
    # output leaves them pending (``Partial``'s op; nvFuser's rfactor)
    pending: str = "sum"
    weight_out_in: bool = False  # GEMM: the right operand is [out, in] (linear), not [in, out] (matmul)
    bias: int | None = None  # GEMM: the operand position of a bias added to the product (linear's 2), if given
    # the outputs' memory layouts (stride orders, None: row-major) from the operands' (None: row-major
    # or a scalar) and the attributes; None: every output is row-major (nvFuser's allocation domains)
    out_layout: Callable[[list[tuple[int, ...] | None], dict], list[tuple[int, ...] | None]] | None = None
    # whether a CUDA graph cannot capture a call with these operands (dtypes) and attributes (None: it can):
    # a random draw (a replay would repeat an unseeded one; a seeded one's generator refuses capture), or
    # a kernel that reads device values on the host
    uncapturable: Callable[[list, dict], bool] | None = None  # (``operand_types``, attributes)
    # whether a call takes a fresh seed from the unseeded draws' counter (``take_seed``): every rank takes
    # one per call, whether the op runs on it or not, so that every rank's later draws stay alike
    fresh_seed: Callable[[dict], bool] | None = None
    # the op as simpler ops, ``decompose(op, builder)`` (``passes.decompose.Builder``) writing ``op``'s result:
    # what propagation may run instead where the op would gather a dim it normalizes over (None: no such; a
    # recipe that writes nothing does not apply to that op, which stays whole)
    decompose: Callable | None = None
    # the attributes that set values only (a fill value, a bound, a seed), not shapes, dtypes, shardings or
    # any choice of the plan: a scalar input given there is read at every call, so a new value builds no
    # new plan (``compile.per_call_numbers``); the other attributes a scalar input gives are bound per plan
    value_attrs: frozenset[str] = frozenset()

    def has(self, trait: Trait) -> bool:
        return bool(self.traits & trait)

    def capturable(self, ins: list, attrs: dict) -> bool:
        """Whether a CUDA graph can capture a call with these operand types and attributes: not where an
        attribute is a number each call gives (``value_attrs``: a replay would keep the captured call's)."""
        fixed = not symbols_of(tuple(attrs.values()))
        return fixed and (self.uncapturable is None or not self.uncapturable(ins, attrs))


def is_tanh_gelu(kind: str, attrs: dict) -> bool:
    """A tanh-approximated GELU: the one that cuBLASLt's GEMM epilogue computes."""
    return kind == "gelu" and attrs.get("approximate") == "tanh"


def traits(kind: str) -> Trait:
    return OPS[kind].traits


def operand_types(op, tensor: Callable) -> list:
    """What ``infer`` and ``uncapturable`` take of ``op``'s operands: a TensorType per tensor (``tensor(name)``
    gives its IR tensor), a constant's value."""
    return [TensorType(tensor(a).shape, tensor(a).dtype) if isinstance(a, int) else a.value for a in op.inputs]


def is_plain_gemm(op, fusion) -> bool:
    """A GEMM whose right operand is one 2-D matrix (linear's weight, or a 2-D matmul operand), as the
    cuBLAS kernels of fused segments and GEMM epilogues run it: not a weight with leading dims
    (nvFuser's logical split) nor grouped_mm's stack of matrices."""
    return OPS[op.kind].has(Trait.GEMM) and fusion.tensor(op.inputs[1]).ndim == 2


def is_biased_gemm(op) -> bool:
    """A GEMM given a bias operand (linear's third; grouped_mm's third operand is its offsets, no bias)."""
    od = OPS[op.kind]
    return od.has(Trait.GEMM) and od.bias is not None and len(op.inputs) > od.bias


@dataclass(frozen=True)
class Localize:
    """What an op's ``localize`` may need: global and local operand shapes (None for scalars), the local
    output shape, the device it runs on, and ``in_indices(i, d)``: the global indices along dim ``d`` of
    operand ``i`` that this rank holds."""

    in_global: list[tuple[int, ...] | None]
    in_local: list[tuple[int, ...] | None]
    out_local: tuple[int, ...]
    device: torch.device
    in_indices: Callable[[int, int], torch.Tensor]


OPS: dict[str, OpDef] = {}
# Front ends that record another op (nvFuser spellings): ``fd.ops`` offers them beside the OPS fronts.
# Their names may be taken by internal ops (``broadcast`` is also the move between meshes).
SPELLINGS: dict[str, Callable] = {}


def register(name: str, **kw) -> OpDef:
    OPS[name] = op = OpDef(name, **kw)
    return op


def opdef(kind: str) -> OpDef:
    try:
        return OPS[kind]
    except KeyError:
        raise DefinitionError(f"unknown op {kind!r}; the ops are: {', '.join(user_ops())}") from None


def fronts() -> dict[str, Callable]:
    """What ``fd.ops`` offers: name -> front end (its first argument is a Recorder)."""
    out = {name: op.front for name, op in OPS.items() if op.front is not None}
    return out | SPELLINGS


def user_ops() -> list[str]:
    """The ops ``fd.ops`` offers, sorted."""
    return sorted(fronts())


# --- inference helpers ----------------------------------------------------------------------------


def describe_value(x) -> str:
    """How an error names a value given where a TensorView or a number goes: a tensor or an array by its
    type and shape (its repr would list every element), anything else by its repr."""
    if isinstance(x, torch.Tensor):
        return f"a torch.Tensor of shape {list(x.shape)} (define it with fd.define_tensor and pass it to execute)"
    if getattr(x, "ndim", 0):
        return f"a {type(x).__module__}.{type(x).__qualname__} of shape {list(x.shape)}"
    return repr(x)


def python_scalar(x):
    """A numpy scalar (``np.float32(2)``, ``np.int64(3)``) as the Python number it holds, so that ops take it
    as they take that number; anything else as it is."""
    return x.item() if isinstance(x, np.generic) else x


def _fail(op: str, msg: str):
    """A front end's error: ``op: msg``."""
    raise DefinitionError(f"{op}: {msg}")


def _bad(msg: str):
    """An inference error; the recorder prefixes the op and its operands."""
    raise DefinitionError(msg)


def _tensors(args: list[Operand]) -> list[TensorType]:
    return [a for a in args if isinstance(a, TensorType)]


def broadcast_shapes(shapes: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
    """Torch's broadcasting (aligned from the right), with -1 for a symbolic extent: a symbol
    against a concrete extent n > 1 gives n (checked again at execute), two symbols give a symbol."""
    n = max((len(s) for s in shapes), default=0)
    out = []
    for i in range(n):
        ext = [s[len(s) - n + i] for s in shapes if len(s) - n + i >= 0]
        concrete = {e for e in ext if e not in (1, -1)}
        if len(concrete) > 1:
            _bad(f"shapes {[list(s) for s in shapes]} do not broadcast: dim {i - n} has extents "
                      f"{sorted(concrete)}")
        out.append(concrete.pop() if concrete else (-1 if -1 in ext else 1))
    return tuple(out)


def _probe_operand(a: Operand):
    """A one-element CPU tensor standing for a tensor operand. Not a meta tensor: meta kernels skip the
    dtype checks of the real ones (``abs``/``relu`` of bool, bool minus a number)."""
    if isinstance(a, TensorType):
        return torch.ones((1,) * a.ndim, dtype=a.dtype.torch)
    return a


def _torch_dtype(impl: Callable, args: list[Operand], attrs: dict) -> list[DataType]:
    """The output dtypes torch gives ``impl`` for operands of these dtypes and ranks: one run on
    one-element tensors (torch's own promotion, and its dtype errors), cached by what decides
    it (a scalar's type, not its value; a tensor's dtype and rank)."""
    key = tuple((a.dtype, a.ndim) if isinstance(a, TensorType) else type(a) for a in args)
    attrs = {k: _probe_attribute(v) for k, v in attrs.items()}
    return list(_dtype_of(impl, key, tuple(args), tuple(attrs.items())))


def _probe_attribute(value):
    """A number of a ScalarRef's type standing for it where torch decides a dtype (its value is bound later)."""
    if isinstance(value, ScalarRef):
        return value.dtype.python_type(1)
    return value


_DTYPE_CACHE: dict[tuple, tuple[DataType, ...]] = {}


def _dtype_of(impl, key, args, attrs) -> tuple[DataType, ...]:
    cache_key = (impl, key, attrs)
    if cache_key not in _DTYPE_CACHE:
        try:
            with warnings.catch_warnings():  # about the one-element values (var_mean's degrees of freedom)
                warnings.simplefilter("ignore")
                out = impl(*[_probe_operand(a) for a in args], **dict(attrs))
        except (RuntimeError, TypeError, ValueError, IndexError) as e:
            _bad(f"torch rejects operands {', '.join(map(str, args))}: {str(e).splitlines()[0]}")
        outs = out if isinstance(out, tuple) else (out,)
        try:
            _DTYPE_CACHE[cache_key] = tuple(DataType.from_torch(o.dtype) for o in outs)
        except ValueError as e:
            _bad(str(e))
    return _DTYPE_CACHE[cache_key]


def _same_dtype(args: list[Operand]) -> DataType:
    """GEMMs and normalizations take operands of one real dtype (torch raises at run time otherwise; tp_fusion's
    GEMM kernels and decompositions are real)."""
    dtypes = {a.dtype for a in _tensors(args)}
    if len(dtypes) > 1:
        _bad(f"operands {', '.join(map(str, _tensors(args)))} have different dtypes; torch needs one "
                  "dtype here: cast them first")
    if any(dt.is_complex for dt in dtypes):
        _bad(f"operands {', '.join(map(str, _tensors(args)))} are complex; tp_fusion's GEMMs and normalizations take "
             "real dtypes only (compute on fd.ops.real and fd.ops.imag)")
    return dtypes.pop()


def _pointwise_infer(impl: Callable) -> Infer:
    def infer(args, attrs):
        shape = broadcast_shapes([a.shape for a in _tensors(args)])
        return [TensorType(shape, dt) for dt in _torch_dtype(impl, args, attrs)]
    return infer


def _reduced_shape(shape, dims, keepdim) -> tuple[int, ...]:
    return tuple(1 if d in dims else e for d, e in enumerate(shape) if keepdim or d not in dims)


def _reduction_infer(impl: Callable) -> Infer:
    def infer(args, attrs):
        (x,) = args
        shape = _reduced_shape(x.shape, attrs["dims"], attrs.get("keepdim", False))
        return [TensorType(shape, dt) for dt in _torch_dtype(impl, args, attrs)]
    return infer


def _same_as_input(args, attrs):
    return [args[0]]


# --- FLOPs (on local shapes) ----------------------------------------------------------------------


def _flops_output(ins, outs) -> int:
    return math.prod(outs[0])


def _flops_input(ins, outs) -> int:
    return math.prod(ins[0])


def _flops_gemm(ins, outs) -> int:
    return 2 * math.prod(outs[0]) * ins[0][-1]


# --- front-end helpers ----------------------------------------------------------------------------


class Recorder:
    """What an op's front end gets: ``rec(*operands, **attrs)`` records this op, ``rec.other(kind, ...)``
    another one; ``rec.tv(x)`` checks that ``x`` is a TensorView of this fusion."""

    def __init__(self, fd, kind: str):
        self._fd, self.kind = fd, kind

    def __call__(self, *operands, **attrs):
        return self._fd._record(self.kind, operands, **attrs)

    def other(self, kind: str, *operands, **attrs):
        return self._fd._record(kind, operands, **attrs)

    def argument(self, value):
        """An argument of ``fd.ops.<op>`` as the front end takes it: a numpy scalar as its Python number, a
        symbolic size (``fd.ops.size``) given alone as the ``Scalar`` of its value (an operand or a number that
        compiling binds); a list keeps its sizes, as extents."""
        if isinstance(value, SymbolicSize):
            return self._fd._size_scalar(value)
        return python_scalar(value)

    def tv(self, x, what: str = "operand"):
        from tp_fusion.fusion_definition import TensorView

        if not isinstance(x, TensorView):
            _fail(self.kind, f"expected a TensorView for {what}, got {describe_value(x)}")
        self._fd._check_own(x, self.kind)
        return x

    def flag(self, value, what: str) -> bool:
        """``value``, checked to be a bool (``keepdim="no"`` would be taken as True)."""
        if not isinstance(value, bool):
            _fail(self.kind, f"{what} must be True or False, got {value!r}")
        return value

    def dims(self, x, dims, what: str = "dims") -> tuple[int, ...]:
        """``dims`` (an int or a sequence) normalized to sorted, non-negative, distinct dims of ``x``."""
        if not isinstance(dims, (int, list, tuple)):
            _fail(self.kind, f"{what} must be an int or a list of ints, got {dims!r}")
        dims = (dims,) if isinstance(dims, int) else tuple(dims)
        n = x.ndim
        for d in dims:
            if not isinstance(d, int) or isinstance(d, bool):
                _fail(self.kind, f"{what} must be an int or a list of ints, got {dims!r}")
            if not -n <= d < n:
                _fail(self.kind, f"dim {d!r} is out of range for T{x.name} {x._ir.type_str()}")
        out = tuple(sorted({d % n for d in dims}))
        if len(out) != len(dims):
            _fail(self.kind, f"{what} {list(dims)} repeat a dim of T{x.name}")
        return out

    def dim(self, x, dim, what: str = "dim") -> int:
        """``dim``, one int, as a non-negative dim of ``x``."""
        if not isinstance(dim, int) or isinstance(dim, bool):
            _fail(self.kind, f"{what} must be an int, got {dim!r}")
        return self.dims(x, dim, what)[0]

    def dtype(self, dtype, what: str = "dtype") -> DataType:
        return tensor_dtype(self.kind, dtype, what)


def tensor_dtype(op: str, dtype, what: str = "dtype") -> DataType:
    """``dtype`` checked to be a tensor's element type: a DataType other than Null (nvFuser's "no dtype",
    which a tensor cannot have)."""
    if dtype is DataType.Null:
        _fail(op, f"{what} must be a DataType other than Null (e.g. DataType.Float), got {dtype!r}")
    return data_type(op, dtype, what)


def data_type(op: str, dtype, what: str = "dtype") -> DataType:
    """``dtype`` checked to be a DataType; a torch dtype is refused naming the DataType to pass instead."""
    if not isinstance(dtype, DataType):
        hint = ""
        if isinstance(dtype, torch.dtype):
            try:
                hint = f"; for a torch dtype, DataType.from_torch({dtype}) is {DataType.from_torch(dtype)}"
            except ValueError:
                pass
        _fail(op, f"{what} must be a DataType (e.g. DataType.Float), got {dtype!r}{hint}")
    return dtype


def _attribute(value):
    """A number given to an op where it takes one: a ``define_scalar`` constant as its value, a symbolic
    ``Scalar`` as the ScalarRef that compiling binds; anything else as it is."""
    from tp_fusion.fusion_definition import Scalar

    if isinstance(value, Const):
        return value.value
    return ScalarRef(value.name, value.dtype) if isinstance(value, Scalar) else value


def _sequence(values) -> tuple | None:
    """``values`` as a tuple of ``_attribute``s; None if it is no list or tuple."""
    if not isinstance(values, (list, tuple)):
        return None
    return tuple(map(_attribute, values))


def _is_integral(value) -> bool:
    """An int (not a bool), or a symbol of one (a symbolic size, a scalar of an integer dtype)."""
    if isinstance(value, ScalarRef):
        return value.dtype in (DataType.Int, DataType.Int32)
    return isinstance(value, SymbolicSize) or (isinstance(value, int) and not isinstance(value, bool))


def _int_list(op: str, values, what: str) -> tuple[int, ...]:
    out = _sequence(values)
    if out is None or not all(isinstance(v, int) and not isinstance(v, bool) for v in out):
        _fail(op, f"{what} must be a list of ints, got {values!r}")
    return out


def _extents(op: str, values, what: str) -> tuple:
    """Ints and symbols (``fd.ops.size`` scalars, ``Scalar``s: bound as integers, whole numbers, as nvFuser's
    extents), as a tuple."""
    out = _sequence(values)
    if out is None or not all(_is_integral(v) or (isinstance(v, ScalarRef) and v.dtype.is_floating) for v in out):
        _fail(op, f"{what} must be a list of ints, fd.ops.size scalars or scalars, got {values!r}")
    return tuple(ScalarRef(v.tensor, DataType.Int) if isinstance(v, ScalarRef) else v for v in out)


def _concrete_extents(op: str, values) -> tuple:
    """A factory's shape: ``_extents`` whose ints are >= 0 (no -1: nothing to take an extent from)."""
    shape = _extents(op, values, "shape")
    if any(_is_number(e) and e < 0 for e in shape):
        _fail(op, f"shape {list(shape)} must be concrete (extents >= 0, or symbols of them)")
    return shape


def _target_shape(op: str, shape: tuple) -> tuple:
    """``shape`` of a reshape or a broadcast, checked: each int extent is >= 0, or -1 (inferred or kept)."""
    if any(isinstance(e, int) and e < -1 for e in shape):
        _fail(op, f"shape {list(shape)} has a negative extent; an extent is >= 0, or -1 to infer or keep it")
    return shape


def _known(values) -> tuple[int, ...]:
    """``values`` with each symbol as -1 (not known before execute)."""
    return tuple(-1 if isinstance(v, Symbol) else v for v in values)


# --- pointwise ------------------------------------------------------------------------------------


def _scalar(value, dtype: torch.dtype) -> torch.Tensor:
    """A Python number as a 0-d CPU tensor that behaves in ``fn(tensor, value)`` as the number itself
    would in torch, given their result dtype ``dtype`` (``torch.result_type``): a float keeps float32
    precision or more (a 0-d CPU tensor enters CUDA kernels as a scalar, in their compute type)."""
    if dtype.is_floating_point:
        dtype = torch.promote_types(dtype, torch.float32)
    return torch.tensor(value, dtype=dtype)


def _binary(fn):
    def impl(a, b):
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            return fn(a, b)
        want = torch.result_type(a, b)  # torch's dtype, the number taken as a number
        if isinstance(a, torch.Tensor):
            b = _scalar(b, want)
        else:
            a = _scalar(a, want)
        out = fn(a, b)
        # A 0-d tensor meets the number's 0-d float32 tensor as an equal (bf16[] * 3.0 would come out
        # float32): round the result to torch's dtype, as torch rounds its float32 math.
        return out.to(want) if out.dtype.is_floating_point and want.is_floating_point and out.dtype != want else out
    return impl


def on_broadcast_base(impl: Callable, operands: list, attrs: dict):
    """``impl(*operands, **attrs)`` for a pointwise op, computed once along the dims where every tensor
    operand is a broadcast (extent 1, or stride 0: an expanded broadcast) and expanded back over them, as
    nvFuser keeps such a dim a broadcast in the result. Run elementwise, aten would write every element: a
    reciprocal of a [b, h, s, 1] statistic expanded to [b, h, s, s] would materialize b*h*s*s values where
    b*h*s differ. The values are the same (a pointwise op reads each element of its operands alone). It
    runs on every pointwise step, so it reads shapes and strides as tuples (torch.broadcast_shapes costs
    tens of microseconds a call)."""
    tensors = [(x.shape, x.stride()) for x in operands if isinstance(x, torch.Tensor) and x.dim()]
    if not any(0 in stride for _, stride in tensors):
        return impl(*operands, **attrs)
    nd = max(len(shape) for shape, _ in tensors)
    shape, dims = [1] * nd, []
    for d in range(nd):
        every = True  # whether each operand with more than one element along d reads one of them (stride 0)
        for x_shape, x_stride in tensors:
            e = d - nd + len(x_shape)
            if e >= 0 and x_shape[e] != 1:
                shape[d] = x_shape[e]
                every = every and x_stride[e] == 0
        if every and shape[d] > 1:
            dims.append(d)
    if not dims:
        return impl(*operands, **attrs)

    def once(x):
        if not isinstance(x, torch.Tensor) or not x.dim():
            return x
        lead = nd - x.dim()
        for d in dims:
            if d >= lead and x.shape[d - lead] > 1:
                x = x.narrow(d - lead, 0, 1)
        return x
    out = impl(*[once(x) for x in operands], **attrs)
    return tuple(o.expand(shape) for o in out) if isinstance(out, tuple) else out.expand(shape)


def _is_scalar(x) -> bool:
    return isinstance(x, (Const, *NUMBER))


def _scalar_dtype(x: Const | int | float | bool | complex) -> DataType:
    """The dtype of nvFuser's scalar Val: a define_scalar's, else the number's as Python computes
    (``DataType.of_number``: a float is a Double, a complex a ComplexDouble)."""
    x = x if isinstance(x, Const) else Const(x)
    return x.dtype if x.dtype is not None else DataType.of_number(x.value)


def _folded(kind: str, operands, typed: bool = False, **attrs) -> Const:
    """nvFuser's arithmetic on scalar Vals (numbers and define_scalars), done now: op ``kind`` on 0-d tensors of
    the operands (of ``_scalar_dtype``). The result is typed where an operand is (torch's promotion of 0-d
    tensors), or ``typed``."""
    values = [a if isinstance(a, Const) else Const(a) for a in operands]
    as_tensors = [torch.tensor(v.value, dtype=_scalar_dtype(v).torch) for v in values]
    try:
        out = OPS[kind].impl(*as_tensors, **attrs)
    except (RuntimeError, TypeError) as e:
        _fail(kind, f"torch rejects the scalars {[v.value for v in values]}: {str(e).splitlines()[0]}")
    typed = typed or any(v.dtype is not None for v in values)
    return Const(out.item(), DataType.from_torch(out.dtype) if typed else None)


def _unary_front(name: str):
    def front(rec, x):
        return _folded(name, [x]) if _is_scalar(x) else rec(rec.tv(x, "x"))
    front.__doc__ = f"``torch.{name}(x)``, elementwise; on a scalar (a number or ``define_scalar``), a scalar."
    return front


def _pointwise_operands(rec, *operands, **attrs):
    """Records a pointwise op whose operands are TensorViews or numbers; of numbers (and define_scalars) alone,
    a scalar (``_folded``)."""
    from tp_fusion.fusion_definition import TensorView

    if any(isinstance(a, TensorView) for a in operands):
        return rec(*operands, **attrs)
    if not all(map(_is_scalar, operands)):
        _fail(rec.kind, f"operands must be TensorViews or numbers, got {', '.join(map(describe_value, operands))}")
    return _folded(rec.kind, operands, **attrs)


def _binary_front(name: str):
    def front(rec, a, b):
        return _pointwise_operands(rec, a, b)
    front.__doc__ = f"``torch.{name}(a, b)``, elementwise with torch's broadcasting; a or b may be a number."
    return front


_UNARY = {name: getattr(torch, name) for name in (
    "neg", "abs", "exp", "log", "tanh", "sigmoid", "relu", "sqrt", "rsqrt", "reciprocal",
    # nvFuser's other unary ops, with torch's semantics and dtypes
    "acos", "acosh", "asin", "asinh", "atan", "atanh", "cos", "cosh", "sin", "sinh", "tan",
    "exp2", "expm1", "log10", "log1p", "log2", "erf", "erfc", "erfinv", "lgamma",
    "ceil", "floor", "frac", "round", "trunc", "sign", "signbit",
    "isfinite", "isinf", "isnan", "isneginf", "isposinf", "logical_not", "bitwise_not",
    "real", "imag")} | {"silu": F.silu}
_EPILOGUE = ("neg", "tanh", "sigmoid", "relu", "silu")  # cheap enough to run on a fused GEMM's output
_VIEWS = ("real", "imag")  # torch's real and imag of a complex tensor are views of it
for _name, _fn in _UNARY.items():
    register(_name, impl=_fn, infer=_pointwise_infer(_fn),
             traits=Trait.POINTWISE | (Trait.EPILOGUE if _name in _EPILOGUE else Trait.NONE) |
             (Trait.VIEW if _name in _VIEWS else Trait.NONE),
             rule=rules.pointwise(rules.linear_in_first if _name in ("neg", *_VIEWS) else None),
             flops=_flops_output, front=_unary_front(_name))
OPS["real"].front.__doc__ = ("``torch.real(x)``: the real part of a complex ``x``, of the matching real dtype "
                             "(ComplexFloat -> Float, ComplexDouble -> Double); a real ``x`` itself.")
OPS["imag"].front.__doc__ = ("``torch.imag(x)``: the imaginary part of a complex ``x``, of the matching real dtype "
                             "(ComplexFloat -> Float, ComplexDouble -> Double); torch refuses a real ``x``.")


def _logical_right_shift(x, shift):
    """nvFuser's ``logical_right_shift(a, b)``: ``a >> b`` filling with zero bits, not the sign bit (an unsigned
    shift of the bits of the result's integer dtype; torch has no such op); a shift of the width or more gives 0.
    a or b may be a number."""
    out = torch.bitwise_right_shift(x, shift)
    if not out.dtype.is_signed:
        return out
    bits = torch.iinfo(out.dtype).bits
    s = shift.to(out.dtype).clamp(0, bits)
    one = torch.ones((), dtype=out.dtype, device=out.device)
    sign_fill = torch.bitwise_left_shift(torch.bitwise_left_shift(one, s) - 1, bits - s)  # the top s bits
    return torch.where(x < 0, out ^ sign_fill, out)


_BINARY_PARTIAL = {"add": rules.linear_in_all, "sub": rules.linear_in_all, "mul": rules.linear_in_each,
                   "div": rules.linear_in_first, "truediv": rules.linear_in_first}
# truediv is nvFuser's name of torch's div; mod is nvFuser's C remainder (the sign of the dividend), torch's fmod.
_BINARY = {name: getattr(torch, name) for name in (
    "add", "sub", "mul", "div", "pow", "maximum", "minimum", "atan2", "fmod", "remainder", "nextafter", "gcd",
    "logical_and", "logical_or", "logical_xor", "bitwise_and", "bitwise_or", "bitwise_xor",
    "bitwise_left_shift", "bitwise_right_shift")} | {"truediv": torch.true_divide, "mod": torch.fmod,
                                                     "logical_right_shift": _logical_right_shift}
_BINARY_PENDING = {"maximum": Partial("max"), "minimum": Partial("min")}  # their own reduction pending, not a sum
for _name, _fn in _BINARY.items():
    _impl = _binary(_fn)
    _partial = rules.linear_in_all if _name in _BINARY_PENDING else _BINARY_PARTIAL.get(_name)
    register(_name, impl=_impl, infer=_pointwise_infer(_impl), traits=Trait.POINTWISE,
             rule=rules.pointwise(_partial, _BINARY_PENDING.get(_name, PARTIAL_SUM)), flops=_flops_output,
             front=_binary_front(_name))
OPS["logical_right_shift"].front.__doc__ = _logical_right_shift.__doc__


for _name in ("lt", "le", "gt", "ge", "eq", "ne"):
    _impl = _binary(getattr(torch, _name))
    register(_name, impl=_impl, infer=_pointwise_infer(_impl), traits=Trait.POINTWISE, rule=rules.pointwise(),
             flops=_flops_output, front=_binary_front(_name))


def _pow_front(rec, a, b):
    """``torch.pow(a, b)``, elementwise; a or b may be a number. Integer tensors to negative integer
    powers are rejected, as torch rejects them."""
    from tp_fusion.fusion_definition import TensorView

    if isinstance(a, TensorView) and not a.dtype.is_floating and isinstance(b, int) and b < 0:
        _fail("pow", f"T{a.name} {a._ir.type_str()} is an integer tensor and {b} a negative integer power; "
                     "torch does not allow integers to negative integer powers: cast it to a float dtype first")
    return _binary_front("pow")(rec, a, b)


OPS["pow"] = dataclasses.replace(OPS["pow"], front=_pow_front)


def _gelu(x, approximate="none"):
    return F.gelu(x, approximate=approximate)


def _gelu_front(rec, x, approximate: str = "none"):
    """``F.gelu(x, approximate=...)``; ``approximate`` is ``"none"`` or ``"tanh"``."""
    if approximate not in ("none", "tanh"):
        _fail("gelu", f"approximate must be 'none' or 'tanh', got {approximate!r}")
    return rec(rec.tv(x, "x"), approximate=approximate)


register("gelu", impl=_gelu, infer=_pointwise_infer(_gelu), traits=Trait.POINTWISE | Trait.EPILOGUE,
         rule=rules.pointwise(), flops=_flops_output, front=_gelu_front)


def _gelu_backward(grad, x, approximate="none"):
    if grad.shape != x.shape:  # aten's CPU kernel (oneDNN) fails on a broadcast grad: expand it first
        grad, x = torch.broadcast_tensors(grad, x)
    return torch.ops.aten.gelu_backward(grad, x, approximate=approximate)


def _gelu_backward_front(rec, grad, x, approximate: str = "none"):
    """``torch.ops.aten.gelu_backward(grad, x, approximate=...)``: the gradient of ``gelu(x, approximate)``
    given the gradient ``grad`` of its output (``grad * gelu'(x)``, one aten kernel); ``approximate``
    is ``"none"`` or ``"tanh"``. Elementwise with torch's broadcasting; linear in ``grad``."""
    if approximate not in ("none", "tanh"):
        _fail("gelu_backward", f"approximate must be 'none' or 'tanh', got {approximate!r}")
    return rec(rec.tv(grad, "grad"), rec.tv(x, "x"), approximate=approximate)


register("gelu_backward", impl=_gelu_backward, infer=_pointwise_infer(_gelu_backward), traits=Trait.POINTWISE,
         rule=rules.pointwise(rules.linear_in_first), flops=_flops_output, front=_gelu_backward_front)


def _cast(x, dtype):
    return x.to(dtype.torch)


def _cast_front(rec, x, dtype):
    """``x`` converted to ``dtype`` (a DataType); a number or define_scalar, a define_scalar of ``dtype``."""
    if _is_scalar(x):
        return _folded("cast", [x], typed=True, dtype=rec.dtype(dtype))
    return rec(rec.tv(x, "x"), dtype=rec.dtype(dtype))


def _cast_partial(op, fusion) -> tuple[frozenset[int], ...]:
    """A pending sum passes through a cast that loses nothing (to a floating dtype that holds the
    source's values: f32 -> f64, bf16 -> f32): a narrowing cast runs after the sum, so the sum is
    rounded once, as torch's is (summing bf16 partials of an f32 GEMM differed by up to an ulp)."""
    source, target = fusion.tensor(op.inputs[0]).dtype.torch, op.attr("dtype").torch
    lossless = (target.is_floating_point or target.is_complex) and torch.promote_types(source, target) == target
    return (frozenset({0}),) if lossless else ()


register("cast", impl=_cast, infer=lambda args, attrs: [TensorType(args[0].shape, attrs["dtype"])],
         traits=Trait.POINTWISE | Trait.EPILOGUE, rule=rules.pointwise(_cast_partial), flops=_flops_output,
         front=_cast_front)


def _where(c, a, b, dtype=None):
    if dtype is not None:  # a and b are both scalars, one at least a define_scalar: the result is of ``dtype``
        a, b = (torch.tensor(v, dtype=dtype.torch, device=c.device) for v in (a, b))
    return torch.where(c, a, b)


def _where_front(rec, cond, a, b):
    """``torch.where(cond, a, b)``: ``a`` where ``cond`` holds, else ``b``; a or b may be a number. Where both
    are scalars, a ``define_scalar`` counts as a 0-d tensor of its dtype, as nvFuser's scalars do (two
    ``define_scalar(3.0)`` give a Double tensor, two ``3.0`` torch's Float)."""
    cond = rec.tv(cond, "cond")
    if _is_scalar(a) and _is_scalar(b) and any(isinstance(v, Const) for v in (a, b)):
        as_torch = [torch.tensor(v.value, dtype=v.dtype.torch) if isinstance(v, Const) and v.dtype is not None
                    else v.value if isinstance(v, Const) else v for v in (a, b)]
        return rec(cond, a, b, dtype=DataType.from_torch(torch.result_type(*as_torch)))
    return rec(cond, a, b)


register("where", impl=_where, infer=_pointwise_infer(_where), traits=Trait.POINTWISE,
         rule=rules.pointwise(rules.linear_in_choices), flops=_flops_output, front=_where_front)


def _as_tensor_like(value, like: torch.Tensor) -> torch.Tensor:
    """A Python number as a 0-d tensor of ``like``'s dtype and device, for torch ops that take no number
    where nvFuser takes one (lerp's start and end, addcmul's tensors)."""
    return value if isinstance(value, torch.Tensor) else torch.tensor(value, dtype=like.dtype, device=like.device)


def _lerp(start, end, weight):
    like = next(t for t in (start, end, weight) if isinstance(t, torch.Tensor))
    return torch.lerp(_as_tensor_like(start, like), _as_tensor_like(end, like), weight)


def _lerp_front(rec, start, end, weight):
    """``torch.lerp(start, end, weight)``: ``start + weight * (end - start)``, elementwise with torch's
    broadcasting; any operand may be a number (start and end need one dtype, as in torch)."""
    return _pointwise_operands(rec, start, end, weight)


def _addcmul(x, t1, t2, value=1):
    like = next(t for t in (x, t1, t2) if isinstance(t, torch.Tensor))
    return torch.addcmul(*(_as_tensor_like(t, like) for t in (x, t1, t2)), value=value)


def _addcmul_front(rec, x, tensor1, tensor2, value=1):
    """``torch.addcmul(x, tensor1, tensor2, value=value)``: ``x + value * tensor1 * tensor2``,
    elementwise with torch's broadcasting; an operand may be a number, ``value`` is a number."""
    return _pointwise_operands(rec, x, tensor1, tensor2, value=_number("addcmul", value, "value"))


def _clamp(x, min=None, max=None):
    return torch.clamp(x, min, max)


def _clamp_front(rec, x, min=None, max=None):
    """``torch.clamp(x, min, max)``: ``min`` and ``max`` are numbers or define_scalars (at least one; for
    tensor bounds use ``maximum``/``minimum``)."""
    bounds = {k: None if v is None else _number("clamp", v, k) for k, v in (("min", min), ("max", max))}
    if bounds["min"] is None and bounds["max"] is None:
        _fail("clamp", "give min, max or both")
    return rec(rec.tv(x, "x"), **bounds)


def _threshold(x, threshold, value):
    return F.threshold(x, threshold, value)


def _threshold_front(rec, x, threshold, value):
    """``F.threshold(x, threshold, value)``: ``x`` where ``x > threshold``, else ``value`` (numbers)."""
    return rec(rec.tv(x, "x"), threshold=_number("threshold", threshold, "threshold"),
               value=_number("threshold", value, "value"))


for _name, _impl, _front, _values in (("lerp", _lerp, _lerp_front, ()),
                                      ("addcmul", _addcmul, _addcmul_front, ("value",)),
                                      ("clamp", _clamp, _clamp_front, ("min", "max")),
                                      ("threshold", _threshold, _threshold_front, ("threshold", "value"))):
    register(_name, impl=_impl, infer=_pointwise_infer(_impl), traits=Trait.POINTWISE, rule=rules.pointwise(),
             flops=_flops_output, front=_front, value_attrs=frozenset(_values))


def _set_front(rec, x):
    """An explicit copy of ``x``: the place to ask for a resharding (give the result another sharding)."""
    return rec(rec.tv(x, "x"))


register("set", impl=torch.clone, infer=_same_as_input, traits=Trait.POINTWISE | Trait.RESHARD,
         rule=rules.pointwise(rules.linear_in_first), front=_set_front)


def _segment_set_front(rec, x):
    """nvFuser's segmentation hint: here a copy of ``x``, as ``set``."""
    return _set_front(Recorder(rec._fd, "set"), x)


SPELLINGS["segment_set"] = _segment_set_front

# --- reductions -----------------------------------------------------------------------------------


def _sum(x, dims, keepdim=False, dtype=None):
    return torch.sum(x, dim=dims, keepdim=keepdim, dtype=dtype.torch if dtype else None)


def _mean(x, dims, keepdim=False, dtype=None, count=None):
    """``count`` is the GLOBAL number of reduced elements, so a mean over a sharded dim is a partial
    sum of local sums divided by the global count."""
    local = math.prod(x.shape[d] for d in dims)
    if count is None or count == local:
        return torch.mean(x, dim=dims, keepdim=keepdim, dtype=dtype.torch if dtype else None)
    return torch.sum(x, dim=dims, keepdim=keepdim, dtype=dtype.torch if dtype else None) / count


def _amax(x, dims, keepdim=False):
    return torch.amax(x, dim=dims, keepdim=keepdim)


def _amin(x, dims, keepdim=False):
    return torch.amin(x, dim=dims, keepdim=keepdim)


def _prod(x, dims, keepdim=False, dtype=None):
    """``torch.prod`` over several dims (torch's takes one), the last first so the others keep their place."""
    for d in sorted(dims, reverse=True):
        x = torch.prod(x, d, keepdim=keepdim, dtype=dtype.torch if dtype else None)
        dtype = None
    return x


def _var(x, dims, correction=1, keepdim=False):
    return torch.var(x, dim=dims, correction=correction, keepdim=keepdim)


def _var_mean(x, dims, correction=1, keepdim=False):
    return torch.var_mean(x, dim=dims, correction=correction, keepdim=keepdim)


def _reduced_dims(rec, x, dims) -> tuple[int, ...]:
    """``dims`` (an int, a sequence, or None for every dim) as sorted non-negative dims of ``x``; an
    empty sequence is every dim too, as in torch (nvFuser reduces over none)."""
    return rec.dims(x, dims) if isinstance(dims, int) or dims else tuple(range(x.ndim))


def _reduction(rec, x, dims, keepdim, **attrs):
    """Records a reduction of ``x`` over ``dims`` (``_reduced_dims``)."""
    x = rec.tv(x, "x")
    return rec(x, dims=_reduced_dims(rec, x, dims), keepdim=rec.flag(keepdim, "keepdim"), **attrs)


def _nvfuser_overloads(rec, dims, dim, dtype):
    """nvFuser's reduction overloads: ``(x, dtype)`` reduces every dim, ``dim=`` spells ``dims``."""
    if isinstance(dims, DataType):
        if dtype is not None:
            _fail(rec.kind, f"dtype given twice ({dims!r} and {dtype!r})")
        dims, dtype = None, dims
    if dim is not None:
        if dims is not None:
            _fail(rec.kind, "give dims or dim, not both")
        dims = dim
    return dims, dtype


def _sum_front(rec, x, dims=None, keepdim: bool = False, dtype: DataType | None = None, *, dim=None):
    """``torch.sum(x, dims, keepdim, dtype)``; ``dims`` (or ``dim``) an int, a list, or None (every dim);
    ``sum(x, dtype)`` as in nvFuser. A sum over a sharded dim leaves a partial result."""
    dims, dtype = _nvfuser_overloads(rec, dims, dim, dtype)
    return _reduction(rec, x, dims, keepdim, dtype=None if dtype in (None, DataType.Null) else rec.dtype(dtype))


def _mean_front(rec, x, dims=None, keepdim: bool = False, dtype: DataType | None = None, *, dim=None):
    """``torch.mean(x, dims, keepdim, dtype)``; ``dims`` (or ``dim``) an int, a list, or None (every dim)."""
    return _sum_front(rec, x, dims, keepdim, dtype, dim=dim)


def _prod_front(rec, x, dims=None, keepdim: bool = False, dtype: DataType | None = None, *, dim=None):
    """The product over ``dims`` (or ``dim``: an int, a list, or None: every dim), as ``torch.prod`` one
    dim after another; ``dtype`` as torch's; ``prod(x, dtype)`` as in nvFuser."""
    return _sum_front(rec, x, dims, keepdim, dtype, dim=dim)


def _extremum_front(torch_name: str):
    def front(rec, x, dims=None, keepdim: bool = False, dtype: DataType | None = None, *, dim=None):
        x = rec.tv(x, "x")
        dims, dtype = _nvfuser_overloads(rec, dims, dim, dtype)
        if dtype not in (None, DataType.Null, x.dtype):
            _fail(rec.kind, f"the result has the dtype of T{x.name} {x._ir.type_str()}; dtype {dtype!r} "
                            "cannot change it (cast before or after)")
        return _reduction(rec, x, dims, keepdim)
    front.__doc__ = (f"``torch.{torch_name}(x, dims, keepdim)``; ``dims`` (or ``dim``) an int, a list, or None (every "
                     "dim). ``dtype`` is accepted for nvFuser's signature and must be None or x's dtype.")
    return front


def _extremum_infer(torch_name: str, impl: Callable) -> Infer:
    """A reduction's inference that refuses a reduced dim of extent 0 (torch has no max of no elements):
    when recorded, and for a symbolic extent with the other checks of the inputs' sizes at execute."""
    reduction = _reduction_infer(impl)

    def infer(args, attrs):
        empty = [d for d in attrs["dims"] if args[0].shape[d] == 0]
        if empty:
            _bad(f"dim {empty[0]} has extent 0: torch has no {torch_name} of no elements")
        return reduction(args, attrs)
    return infer


def _var_front(rec, x, dims=None, correction: int = 1, keepdim: bool = False):
    """``torch.var(x, dims, correction=..., keepdim=...)``; ``dims`` an int, a list, or None (every dim)."""
    return _reduction(rec, x, dims, keepdim, correction=correction)


def _var_mean_front(rec, x, dims=None, correction: int = 1, keepdim: bool = False):
    """``torch.var_mean(x, dims, correction=..., keepdim=...)`` -> (var, mean)."""
    x = rec.tv(x, "x")
    return rec(x, dims=_reduced_dims(rec, x, dims), correction=correction, keepdim=rec.flag(keepdim, "keepdim"))


def _mean_localize(attrs: dict, s: Localize) -> dict:
    return {**attrs, "count": math.prod(s.in_global[0][d] for d in attrs["dims"])}


def _var_decomposed(op, b) -> None:
    """var (and var_mean's mean) as ``mean``, ``sub``, ``mul``, ``sum`` and ``div`` by the global count less the
    correction, in float32 for a half-precision x: over a sharded dim, the mean and the sum of squares leave
    pending sums of a value per row (two passes over x, as torch's two-pass variance)."""
    (x,), dims, keepdim = op.inputs, op.attr("dims"), op.attr("keepdim")
    if b.tensors[x].dtype.is_complex:  # the parts square x less its mean, not its magnitude: var stays whole
        return
    count = math.prod(b.tensors[x].shape[d] for d in dims)
    mean, _, var = _two_pass_variance(b, _widened(b, x), dims, count - op.attr("correction"), keepdim)
    b.finish(var, op.outputs[0])
    if len(op.outputs) == 2:
        b.finish(b("squeeze", mean, dims=() if keepdim else dims), op.outputs[1])


def _two_pass_variance(b, x: int, dims: tuple[int, ...], divisor: int, keepdim: bool = True, mean_out=None):
    """(the mean over ``dims``, kept; ``x`` less it; the sum of its squares over ``dims`` over ``divisor``): the
    variance's parts (``mean_out``: the result that takes the mean). Over a sharded dim the two sums are pending
    sums of a value per row."""
    mean = b("mean", x, dims=dims, keepdim=True, dtype=None, out=mean_out)
    centered = b("sub", x, mean)
    squares = b("sum", b("mul", centered, centered), dims=dims, keepdim=keepdim, dtype=None)
    return mean, centered, b("div", squares, Const(float(divisor)))


# Each reduction with the reduction across devices that finishes it over a sharded dim (its pieces reduced
# locally: sum and mean leave a sum, max/min/prod their own op); var and var_mean run on the gathered dim, or as
# their parts (``_var_decomposed``) where propagation finds that moves less.
# max and min are nvFuser's names of torch's amax and amin.
for _name, _impl, _front, _pending in (("sum", _sum, _sum_front, "sum"), ("mean", _mean, _mean_front, "sum"),
                                       ("amax", _amax, _extremum_front("amax"), "max"),
                                       ("max", _amax, _extremum_front("amax"), "max"),
                                       ("amin", _amin, _extremum_front("amin"), "min"),
                                       ("min", _amin, _extremum_front("amin"), "min"),
                                       ("prod", _prod, _prod_front, "prod"), ("var", _var, _var_front, None),
                                       ("var_mean", _var_mean, _var_mean_front, None)):
    _infer = _extremum_infer(f"a{_pending}", _impl) if _pending in ("max", "min") else _reduction_infer(_impl)
    register(_name, impl=_impl, infer=_infer, traits=Trait.REDUCTION,
             rule=rules.reduction(_pending), flops=_flops_input, front=_front, pending=_pending or "sum",
             localize=_mean_localize if _name == "mean" else None, num_outputs=2 if _name == "var_mean" else 1,
             decompose=None if _pending else _var_decomposed)


def _welford(x, dims, keepdim=False):
    """(mean, sum of squared deviations from it, count) over ``dims``, from torch's var_mean."""
    var, mean = torch.var_mean(x, dim=dims, correction=0, keepdim=keepdim)
    n = math.prod(x.shape[d] for d in dims)
    return mean, var * n, torch.full_like(mean, n, dtype=torch.int64)


def _welford_front(rec, x, dims):
    """nvFuser's ``welford(x, dims)`` -> (avg, var_sum, n): the mean over ``dims`` (an int or a non-empty list),
    the sum of squared deviations from it, and the number of elements reduced (an Int tensor of avg's shape);
    ``var_sum / n`` is the biased variance. A sharded reduced dim is gathered first."""
    x = rec.tv(x, "x")
    dims = rec.dims(x, dims)
    if not dims:
        _fail("welford", "give at least one dim to reduce")
    return rec(x, dims=dims, keepdim=False)


register("welford", impl=_welford, infer=_reduction_infer(_welford), traits=Trait.REDUCTION,
         rule=rules.reduction(None), flops=_flops_input, front=_welford_front, num_outputs=3)


# --- scans ----------------------------------------------------------------------------------------


def _scan(fn: Callable, combine: Callable) -> Callable:
    def impl(x, dim, init=None):
        out = fn(x, dim)
        return out if init is None else combine(out, init)
    return impl


def _scan_front(torch_name: str):
    def front(rec, x, dim: int, init=None):
        x = rec.tv(x, "x")
        return rec(x, dim=rec.dim(x, dim), init=None if init is None else _number(rec.kind, init, "init"))
    front.__doc__ = (f"``torch.{torch_name}(x, dim)``, nvFuser's scan: element i along ``dim`` combines elements "
                     "0..i; ``init`` (a number) is combined into every element. A sharded ``dim`` is gathered first "
                     "(cumsum and cumprod: or scanned in blocks, only the blocks' totals moving, where that moves "
                     "fewer bytes: ``_chunked_scan``).")
    return front


def _chunked_scan(total: str, combine: str, identity: int):
    """The recipe of a scan (``cumsum``: the block totals by ``sum``, combined by ``add``, from 0; ``cumprod``:
    ``prod``, ``mul``, 1) in two levels: ``dim`` cut into one block per device, each block scanned, and every
    element combined with the scan of the totals of the blocks before its own. Over a sharded dim (a sequence)
    each rank scans its block, and only the totals move (a chunked scan, as Mamba's across chunks), not the dim.
    Values round as the blocks are summed, as any pending sum's."""
    def recipe(op, b) -> None:
        (x,), dim, init = op.inputs, op.attr("dim"), op.attr("init")
        shape, cut = b.tensors[x].shape, b.blocks(x, dim, at_least=2)
        if cut is None:
            return
        within = b(op.kind, cut, dim=dim + 1, init=None)
        totals = b(total, cut, dims=(dim + 1,), keepdim=True, dtype=None)
        # the totals one block later (the identity first): each block's prefix is their scan
        later = (0, 0) * (len(shape) - dim) + (1, -1)
        before = b(op.kind, b("pad", totals, pad=later, value=identity), dim=dim, init=None)
        out = b(combine, within, before)
        if init is not None:
            out = b(combine, out, Const(init))
        b.finish(b("reshape", out, shape=shape), op.outputs[0])
    return recipe


for _name, _fn, _combine, _decompose in (
        ("cumsum", torch.cumsum, torch.add, _chunked_scan("sum", "add", 0)),
        ("cumprod", torch.cumprod, torch.mul, _chunked_scan("prod", "mul", 1)),
        ("cummax", lambda x, d: torch.cummax(x, d).values, torch.clamp_min, None),
        ("cummin", lambda x, d: torch.cummin(x, d).values, torch.clamp_max, None)):
    _impl = _scan(_fn, _combine)
    register(_name, impl=_impl, infer=_pointwise_infer(_impl), traits=Trait.NONE,
             rule=rules.along(lambda op, shape: (op.attr("dim"),),
                                linear=(lambda op: op.attr("init") is None) if _name == "cumsum" else None),
             flops=_flops_output, front=_scan_front(_name), decompose=_decompose)

# --- matrix products ------------------------------------------------------------------------------


def _match(a: int, b: int, what: str) -> None:
    if a >= 0 and b >= 0 and a != b:
        _bad(what)


def _linear(x, w, b=None):
    """``F.linear`` for a 2-D weight. A weight ``[*lead, out, in]`` (nvFuser's logical split) gives
    ``[*lead, ..., out]``: one batched GEMM over the leading index, in that layout, the bias
    ``[*lead, out]`` added by it."""
    if w.ndim == 2:
        return F.linear(x, w, b)
    lead, (out, k) = w.shape[:-2], w.shape[-2:]
    x2 = x.reshape(math.prod(x.shape[:-1]), k)
    n = math.prod(lead)  # extents spelled out: torch infers no -1 in a tensor without elements
    wt = w.reshape(n, out, k).transpose(1, 2)  # [L, in, out]
    if b is None:
        y = torch.matmul(x2, wt)
    else:
        y = torch.baddbmm(b.reshape(n, 1, out), x2.expand(n, *x2.shape), wt)
    return y.reshape(*lead, *x.shape[:-1], out)


def _linear_weight_msg(x: str, w: str, w_ndim: int) -> str:
    if w_ndim > 2:
        return f"the in extent of {x} (last dim) must match the last dim of the weight {w} [*lead, out, in]"
    if w_ndim == 0:
        return f"the weight {w} must have a dim: [out, in], [in] or [*lead, out, in]"
    return f"the in extent of {x} (last dim) must match the last dim of the weight {w} ([out, in] or [in])"


def _linear_bias_msg(b: str, w: str, w_shape: tuple[int, ...]) -> str:
    if len(w_shape) > 2:
        return f"bias {b} must be [*lead, out] = {list(w_shape[:-1])}, the dims of the weight {w} but the last"
    return f"bias {b} must be 1-D [out] with out = {w_shape[0]} (dim 0 of the weight {w})"


def _linear_infer(args, attrs):
    x, w, *bias = args
    what = _linear_weight_msg(str(x), str(w), w.ndim)
    if w.ndim < 2 or x.ndim < 1:
        _bad(what)
    _match(x.shape[-1], w.shape[-1], what)
    out = list(w.shape[:-1])  # [*lead, out]
    if bias:
        (b,) = bias
        if b.ndim != w.ndim - 1:
            _bad(_linear_bias_msg(str(b), str(w), w.shape))
        for d, e in enumerate(b.shape):
            _match(e, out[d], _linear_bias_msg(str(b), str(w), w.shape))
            out[d] = out[d] if out[d] >= 0 else e
    return [TensorType((*out[:-1], *x.shape[:-1], out[-1]), _same_dtype(args))]


def _linear_front(rec, x, w, b=None):
    """``F.linear(x, w, b)``: ``x[..., in] @ w[out, in]^T + b[out]``.

    A weight with leading dims, ``w[*lead, out, in]`` with ``b[*lead, out]`` (nvFuser's logical-split
    linear), gives ``[*lead, ..., out]``: ``F.linear(x, w.reshape(-1, in), b.reshape(-1))`` with the
    leading dims moved first. Sharding a leading dim of the weight shards that dim of the output, with
    no communication. A 1-D weight ``w[in]`` (no bias, as in torch) drops the out dim: it is recorded
    as ``matmul(x, w)``."""
    x, w = rec.tv(x, "x"), rec.tv(w, "w")
    if w.ndim < 1 or x.ndim < 1 or (x.shape[-1] >= 0 and w.shape[-1] >= 0 and x.shape[-1] != w.shape[-1]):
        _fail("linear", _linear_weight_msg(f"T{x.name} {x._ir.type_str()}", f"T{w.name} {w._ir.type_str()}", w.ndim))
    if w.ndim == 1:
        if b is not None:
            _fail("linear", f"a 1-D weight T{w.name} {w._ir.type_str()} takes no bias, as in torch")
        return rec.other("matmul", x, w)
    if b is not None:
        b = rec.tv(b, "b")
        if b.ndim != w.ndim - 1 or any(e >= 0 and f >= 0 and e != f for e, f in zip(b.shape, w.shape)):
            _fail("linear", _linear_bias_msg(f"T{b.name} {b._ir.type_str()}", f"T{w.name} {w._ir.type_str()}",
                                             w.shape))
    return rec(x, w, *([b] if b is not None else []))


register("linear", impl=_linear, infer=_linear_infer, traits=Trait.GEMM, rule=rules.linear,
         flops=_flops_gemm, follow=(1, 2, 0), front=_linear_front, weight_out_in=True, bias=2)


def _matmul_infer(args, attrs):
    a, b = args
    what = f"cannot multiply {a} by {b}"
    if a.ndim == 0 or b.ndim == 0:
        _bad(f"{what}: both operands need at least one dim")
    _match(a.shape[-1], b.shape[0] if b.ndim == 1 else b.shape[-2], f"{what}: contracted extents differ")
    batch = broadcast_shapes([a.shape[:-2], b.shape[:-2]])
    out = (*batch, *a.shape[-2:-1], *(b.shape[-1:] if b.ndim > 1 else ()))
    return [TensorType(out, _same_dtype(args))]


def _matmul_front(rec, a, b):
    """``torch.matmul(a, b)``, with torch's batch broadcasting and 1-D rules."""
    return rec(rec.tv(a, "a"), rec.tv(b, "b"))


register("matmul", impl=torch.matmul, infer=_matmul_infer, traits=Trait.GEMM, rule=rules.matmul,
         flops=_flops_gemm, follow=(1, 0), front=_matmul_front)


# grouped_mm (a mixture of experts' GEMM): torch._grouped_mm where it takes the operands, else one matmul
# per group. On CUDA, torch's grouped kernel (sm90 and later, bf16 operands and output) reads the offsets
# on the GPU; for other dtypes and GPUs torch loops over the groups itself (``_grouped_mm_fallback``), as
# the fallback here does. A loop reads the offsets on the host, which a CUDA graph capture refuses (the
# plan then runs eagerly).
_GROUPED_MM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _grouped_mm_operand_fits(t: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes ``t``: 16-byte aligned, one of its last two dims contiguous and
    the other's stride a multiple of 16 bytes (aten's ``check_valid_strides_and_return_transposed``)."""
    align = 16 // t.element_size()
    (s0, s1), (n0, n1) = t.stride()[-2:], t.shape[-2:]
    if t.data_ptr() % 16:
        return False
    if s0 == 1 and s1 >= max(1, n0):
        return s1 % align == 0
    return s1 == 1 and s0 >= max(1, n1) and s0 % align == 0


def _grouped_mm(mat1, mat2, offsets, groups_local=None):
    """Row group ``i`` of ``mat1`` (rows ``offsets[i-1]:offsets[i]``) times ``mat2[i]``. With ``groups_local``
    (``mat2`` holds those groups, by global index, of a stack sharded on its groups) only the rows of those
    groups, zeros for the others: this rank's part of a sum over the ranks. Each run of consecutive groups is
    one call on ``mat1`` with the other rows zeroed (no host read of the offsets: a CUDA graph captures it)."""
    if groups_local is not None:
        out, rows, at = None, torch.arange(mat1.shape[0], device=mat1.device), 0
        for first, stop in _runs(groups_local):
            start = offsets[first - 1] if first else 0
            held = ((rows >= start) & (rows < offsets[stop - 1])).unsqueeze(1)
            part = _grouped_mm(mat1 * held, mat2[at:at + stop - first], offsets[first:stop]).masked_fill(~held, 0)
            out, at = part if out is None else out + part, at + stop - first
        return out
    if (hasattr(torch, "_grouped_mm") and mat1.dtype == mat2.dtype and mat1.dtype in _GROUPED_MM_DTYPES
            and _grouped_mm_operand_fits(mat1) and _grouped_mm_operand_fits(mat2)):
        return torch._grouped_mm(mat1, mat2, offs=offsets.to(torch.int32))
    out = mat1.new_zeros(mat1.shape[0], mat2.shape[-1])
    start = 0
    for g, end in enumerate(offsets.tolist()):
        torch.mm(mat1[start:end], mat2[g], out=out[start:end])
        start = end
    return out


def _grouped_mm_infer(args, attrs):
    mat1, mat2, offsets = args
    if mat1.ndim != 2 or mat2.ndim != 3:
        _bad("mat1 must be [m, k] and mat2 [g, k, n]")
    _match(mat1.shape[1], mat2.shape[1], f"the contracted extent differs: dim 1 of mat1 {mat1} against dim 1 of "
                                         f"mat2 {mat2} (k)")
    if offsets.ndim != 1 or offsets.dtype not in (DataType.Int32, DataType.Int):
        _bad(f"offsets {offsets} must be a 1-D int32 (or int64) tensor [g] (each group's end row)")
    _match(offsets.shape[0], mat2.shape[0], f"offsets {offsets} must have one entry per group: g = {mat2.shape[0]} "
                                            f"(dim 0 of mat2 {mat2})")
    dtype = _same_dtype([mat1, mat2])
    if not dtype.is_floating:
        _bad(f"mat1 and mat2 are {dtype.short}; grouped_mm needs a floating dtype")
    return [TensorType((mat1.shape[0], mat2.shape[2]), dtype)]


def _grouped_mm_front(rec, mat1, mat2, offsets):
    """nvFuser's ``grouped_mm`` (a mixture of experts): the rows of ``mat1 [m, k]`` fall in ``g`` groups,
    group ``i`` being rows ``offsets[i-1]:offsets[i]`` (``offsets [g]``, int32: each group's end row, as
    ``torch._grouped_mm``'s ``offs``), and each group is multiplied by its matrix ``mat2[i] [k, n]`` ->
    ``[m, n]``. Offsets must not decrease nor pass ``m``; rows from ``offsets[-1]`` on are unspecified.

    ``n`` may be sharded (``mat2``'s: column parallel, no communication), and ``k`` on both operands (row
    parallel: a partial result, summed where needed); ``m`` and ``g`` stay whole, since the offsets are
    global row positions (they stay replicated). The output's loop domain ends with ``r{k}``. Runs
    ``torch._grouped_mm`` where it takes the operands (bf16, fp16 or fp32, 16-byte aligned strides), else
    a matmul per group. nvFuser's other forms (``[m, k]`` by ``[k, n]``, ``[g, m, k]`` by ``[k, n]``) are
    not supported.
    """
    mat1, mat2, offsets = rec.tv(mat1, "mat1"), rec.tv(mat2, "mat2"), rec.tv(offsets, "offsets")
    if (mat1.ndim, mat2.ndim) in ((2, 2), (3, 2)):
        raise LoweringError(f"grouped_mm: mat1 T{mat1.name} {mat1._ir.type_str()} with mat2 T{mat2.name} "
                            f"{mat2._ir.type_str()} is a form of nvFuser's grouped_mm that tp_fusion does not "
                            "support; it takes mat1 [m, k] with mat2 [g, k, n]")
    return rec(mat1, mat2, offsets)


# torch's one CUDA kernel of _grouped_mm (bf16) reads the offsets on the GPU; every other path (its fallback,
# the matmul per group above) reads them on the host, which a CUDA graph capture refuses.
def _runs(groups: tuple[int, ...]) -> list[tuple[int, int]]:
    """``groups`` (increasing indices) as runs of consecutive ones, each [first, stop)."""
    runs = []
    for g in groups:
        if runs and runs[-1][1] == g:
            runs[-1] = (runs[-1][0], g + 1)
        else:
            runs.append((g, g + 1))
    return runs


def _grouped_mm_localize(attrs: dict, s: Localize) -> dict:
    """Where ``mat2``'s groups are sharded, the global indices of those this rank holds (``groups_local``)."""
    if s.in_local[1][0] == s.in_global[1][0]:
        return attrs
    return {**attrs, "groups_local": tuple(s.in_indices(1, 0).tolist())}


register("grouped_mm", impl=_grouped_mm, infer=_grouped_mm_infer, traits=Trait.GEMM, rule=rules.grouped_mm,
         flops=_flops_gemm, follow=(1, 0), front=_grouped_mm_front, localize=_grouped_mm_localize,
         uncapturable=lambda ins, attrs: ins[0].dtype != DataType.BFloat16)

# --- shape ops ------------------------------------------------------------------------------------


def _reshape_infer(args, attrs):
    (x,), shape = args, attrs["shape"]
    if any(_is_number(e) and e < -1 for e in shape):  # (given by a scalar input: checked when bound)
        _bad(f"shape {list(shape)} has a negative extent; an extent is >= 0, or -1 to infer it")
    if -1 in x.shape or not all(map(_is_number, shape)):  # symbolic: extents are checked when bound
        return [TensorType(_known(shape), x.dtype)]
    n, known = math.prod(x.shape), math.prod(e for e in shape if e != -1)
    if shape.count(-1) > 1 or (-1 in shape and (known == 0 or n % known)) or (-1 not in shape and known != n):
        _bad(f"cannot reshape {x} ({n} elements) to {list(shape)}")
    return [TensorType(tuple(n // known if e == -1 else e for e in shape), x.dtype)]


def _reshape_front(rec, x, new_shape=None, *, shape=None):
    """``x.reshape(new_shape)`` with global extents (``shape=`` is accepted too); an extent may be a symbol
    (``fd.ops.size``, an integer ``Scalar``, and ``new_shape`` a ``define_vector``), bound at execute."""
    new_shape = new_shape if new_shape is not None else shape
    if new_shape is None:
        _fail("reshape", "give the new shape")
    return rec(rec.tv(x, "x"), shape=_target_shape("reshape", _extents("reshape", new_shape, "new_shape")))


def _shape_localize(attrs: dict, s: Localize) -> dict:
    return {**attrs, "shape": s.out_local}


register("reshape", impl=lambda x, shape: x.reshape(shape), infer=_reshape_infer, traits=Trait.VIEW,
         rule=rules.reshape, localize=_shape_localize, front=_reshape_front)


def _permute_front(rec, x, dims):
    """``x.permute(dims)``."""
    x = rec.tv(x, "x")
    dims = tuple(dims)
    in_range = all(isinstance(d, int) and not isinstance(d, bool) and -x.ndim <= d < x.ndim for d in dims)
    if not in_range or sorted(d % x.ndim for d in dims) != list(range(x.ndim)):
        _fail("permute", f"dims {list(dims)} are not a permutation of T{x.name}'s {x.ndim} dims {x._ir.type_str()}")
    return rec(x, dims=tuple(d % x.ndim for d in dims))


register("permute", impl=lambda x, dims: x.permute(dims),
         infer=lambda args, attrs: [TensorType(tuple(args[0].shape[d] for d in attrs["dims"]), args[0].dtype)],
         traits=Trait.VIEW, rule=rules.permute, front=_permute_front)


def _transpose_front(rec, x, dim0: int, dim1: int):
    """``x.transpose(dim0, dim1)`` (a permute)."""
    x = rec.tv(x, "x")
    d0, d1 = (rec.dims(x, d, "dim")[0] for d in (dim0, dim1))
    dims = list(range(x.ndim))
    dims[d0], dims[d1] = d1, d0
    return rec.other("permute", x, dims=tuple(dims))


SPELLINGS["transpose"] = _transpose_front


def with_stride_order(x: torch.Tensor, stride_order: tuple[int, ...]) -> torch.Tensor:
    """``x``'s values in memory laid out by nvFuser's ``stride_order`` (dim i has the
    ``stride_order[i]``-th smallest stride); no copy when ``x`` is laid out so already."""
    outer_first = sorted(range(x.ndim), key=lambda d: -stride_order[d])
    inverse = sorted(range(x.ndim), key=lambda i: outer_first[i])
    return x.permute(outer_first).contiguous().permute(inverse)


def _stride_order_front(rec, x, stride_order):
    """nvFuser's ``stride_order``: ``x`` with the memory layout ``stride_order`` (dim i has the
    ``stride_order[i]``-th smallest stride); the values and the logical shape are ``x``'s. As a fusion
    output it comes back in that layout (nvFuser's allocation domain)."""
    x = rec.tv(x, "x")
    order = _int_list("stride_order", stride_order, "stride_order")
    if sorted(order) != list(range(x.ndim)):
        _fail("stride_order", f"stride_order {list(order)} is not a permutation of the {x.ndim} dims of "
                              f"T{x.name} {x._ir.type_str()}")
    return rec(x, stride_order=order)


register("stride_order", impl=with_stride_order, infer=_same_as_input, traits=Trait.VIEW,
         rule=rules.pointwise(rules.linear_in_first), front=_stride_order_front,
         out_layout=lambda orders, attrs: [attrs["stride_order"]])


def _broadcast_in_dim(x, shape, broadcast_dims):
    view = [1] * len(shape)
    for i, d in enumerate(broadcast_dims):
        view[d] = x.shape[i]
    return x.reshape(view).expand([view[d] if e == -1 else e for d, e in enumerate(shape)])


def _broadcast_in_dim_infer(args, attrs):
    (x,), shape, bdims = args, attrs["shape"], attrs["broadcast_dims"]
    out = list(_known(shape))
    for i, d in enumerate(bdims):
        if x.shape[i] >= 0 and out[d] >= 0 and x.shape[i] not in (1, out[d]):  # (symbolic ones: checked when bound)
            _bad(f"{x} cannot broadcast to {list(out)} with broadcast_dims {list(bdims)}: dim {i} has extent "
                 f"{x.shape[i]}, neither 1 nor {out[d]}")
        if shape[d] == -1 or (isinstance(shape[d], Symbol) and x.shape[i] != 1):
            out[d] = x.shape[i]
    return [TensorType(tuple(out), x.dtype)]


def _broadcast_in_dim_front(rec, x, shape, broadcast_dims):
    """``x`` broadcast to ``shape``: input dim i becomes output dim ``broadcast_dims[i]`` (negative
    dims wrap); every other output dim is new. -1 in ``shape`` keeps the input's extent; an extent may
    be a symbolic ``fd.ops.size`` scalar."""
    x = rec.tv(x, "x")
    shape = _target_shape("broadcast_in_dim", _extents("broadcast_in_dim", shape, "shape"))
    bdims = _int_list("broadcast_in_dim", broadcast_dims, "broadcast_dims")
    bdims = tuple(d % len(shape) if -len(shape) <= d < 0 else d for d in bdims)
    ok = len(bdims) == x.ndim and list(bdims) == sorted(set(bdims)) and all(0 <= d < len(shape) for d in bdims)
    ok = ok and all(_known(shape)[d] in (-1, x.shape[i]) or x.shape[i] in (1, -1) for i, d in enumerate(bdims))
    if not ok:
        _fail("broadcast_in_dim", f"T{x.name} {x._ir.type_str()} cannot broadcast to {list(shape)} with "
                                  f"broadcast_dims {list(bdims)} (one increasing output dim per input dim, extents "
                                  "equal or 1)")
    return rec(x, shape=shape, broadcast_dims=bdims)


register("broadcast_in_dim", impl=_broadcast_in_dim, infer=_broadcast_in_dim_infer, traits=Trait.VIEW,
         rule=rules.broadcast_in_dim, localize=_shape_localize, front=_broadcast_in_dim_front)


def _broadcast_front(rec, x, is_broadcast_dim):
    """nvFuser's ``broadcast``: the output has ``len(is_broadcast_dim)`` dims; those marked True are
    new dims of extent 1, the others are ``x``'s dims in order."""
    x = rec.tv(x, "x")
    flags = [bool(f) for f in is_broadcast_dim]
    if flags.count(False) != x.ndim:
        _fail("broadcast", f"is_broadcast_dim {list(is_broadcast_dim)} must mark exactly {x.ndim} dims False "
                           f"(T{x.name} {x._ir.type_str()} has {x.ndim})")
    kept = [d for d, f in enumerate(flags) if not f]
    shape = [1] * len(flags)
    for i, d in enumerate(kept):
        shape[d] = x.shape[i]
    return rec.other("broadcast_in_dim", x, shape=tuple(shape), broadcast_dims=tuple(kept))


SPELLINGS["broadcast"] = _broadcast_front


def _size_front(rec, x, dim: int):
    """nvFuser's ``size``: the GLOBAL extent of dim ``dim`` of ``x`` (negative dims wrap), a Python int;
    for a symbolic (-1) extent a ``SymbolicSize`` scalar, which broadcast_in_dim's shape and slice's
    bounds take. Records no op."""
    x = rec.tv(x, "x")
    (d,) = rec.dims(x, dim)
    return x.shape[d] if x.shape[d] >= 0 else SymbolicSize(x.name, d)


def _shape_front(rec, x) -> list:
    """nvFuser's ``shape``: ``[fd.ops.size(x, d) for each dim d]``. Records no op."""
    x = rec.tv(x, "x")
    return [e if e >= 0 else SymbolicSize(x.name, d) for d, e in enumerate(x.shape)]


SPELLINGS["size"] = _size_front
SPELLINGS["shape"] = _shape_front


def _squeeze_front(rec, x, dims, squeeze_expanded: bool = False):
    """``x`` without those of the given dims that have extent 1; others are kept, as torch keeps them
    (nvFuser rejects them). A symbolic extent is taken to be 1, and checked at execute: the result's
    rank is fixed when it is defined. With ``squeeze_expanded`` (nvFuser's flag), an expanded broadcast
    dim (one that ``broadcast_in_dim``, ``expand`` or ``broadcast`` made new or grew from extent 1) is
    removed too: recorded as that broadcast without the dim. Another dim of extent other than 1 is
    then an error, as in nvFuser (it squeezes expanded broadcasts only)."""
    x = rec.tv(x, "x")
    dims = rec.dims(x, dims)
    if rec.flag(squeeze_expanded, "squeeze_expanded"):
        x, dims = _squeeze_expanded(rec, x, dims)
    return rec(x, dims=[d for d in dims if x.shape[d] in (1, -1)])


def _squeeze_expanded(rec, x, dims: tuple[int, ...]):
    """(x without its broadcast dims among ``dims``, the other ``dims`` renumbered): x's broadcast recorded
    again from its source without them (squeezing the source's extent-1 dims that grew)."""
    from tp_fusion.fusion_definition import TensorView

    producer = rec._fd._producer(x.name)
    bcast = producer is not None and producer.kind == "broadcast_in_dim"
    src = TensorView(rec._fd, producer.inputs[0]) if bcast else None
    bdims = producer.attr("broadcast_dims") if bcast else ()
    drop = [d for d in dims if bcast and (d not in bdims or src.shape[bdims.index(d)] == 1)]
    bad = [d for d in dims if d not in drop and x.shape[d] not in (1, -1)]
    if bad:
        _fail("squeeze", f"dim {bad[0]} of T{x.name} {x._ir.type_str()} is no expanded broadcast (a dim that "
                         "broadcast_in_dim, expand or broadcast made new or grew from extent 1, squeezed where that "
                         "op's output is) nor of extent 1")
    if not any(x.shape[d] != 1 for d in drop):
        return x, dims
    keep = [d for d in range(x.ndim) if d not in drop]
    grown = [i for i, d in enumerate(bdims) if d in drop]
    if grown:
        src = rec.other("squeeze", src, dims=grown)
    shape = [producer.attr("shape")[d] for d in keep]
    out = rec.other("broadcast_in_dim", src, shape=shape, broadcast_dims=[keep.index(d) for d in bdims if d in keep])
    return out, tuple(keep.index(d) for d in dims if d in keep)


def _squeeze_infer(args, attrs):
    (x,), dims = args, attrs["dims"]
    bad = [d for d in dims if x.shape[d] not in (1, -1)]
    if bad:
        _bad(f"dims {bad} of {x} are not of extent 1")
    return [TensorType(tuple(e for d, e in enumerate(x.shape) if d not in dims), x.dtype)]


register("squeeze", impl=lambda x, dims: x.squeeze(dims) if dims else x, infer=_squeeze_infer,
         traits=Trait.VIEW, rule=rules.squeeze, front=_squeeze_front)


def _unsqueeze_front(rec, x, dim: int):
    """``x.unsqueeze(dim)``: a new dim of extent 1 at ``dim`` (negative counts from the end)."""
    x = rec.tv(x, "x")
    if not isinstance(dim, int) or isinstance(dim, bool) or not -x.ndim - 1 <= dim <= x.ndim:
        _fail("unsqueeze", f"dim {dim!r} is out of range for T{x.name} {x._ir.type_str()} (an int in "
                           f"[{-x.ndim - 1}, {x.ndim}])")
    return rec(x, dim=dim % (x.ndim + 1))


def _unsqueeze_infer(args, attrs):
    shape = list(args[0].shape)
    shape.insert(attrs["dim"], 1)
    return [TensorType(tuple(shape), args[0].dtype)]


register("unsqueeze", impl=lambda x, dim: x.unsqueeze(dim), infer=_unsqueeze_infer, traits=Trait.VIEW,
         rule=rules.unsqueeze, front=_unsqueeze_front)


def _slice(x, starts, ends, strides):
    return x[tuple(slice(s, e, k) for s, e, k in zip(starts, ends, strides))]


def _slice_infer(args, attrs):
    (x,) = args
    out = []
    for n, s, end, k in zip(x.shape, attrs["starts"], attrs["ends"], attrs["strides"]):
        if n < 0 or isinstance(s, Symbol) or isinstance(end, Symbol):
            out.append(-1)  # known once execute binds the sizes
            continue
        # Bounds on an extent bound at execute are normalized there, as nvFuser does at run time and
        # Python's slices do (negative ones count from the end, then clamped to [0, extent]).
        out.append(len(range(*slice(s, end, k).indices(n))))
    return [TensorType(tuple(out), x.dtype)]


def _slice_front(rec, x, start_indices, end_indices, strides=None, manual_normalization: bool = False):
    """nvFuser's ``slice``: ``x[start_indices[d]:end_indices[d]:strides[d]]`` on every dim. Indices are
    normalized as Python, torch and nvFuser do (negative ones count from the end, then clamped to
    [0, extent]): when recorded, on a dim of known extent (unless ``manual_normalization``, nvFuser's
    promise that they lie in [0, extent] already); at execute, on a symbolic extent or for a symbolic
    ``fd.ops.size`` scalar."""
    x = rec.tv(x, "x")
    starts = _extents("slice", start_indices, "start_indices")
    ends = _extents("slice", end_indices, "end_indices")
    given = [f"{len(starts)} start_indices", f"{len(ends)} end_indices"]
    if strides is not None:
        strides = _int_list("slice", strides, "strides")
        given.append(f"{len(strides)} strides")
    strides = (1,) * x.ndim if strides is None else strides
    if not len(starts) == len(ends) == len(strides) == x.ndim:
        _fail("slice", f"start_indices, end_indices and strides need one entry per dim of T{x.name} "
                       f"{x._ir.type_str()} ({x.ndim} dims), got {', '.join(given[:-1])} and {given[-1]}")
    if not manual_normalization:
        bounds = [_normalized_slice(s, e, n) for s, e, n in zip(starts, ends, x.shape)]
        starts, ends = tuple(b[0] for b in bounds), tuple(b[1] for b in bounds)
    for d, (s, e, k, n) in enumerate(zip(starts, ends, strides, x.shape)):
        known = n >= 0 and _is_number(s) and _is_number(e)
        if k < 1 or (known and not 0 <= s <= e <= n):
            _fail("slice", f"dim {d} of T{x.name} {x._ir.type_str()}: [{s}:{e}:{k}] needs 0 <= start <= end <= "
                           "extent and a stride >= 1")
    return rec(x, starts=starts, ends=ends, strides=strides)


def _normalized_slice(start, end, n: int) -> tuple:
    """Python's bounds of ``[start:end]`` on an extent ``n``: negative ones count from the end, then
    clamped to [0, n], end at least start. Left as they are where ``n`` or a bound is symbolic."""
    if n < 0 or not (isinstance(start, int) and isinstance(end, int)):
        return start, end
    start, end, _ = slice(start, end).indices(n)
    return start, max(end, start)


def _slice_localize(attrs: dict, s: Localize) -> dict:
    """A sharded dim runs in full, whatever bounds normalized to its whole extent (e.g. ``[-n:n + 2]``),
    unless the slice narrows it: then it takes whole blocks of a strided shard (``rules.slice_candidates``),
    and each rank the same share of each, so the local bounds are the global ones over the device count."""
    (glob, local) = s.in_global[0], s.in_local[0]
    starts, ends = list(attrs["starts"]), list(attrs["ends"])
    for d, (n, m) in enumerate(zip(glob, local)):
        if m == n:  # not sharded: the global bounds
            continue
        if s.out_local[d] == m:  # the whole dim
            starts[d], ends[d] = 0, m
        else:
            start, end = _normalized_slice(attrs["starts"][d], attrs["ends"][d], n)
            starts[d], ends[d] = start * m // n, end * m // n
    return {**attrs, "starts": tuple(starts), "ends": tuple(ends)}


register("slice", impl=_slice, infer=_slice_infer, traits=Trait.VIEW, rule=rules.slice_,
         localize=_slice_localize, front=_slice_front)


def _cat_infer(args, attrs):
    dim = attrs["dim"]
    first = args[0]
    for t in args[1:]:
        if t.ndim != first.ndim or any(a >= 0 and b >= 0 and a != b for d, (a, b) in
                                       enumerate(zip(t.shape, first.shape)) if d != dim):
            _bad(f"{', '.join(map(str, args))} differ in a dim other than {dim}")
    ext = [t.shape[dim] for t in args]
    shape = list(first.shape)
    shape[dim] = -1 if -1 in ext else sum(ext)
    return [TensorType(tuple(shape), _torch_dtype(_cat_impl, args, {"dim": dim})[0])]


def _cat_impl(*tensors, dim):
    return torch.cat(tensors, dim)


def _cat_front(rec, tensors, dim: int, manual_padding: bool = False):
    """``torch.cat(tensors, dim)``. ``manual_padding`` (nvFuser: the inputs are padded already) must be false."""
    if manual_padding:
        _fail("cat", "manual_padding=True (inputs padded by the caller) is nvFuser-internal; pass the unpadded "
                     "tensors with manual_padding=False")
    if not isinstance(tensors, (list, tuple)):
        _fail("cat", f"pass a list of tensors, got {describe_value(tensors)}")
    tensors = [rec.tv(t, "each tensor") for t in tensors]
    if not tensors:
        _fail("cat", "give at least one tensor")
    return rec(*tensors, dim=rec.dims(tensors[0], dim, "dim")[0])


register("cat", impl=_cat_impl, infer=_cat_infer, traits=Trait.NONE, rule=rules.cat, front=_cat_front)


def _expand_front(rec, x, shape):
    """nvFuser's ``expand``, torch's ``x.expand(shape)``: dims of extent 1 grow to ``shape``'s extents,
    -1 keeps a dim, new leading dims may be added (recorded as ``broadcast_in_dim``)."""
    x = rec.tv(x, "x")
    shape = _target_shape("expand", _extents("expand", shape, "shape"))
    lead = len(shape) - x.ndim
    if lead < 0 or any(e == -1 for e in shape[:lead]):
        _fail("expand", f"shape {list(shape)} must have at least the {x.ndim} dims of T{x.name} {x._ir.type_str()}, "
                        "and a new leading dim needs an extent (not -1)")
    return _broadcast_in_dim_front(Recorder(rec._fd, "broadcast_in_dim"), x, shape, tuple(range(lead, len(shape))))


SPELLINGS["expand"] = _expand_front


def _pad(x, pad, value=None):
    return F.pad(x, pad, value=0 if value is None else value)


def _pad_infer(args, attrs):
    (x,), pad = args, attrs["pad"]
    shape = list(x.shape)
    for i in range(len(pad) // 2):
        d = x.ndim - 1 - i
        shape[d] = -1 if shape[d] < 0 else shape[d] + pad[2 * i] + pad[2 * i + 1]
        if shape[d] < -1 or (shape[d] == -1 and x.shape[d] >= 0):
            _bad(f"pad widths {list(pad)} crop dim {d} of {x} below extent 0")
    return [TensorType(tuple(shape), x.dtype)]


def _padded_dims(op, shape) -> tuple[int, ...]:
    pad = op.attr("pad")
    return tuple(len(shape) - 1 - i for i in range(len(pad) // 2) if pad[2 * i] or pad[2 * i + 1])


def _pad_front(rec, x, pad_widths, value=None):
    """nvFuser's ``pad``, torch's ``F.pad(x, pad_widths, value=value)``: ``pad_widths`` holds (before,
    after) pairs from the last dim backwards; negative widths crop. ``value`` (a number) defaults to
    zero. A padded dim is gathered first where it is sharded."""
    x = rec.tv(x, "x")
    pad = _int_list("pad", pad_widths, "pad_widths")
    if len(pad) % 2 or len(pad) > 2 * x.ndim:
        _fail("pad", f"pad_widths {list(pad)} must hold (before, after) pairs for at most the {x.ndim} dims of "
                     f"T{x.name} {x._ir.type_str()}")
    return rec(x, pad=pad, value=None if value is None else _number("pad", value, "value", (int, float, bool)))


register("pad", impl=_pad, infer=_pad_infer, traits=Trait.NONE,
         rule=rules.along(_padded_dims, linear=lambda op: not op.attr("value")), flops=_flops_output,
         front=_pad_front)


def _triu_front(rec, x, diagonal: int = 0):
    """``torch.triu(x, diagonal)``: the upper triangle of the last two dims (the others are batch dims);
    those two stay whole."""
    x = rec.tv(x, "x")
    if x.ndim < 2:
        _fail("triu", f"T{x.name} {x._ir.type_str()} needs at least 2 dims")
    return rec(x, diagonal=_number("triu", diagonal, "diagonal", (int,)))


register("triu", impl=lambda x, diagonal: torch.triu(x, diagonal), infer=_same_as_input, traits=Trait.NONE,
         rule=rules.along(lambda op, shape: (len(shape) - 2, len(shape) - 1), linear=lambda op: True),
         front=_triu_front)

# --- indexing -------------------------------------------------------------------------------------


def _integer_indices(op: str, t, what: str) -> None:
    if t.dtype not in (DataType.Int, DataType.Int32):
        _fail(op, f"{what} T{t.name} {t._ir.type_str()} must be an Int or Int32 tensor")


def _index_select_infer(args, attrs):
    x, index = args
    shape = list(x.shape)
    shape[attrs["dim"]] = index.shape[0]
    return [TensorType(tuple(shape), x.dtype)]


def _index_select_front(rec, x, index, dim: int):
    """nvFuser's ``index_select(x, index, dim)``, torch's ``torch.index_select(x, dim, index)``: the rows
    ``index`` (1-D, Int or Int32; a 0-d one is one row, as torch and nvFuser take it) of ``x`` along ``dim``.
    Where x's ``dim`` is sharded, each rank looks up the rows it holds (zeros for the others): a partial sum,
    finished by an allreduce or a reduce_scatter, as Megatron's vocab-parallel embedding. A sharded index shards
    the output's ``dim``, with no communication."""
    x, index = rec.tv(x, "x"), rec.tv(index, "index")
    _integer_indices("index_select", index, "index")
    if index.ndim > 1:
        _fail("index_select", f"index T{index.name} {index._ir.type_str()} must be 1-D or 0-d")
    if index.ndim == 0:
        index = rec.other("unsqueeze", index, dim=0)
    return rec(x, index, dim=rec.dim(x, dim))


def _held_rows(s: Localize, operand: int, dim: int) -> dict:
    """An indexing op's ``rows_local`` attribute where its ``operand``'s ``dim`` is sharded (else none): the
    local index of each global one along it, -1 where another rank holds it (``_look_up_held``)."""
    rows = s.in_global[operand][dim]
    if s.in_local[operand][dim] == rows:
        return {}
    held = s.in_indices(operand, dim)
    table = torch.full((rows,), -1, dtype=torch.int64)
    table[held] = torch.arange(len(held))
    return {"rows_local": table.to(s.device)}


def _indexed_localize(attrs: dict, s: Localize) -> dict:
    """An op that indexes its first operand along ``dim`` (index_select, take_along_axis): ``_held_rows`` of it."""
    return {**attrs, **_held_rows(s, 0, attrs["dim"])}


def _look_up_held(look_up, index: torch.Tensor, rows_local: torch.Tensor | None, zero_elsewhere):
    """``look_up(index)``, or with ``rows_local`` (``_held_rows``: the rows looked up are sharded) the rows held
    here and zeros for the others, this rank's part of a sum over the ranks (Megatron's vocab-parallel
    embedding). ``zero_elsewhere(out, mask)`` zeroes the output where ``mask`` (of the index's shape) is set.
    An index out of range reaches ``look_up`` as it is, which refuses it as it would unsharded."""
    if rows_local is None:
        return look_up(index)
    bad = (index < 0) | (index >= rows_local.shape[0])
    local = torch.where(bad, index, rows_local[index.clamp(0, rows_local.shape[0] - 1)])
    elsewhere = (local < 0) & ~bad
    return zero_elsewhere(look_up(local.masked_fill(elsewhere, 0)), elsewhere)


def _index_select(x, index, dim, rows_local=None):
    """``torch.index_select(x, dim, index)``; with ``rows_local`` (x holds some rows of ``dim``) the rows held
    here and zeros for the others (``_look_up_held``)."""
    def zero_elsewhere(out, mask):
        return out.masked_fill(mask.view([-1 if d == dim else 1 for d in range(out.ndim)]), 0)
    return _look_up_held(lambda i: torch.index_select(x, dim, i), index, rows_local, zero_elsewhere)


register("index_select", impl=_index_select, infer=_index_select_infer, traits=Trait.NONE, rule=rules.index_select,
         localize=_indexed_localize, front=_index_select_front,
         follow=(0, 1))  # the table's sharding, as an embedding's: its index is far smaller than it


def _select_front(rec, x, index, dim: int):
    """nvFuser's ``select(x, index, dim)``, torch's ``x.select(dim, index)``: the slice at ``index`` (a
    number or define_scalar; negative counts from the end) of ``dim``, which the result drops."""
    x = rec.tv(x, "x")
    d = rec.dim(x, dim)
    i = _number("select", index, "index", (int,))
    n = x.shape[d]
    if n >= 0 and _is_number(i) and not -n <= i < n:
        _fail("select", f"index {i} is out of range for dim {d} of T{x.name} {x._ir.type_str()}")
    return rec(x, dim=d, index=i)


def _select_infer(args, attrs):
    (x,), dim, index = args, attrs["dim"], attrs["index"]
    n = x.shape[dim]
    if n >= 0 and _is_number(index) and not -n <= index < n:  # (a symbolic extent or index: checked when bound)
        _bad(f"index {index} is out of range for dim {dim} of {x}")
    return [TensorType(tuple(e for d, e in enumerate(x.shape) if d != dim), x.dtype)]


register("select", impl=lambda x, dim, index: x.select(dim, index), infer=_select_infer,
         traits=Trait.VIEW, rule=rules.select, front=_select_front)


def _take_along_infer(args, attrs):
    x, index = args
    dim = attrs["dim"]
    if index.ndim != x.ndim:
        _bad(f"index {index} must have the {x.ndim} dims of x {x}")
    for d in range(x.ndim):
        if d != dim and x.shape[d] >= 0 and index.shape[d] > x.shape[d]:
            _bad(f"dim {d} of index {index} must not exceed that of x {x}")
    return [TensorType(index.shape, x.dtype)]


def _take_along(rec, arg, index, dim: int, alike: bool):
    """Record ``take_along_axis`` (errors name ``rec.kind``, the op the user called); ``alike``: the index's
    dims other than ``dim`` must equal arg's."""
    x, index = rec.tv(arg, "arg"), rec.tv(index, "index")
    _integer_indices(rec.kind, index, "index")
    d = rec.dim(x, dim)
    if alike and index.ndim == x.ndim:
        other = [e for e in range(x.ndim) if e != d and -1 not in (x.shape[e], index.shape[e])
                 and x.shape[e] != index.shape[e]]
        if other:
            _fail(rec.kind, f"dim {other[0]} of index T{index.name} {index._ir.type_str()} must equal that of arg "
                            f"T{x.name} {x._ir.type_str()} (only dim {d} may differ)")
    return rec.other("take_along_axis", x, index, dim=d)


def _take_along_axis_front(rec, arg, index, dim: int):
    """nvFuser's ``take_along_axis(arg, index, dim)``: ``out[..., j, ...] = arg[..., index[..., j, ...], ...]``
    along ``dim`` (torch's ``torch.gather(arg, dim, index)``); index (Int or Int32) has arg's dims and, but
    for ``dim``, its extents. A sharded index shards the output with no communication; where arg's ``dim`` is
    sharded, each rank takes the values it holds (zeros for the others): a partial sum (a cross entropy's
    target logit of vocabulary-sharded logits costs an allreduce of [tokens], not a gather of the logits)."""
    return _take_along(rec, arg, index, dim, alike=True)


def _gather_front(rec, arg, index, dim: int):
    """nvFuser's ``gather(arg, index, dim)``, torch's ``torch.gather(arg, dim, index)``: as
    ``take_along_axis`` (and recorded as it), but the index's dims other than ``dim`` may be shorter than
    arg's (it takes a prefix of them)."""
    return _take_along(rec, arg, index, dim, alike=False)


# nvFuser's gather is this op too: fd.ops.gather records it (the op name ``gather`` is the collective's).
def _take_along_axis(x, index, dim, rows_local=None):
    """``torch.gather(x, dim, index)``; with ``rows_local`` (x holds some rows of ``dim``) the values held here
    and zeros for the others (``_look_up_held``)."""
    return _look_up_held(lambda i: torch.gather(x, dim, i), index, rows_local,
                         lambda out, mask: out.masked_fill(mask, 0))


register("take_along_axis", impl=_take_along_axis, infer=_take_along_infer, traits=Trait.NONE, rule=rules.take_along,
         localize=_indexed_localize, front=_take_along_axis_front,
         follow=(0, 1))  # x's sharding: logits or a table, larger than what is taken from them
SPELLINGS["gather"] = _gather_front


def _scatter_infer(args, attrs):
    x, index, src = args
    dim = attrs["dim"]
    if index.ndim != x.ndim or (isinstance(src, TensorType) and src.ndim != x.ndim):
        _bad(f"index {index} and src must have the {x.ndim} dims of x {x}")
    for d, n in enumerate(index.shape):  # a symbolic extent (-1) is checked when bound
        over_src = isinstance(src, TensorType) and 0 <= src.shape[d] < n
        if over_src or (d != dim and 0 <= x.shape[d] < n):
            _bad(f"dim {d} of index {index} must not exceed that of src or (but for dim {dim}) of x {x}")
    if isinstance(src, TensorType) and src.dtype != x.dtype:
        _bad(f"src {src} must have the dtype of x {x}")
    return [x]


def _scatter_front(rec, arg, index, src, dim: int):
    """nvFuser's ``scatter(arg, index, src, dim)``, torch's ``torch.scatter(arg, dim, index, src)``: arg with
    ``out[..., index[..., j, ...], ...] = src[..., j, ...]`` along ``dim`` (src a tensor of arg's dtype or a
    number). Where an index repeats, which write wins is unspecified, as in torch. ``dim`` stays whole (any
    row may be written); the other dims stay sharded where index and src span them alike with arg.
    Recorded as ``scatter_along`` (the op name ``scatter`` is the collective's)."""
    x, index = rec.tv(arg, "arg"), rec.tv(index, "index")
    _integer_indices("scatter", index, "index")
    if _is_scalar(src):
        src = _number("scatter", src, "src", (int, float, bool))
    else:  # a symbolic Scalar is src broadcast to index's shape, read at run time as any tensor
        src = rec.tv(src, "src (a TensorView, a Python number or a define_scalar)")
        if not src.is_tensor():
            src = rec.other("broadcast_in_dim", rec.other("cast", src, dtype=x.dtype),
                            shape=tuple(_shape_front(rec, index)), broadcast_dims=())
    return rec.other("scatter_along", x, index, src, dim=rec.dim(x, dim))


register("scatter_along", impl=lambda x, index, src, dim: torch.scatter(x, dim, index, src), infer=_scatter_infer,
         traits=Trait.NONE, rule=rules.scatter)
SPELLINGS["scatter"] = _scatter_front


def _index_put_accumulate(acc, index, value, rows_local=None):
    """``torch.index_put(acc, [index], value, accumulate=True)``; with ``rows_local`` (acc holds some rows) the
    rows held here get their sums, the values of the other rows go to the other ranks' shards."""
    if rows_local is None:
        return torch.index_put(acc, (index,), value, accumulate=True)
    rows = rows_local.shape[0]
    wrapped = torch.where(index < 0, index + rows, index)  # a negative index counts from the end, as in torch
    bad = (wrapped < 0) | (wrapped >= rows)  # reaches index_put as it is, which refuses it as it would unsharded
    local = torch.where(bad, index, rows_local[wrapped.clamp(0, rows - 1)])
    elsewhere = (local < 0) & ~bad  # another rank's row: add zeros to row 0 (no data-dependent shapes)
    zeros = elsewhere.view(elsewhere.numel(), *[1] * (value.ndim - 1))
    return torch.index_put(acc, (local.masked_fill(elsewhere, 0),), value.masked_fill(zeros, 0), accumulate=True)


def _index_put_accumulate_infer(args, attrs):
    acc, index, value = args
    if index.ndim != 1 or value.ndim != acc.ndim or \
            any(0 <= a != v >= 0 for a, v in zip((index.shape[0], *acc.shape[1:]), value.shape)):
        _bad(f"value {value} must be [len(index), *acc.shape[1:]] for index {index} (1-d) and acc {acc}")
    if value.dtype != acc.dtype:
        _bad(f"value {value} must have the dtype of acc {acc}")
    return [acc]


def _index_put_accumulate_front(rec, acc, index, value):
    """nvFuser's ``index_put_accumulate(acc, index, value)``, torch's ``index_put(acc, [index], value,
    accumulate=True)``: ``acc`` with ``value[j]`` added to row ``index[j]`` for each j (repeated rows sum), an
    embedding's backward (acc ``[v, h]`` zeros, index the token ids ``[n]``, value their gradients ``[n, h]``).
    h may be sharded; so may v (each rank adds into the rows it holds, as a vocab-parallel embedding's
    backward); sharded tokens n sum on every rank into a partial acc (a reduce_scatter onto vocabulary
    shards, or an allreduce, finishes it)."""
    acc, index, value = rec.tv(acc, "acc"), rec.tv(index, "index"), rec.tv(value, "value")
    _integer_indices("index_put_accumulate", index, "index")
    return rec(acc, index, value)


register("index_put_accumulate", impl=_index_put_accumulate, infer=_index_put_accumulate_infer,
         traits=Trait.NONE, rule=rules.index_put_accumulate, flops=lambda ins, outs: math.prod(ins[2]),
         localize=lambda attrs, s: {**attrs, **_held_rows(s, 0, 0)}, front=_index_put_accumulate_front)


def _topk_front(rec, arg, k, dim: int = -1, largest: bool = True, sorted: bool = False):
    """nvFuser's ``topk(arg, k, dim=-1, largest=True, sorted=False)`` -> (values, indices), torch's
    ``torch.topk``: the ``k`` largest (or smallest) elements along ``dim``; unsorted, their order is
    unspecified (as in torch and nvFuser). ``dim`` is gathered where it is sharded; a sorted top-k of a sharded
    dim may instead run in two stages (each rank's top k, then the top k of those), where that moves fewer
    bytes (``_topk_decomposed``)."""
    x = rec.tv(arg, "arg")
    d, k = rec.dim(x, dim), _number("topk", k, "k", (int,), symbolic=False)
    if k < 0 or (x.shape[d] >= 0 and k > x.shape[d]):
        _fail("topk", f"k {k} is out of range for dim {d} of T{x.name} {x._ir.type_str()}")
    return rec(x, k=k, dim=d, largest=bool(largest), sorted=bool(sorted))


def _ordered(x: TensorType) -> None:
    """Sorting ops take an ordered dtype: complex numbers have no order (torch refuses them only at run time)."""
    if x.dtype.is_complex:
        _bad(f"{x} is complex; complex numbers have no order (sort fd.ops.abs, fd.ops.real or fd.ops.imag of it)")


def _topk_infer(args, attrs):
    (x,), shape = args, list(args[0].shape)
    _ordered(x)
    if attrs["k"] > shape[attrs["dim"]] >= 0:  # (a symbolic extent is checked here when bound, at execute)
        _bad(f"k {attrs['k']} is out of range for dim {attrs['dim']} of {x}")
    shape[attrs["dim"]] = attrs["k"]
    return [TensorType(tuple(shape), x.dtype), TensorType(tuple(shape), DataType.Int)]


def _topk_decomposed(op, b) -> None:
    """Top-k in two stages: ``dim`` cut into one block per device, the top k of each block (its indices made
    global), then the top k of those candidates and their indices. Over a sharded dim (a vocabulary) each rank
    finds its block's candidates, and k per block move instead of the dim. Only a sorted top-k is cut so: an
    unsorted one comes in torch's order of the whole op, which the stages would not keep. Where k exceeds a
    block, or the blocks do not divide the dim, the op stays whole too."""
    (x,), dim, k = op.inputs, op.attr("dim"), op.attr("k")
    shape = b.tensors[x].shape
    cut = b.blocks(x, dim, at_least=k) if op.attr("sorted") else None
    if cut is None:
        return
    blocks, block = b.tensors[cut].shape[dim:dim + 2]
    values, local = b("topk", cut, k=k, dim=dim + 1, largest=op.attr("largest"), sorted=False)
    starts = b("iota", length=blocks, start=0, step=block, dtype=DataType.Int)
    where = b("add", local, b("broadcast_in_dim", starts, shape=b.tensors[local].shape, broadcast_dims=(dim,)))
    flat = (*shape[:dim], blocks * k, *shape[dim + 1:])
    candidates, at = b("reshape", values, shape=flat), b("reshape", where, shape=flat)
    _, best = b("topk", candidates, k=k, dim=dim, largest=op.attr("largest"), sorted=True, out=(op.outputs[0], None))
    b("take_along_axis", at, best, dim=dim, out=op.outputs[1])


register("topk", impl=lambda x, k, dim, largest, sorted: tuple(torch.topk(x, k, dim, largest, sorted)),
         infer=_topk_infer, traits=Trait.NONE, rule=rules.along(lambda op, shape: (op.attr("dim"),)), num_outputs=2,
         front=_topk_front, decompose=_topk_decomposed)


def _argsort_front(rec, arg, dim: int = -1, descending: bool = False, stable: bool = False):
    """nvFuser's ``argsort(arg, dim=-1, descending=False, stable=False)``, torch's ``torch.argsort``: the
    positions that sort ``arg`` along ``dim`` (Int). ``dim`` is gathered where it is sharded."""
    x = rec.tv(arg, "arg")
    return rec(x, dim=rec.dim(x, dim), descending=bool(descending), stable=bool(stable))


register("argsort", impl=lambda x, dim, descending, stable: torch.argsort(x, dim=dim, descending=descending,
                                                                          stable=stable),
         infer=lambda args, attrs: _ordered(args[0]) or [TensorType(args[0].shape, DataType.Int)], traits=Trait.NONE,
         rule=rules.along(lambda op, shape: (op.attr("dim"),)), front=_argsort_front)


def _embedding(indices, weight, padding_idx=None, max_norm=None, norm_type=2.0, rows_local=None):
    """``F.embedding``; with ``rows_local`` (``weight`` holds some rows of the vocabulary) the rows held here
    and zeros for the others (``_look_up_held``)."""
    if max_norm is not None:  # F.embedding renormalizes the looked-up rows of its weight in place
        weight = weight.clone()
    return _look_up_held(lambda i: F.embedding(i, weight, padding_idx, max_norm, norm_type), indices, rows_local,
                         lambda out, mask: out.masked_fill(mask.unsqueeze(-1), 0))


def _embedding_localize(attrs: dict, s: Localize) -> dict:
    """Where the vocabulary is sharded, the local row of each global one (``_held_rows``); no ``padding_idx``
    (it only concerns the backward, and names a global row)."""
    held = _held_rows(s, 1, 0)
    return {**attrs, "padding_idx": None, **held} if held else attrs


def _embedding_front(rec, input, weight, padding_idx=None, max_norm=None, norm_type=None, scale_grad_by_freq=None,
                     sparse=None):
    """nvFuser's ``embedding_fwd``, torch's ``F.embedding``: the rows of ``weight [v, h]`` at ``input``
    (Int or Int32, any shape) -> ``[*input.shape, h]``. ``max_norm`` renormalizes the rows it returns
    (the weight itself is not modified); ``scale_grad_by_freq`` and ``sparse`` only concern a backward
    and are ignored. Index dims and h may be sharded (h not with ``max_norm``: a row's norm needs all of it;
    it is gathered). A sharded v makes each rank look up the rows it holds
    (zeros for the others): a partial sum over the ranks, which an allreduce (or a reduce_scatter of the
    tokens) finishes, as Megatron's vocab-parallel embedding does."""
    idx, w = rec.tv(input, "input"), rec.tv(weight, "weight")
    _integer_indices("embedding_fwd", idx, "input")
    if w.ndim != 2:
        _fail("embedding_fwd", f"weight T{w.name} {w._ir.type_str()} must be 2-D [num_embeddings, embedding_dim]")
    def number(value, what, kind=(int, float), cast=float):
        return None if value is None else _number("embedding_fwd", value, what, kind, cast=cast)
    max_norm, norm_type = number(max_norm, "max_norm"), number(norm_type, "norm_type")
    pad, v = number(padding_idx, "padding_idx", (int,), None), w.shape[0]
    if pad is not None and v >= 0 and _is_number(pad) and not -v <= pad < v:
        _fail("embedding_fwd", f"padding_idx {pad} is out of range for weight T{w.name} {w._ir.type_str()} "
                               f"({v} embeddings)")
    return rec(idx, w, padding_idx=pad, max_norm=max_norm, norm_type=2.0 if norm_type is None else norm_type)


register("embedding_fwd", impl=_embedding,
         infer=lambda args, attrs: [TensorType((*args[0].shape, args[1].shape[1]), args[1].dtype)],
         traits=Trait.NONE, rule=rules.embedding, localize=_embedding_localize, front=_embedding_front,
         follow=(1, 0))  # the table's sharding, as linear's weight: its ids are far smaller than it

# --- normalization --------------------------------------------------------------------------------


def _layer_norm(x, *params, normalized_shape=(), eps=1e-5, affine=()):
    given = dict(zip(affine, params))
    return F.layer_norm(x, normalized_shape, given.get("weight"), given.get("bias"), eps)


def _layer_norm_infer(args, attrs):
    """The input's shape and dtype. Weight and bias have the normalized shape (a symbolic extent is
    checked once bound, at execute) and the input's dtype, or float32 for a half-precision input
    (torch's mixed-precision layer norm)."""
    x, *params = args
    ns = attrs["normalized_shape"]
    if tuple(x.shape[len(x.shape) - len(ns):]) != ns and -1 not in x.shape:
        _bad(f"normalized_shape {list(ns)} must be the trailing extents of {x}")
    for p in params:
        if len(p.shape) != len(ns) or any(a != b and -1 not in (a, b) for a, b in zip(p.shape, ns)):
            _bad(f"weight and bias must have the normalized shape {list(ns)}, got {p}")
    mixed = x.dtype in (DataType.BFloat16, DataType.Half) and {p.dtype for p in params} == {DataType.Float}
    return [TensorType(x.shape, x.dtype if mixed else _same_dtype(args))]


def _layer_norm_front(rec, x, normalized_shape, weight=None, bias=None, eps: float = 1e-5):
    """``F.layer_norm(x, normalized_shape, weight, bias, eps)``."""
    x = rec.tv(x, "x")
    ns = _normalized_shape("layer_norm", normalized_shape)
    given = {k: rec.tv(v, k) for k, v in (("weight", weight), ("bias", bias)) if v is not None}
    return rec(x, *given.values(), normalized_shape=ns, eps=float(eps), affine=tuple(given))


def _layer_norm_decomposed(op, b, stats: tuple[int, ...] = ()) -> None:
    """``(x - mean) * rsqrt(var + eps)``, times the weight, plus the bias, over the trailing normalized dims, in
    float32 for a half-precision x: over a sharded normalized dim (a layer norm of a column-parallel q across
    its heads), the mean and the sum of squares leave pending sums of a value per row. ``stats``: the results
    that take the mean and rstd (``native_layer_norm``'s)."""
    (x, *params), ns = op.inputs, op.attr("normalized_shape")
    mean_out, rstd_out = stats or (None, None)
    dims = tuple(range(len(b.tensors[x].shape) - len(ns), len(b.tensors[x].shape)))
    _, centered, var = _two_pass_variance(b, _widened(b, x), dims, math.prod(ns), mean_out=mean_out)
    y = b("mul", centered, b("rsqrt", b("add", var, Const(op.attr("eps"))), out=rstd_out))
    given = dict(zip(op.attr("affine"), params))
    if "weight" in given:
        y = b("mul", y, given["weight"])
    if "bias" in given:
        y = b("add", y, given["bias"])
    b.finish(y, op.outputs[0])


register("layer_norm", impl=_layer_norm, infer=_layer_norm_infer, traits=Trait.NORMALIZATION,
         rule=rules.normalization(lambda op, n: tuple(range(n - len(op.attr("normalized_shape")), n))),
         flops=_flops_input, front=_layer_norm_front, decompose=_layer_norm_decomposed)


def _normalized_dims(op, n: int) -> tuple[int, ...]:
    """The dims a layer norm normalizes: the trailing ``normalized_shape``."""
    return tuple(range(n - len(op.attr("normalized_shape")), n))


def _normalized_shape(op: str, normalized_shape) -> tuple[int, ...]:
    """A layer norm's ``normalized_shape``: an int or a list of at least one int (as torch's)."""
    ns = (normalized_shape,) if isinstance(normalized_shape, int) else _int_list(op, normalized_shape,
                                                                                 "normalized_shape")
    if not ns:
        _fail(op, "normalized_shape must have at least one extent (the trailing dims to normalize)")
    return ns


def _stats_dtype(dtype: DataType) -> DataType:
    """The dtype of aten's layer-norm statistics (mean, rstd): float32 for half-precision inputs (as
    aten's CUDA kernels return them), else the input's."""
    return DataType.Float if dtype in (DataType.BFloat16, DataType.Half) else dtype


def _half_on_cpu(x: torch.Tensor, stats_dtype: torch.dtype) -> bool:
    """Whether aten would keep a half-precision CPU layer norm's statistics in the input's dtype (its CPU
    kernels do, its CUDA kernels keep float32): then the op runs in float32 and rounds its results."""
    return x.device.type == "cpu" and x.dtype != stats_dtype


def _native_layer_norm(x, *params, normalized_shape=(), eps=1e-5, affine=()):
    given = dict(zip(affine, params))
    w, b = given.get("weight"), given.get("bias")
    stats = _stats_dtype(DataType.from_torch(x.dtype)).torch
    if _half_on_cpu(x, stats):
        y, mean, rstd = torch.native_layer_norm(x.to(stats), normalized_shape, None if w is None else w.to(stats),
                                                None if b is None else b.to(stats), eps)
        return y.to(x.dtype), mean, rstd
    return torch.native_layer_norm(x, normalized_shape, w, b, eps)


def _stats_shape(x: TensorType, ns: tuple[int, ...]) -> tuple[int, ...]:
    return (*x.shape[:x.ndim - len(ns)], *(1 for _ in ns))


def _native_layer_norm_infer(args, attrs):
    (y,) = _layer_norm_infer(args, attrs)
    stats = TensorType(_stats_shape(y, attrs["normalized_shape"]), _stats_dtype(y.dtype))
    return [y, stats, stats]


def _native_layer_norm_front(rec, x, normalized_shape, weight=None, bias=None, eps: float = 1e-5):
    """``torch.native_layer_norm(x, normalized_shape, weight, bias, eps)`` -> (y, mean, rstd): the layer
    norm of ``layer_norm`` in one aten kernel, with the statistics its backward needs. mean and rstd
    (1 / sqrt(var + eps)) are [..., 1] with a 1 per normalized dim, float32 for half-precision ``x``
    (as aten's CUDA kernels return them; on the CPU too), else ``x``'s dtype. The leading (row) dims
    may be sharded; the normalized ones stay whole. Pass mean and rstd to ``native_layer_norm_backward``.
    """
    x = rec.tv(x, "x")
    ns = _normalized_shape("native_layer_norm", normalized_shape)
    given = {k: rec.tv(v, k) for k, v in (("weight", weight), ("bias", bias)) if v is not None}
    return rec(x, *given.values(), normalized_shape=ns, eps=float(eps), affine=tuple(given))


def _native_layer_norm_decomposed(op, b) -> None:
    """``layer_norm``'s parts (``_layer_norm_decomposed``), writing the mean and rstd it returns too."""
    _layer_norm_decomposed(op, b, stats=op.outputs[1:])


register("native_layer_norm", impl=_native_layer_norm, infer=_native_layer_norm_infer, traits=Trait.NORMALIZATION,
         rule=rules.normalization(_normalized_dims), flops=_flops_input, num_outputs=3,
         front=_native_layer_norm_front, decompose=_native_layer_norm_decomposed)


def _native_layer_norm_backward(grad_y, x, mean, rstd, *params, normalized_shape=(), affine=()):
    # aten's CPU kernel reads mean and rstd as if contiguous (a strided shard of them gave wrong rows)
    mean, rstd = mean.contiguous(), rstd.contiguous()
    given = dict(zip(affine, params))
    w, b = given.get("weight"), given.get("bias")
    mask = [True, w is not None, b is not None]
    if _half_on_cpu(x, mean.dtype):
        up = [None if t is None else t.to(mean.dtype) for t in (grad_y, x, w, b)]
        grads = torch.ops.aten.native_layer_norm_backward(up[0], up[1], normalized_shape, mean, rstd, up[2], up[3],
                                                          mask)
        grads = [None if g is None else g.to(x.dtype) for g in grads]
    else:
        grads = torch.ops.aten.native_layer_norm_backward(grad_y, x, normalized_shape, mean, rstd, w, b, mask)
    grads = tuple(g for g in grads if g is not None)
    return grads if len(grads) > 1 else grads[0]


def _native_layer_norm_backward_infer(args, attrs):
    grad_y, x, mean, rstd, *params = args
    ns = attrs["normalized_shape"]
    (gx,) = _layer_norm_infer([x, *params], attrs)
    if grad_y.dtype != x.dtype or len(grad_y.shape) != x.ndim:
        _bad(f"grad_y {grad_y} must have the shape and dtype of x {x}")
    for a, b in zip(grad_y.shape, x.shape):
        _match(a, b, f"grad_y {grad_y} must have the shape and dtype of x {x}")
    want = TensorType(_stats_shape(x, ns), _stats_dtype(x.dtype))
    for t, what in ((mean, "mean"), (rstd, "rstd")):
        if t.dtype != want.dtype or t.ndim != want.ndim or any(
                a != b and -1 not in (a, b) for a, b in zip(t.shape, want.shape)):
            _bad(f"{what} must be {want}, as native_layer_norm returns it for x {x}, got {t}")
    return [gx, *params]


def _native_layer_norm_backward_decomposed(op, b) -> None:
    """grad_x = rstd * (g - mean(g) - xhat * mean(g * xhat)) with ``xhat = (x - mean) * rstd`` and ``g = grad_y
    * weight``, means over the normalized dims; grad_weight and grad_bias the sums of ``grad_y * xhat`` and
    ``grad_y`` over the rows; in float32 for half precision. Over a sharded normalized dim the two means are
    pending sums of a value per row, where the op whole gathers grad_y and x."""
    grad_y, x, mean, rstd, *params = op.inputs
    ns, ndim = op.attr("normalized_shape"), len(b.tensors[x].shape)
    normalized, rows = tuple(range(ndim - len(ns), ndim)), tuple(range(ndim - len(ns)))
    gy, xhat = _widened(b, grad_y), b("mul", b("sub", _widened(b, x), mean), rstd)
    given, grads = dict(zip(op.attr("affine"), params)), iter(op.outputs[1:])
    for name, part in (("weight", lambda: b("mul", gy, xhat)), ("bias", lambda: gy)):
        if name in given:
            b.finish(b("sum", part(), dims=rows, keepdim=False, dtype=None) if rows else part(), next(grads))
    g = b("mul", gy, given["weight"]) if "weight" in given else gy

    def row_mean(t: int) -> int:
        return b("mean", t, dims=normalized, keepdim=True, dtype=None)
    inner = b("sub", b("sub", g, row_mean(g)), b("mul", xhat, row_mean(b("mul", g, xhat))))
    b.finish(b("mul", inner, rstd), op.outputs[0])


def _native_layer_norm_backward_front(rec, grad_y, x, normalized_shape, mean, rstd, weight=None, bias=None):
    """``torch.ops.aten.native_layer_norm_backward``: (grad_x, grad_weight, grad_bias) of
    ``native_layer_norm(x, normalized_shape, weight, bias)`` from the gradient ``grad_y`` of its y and
    the ``mean`` and ``rstd`` it returned, in one aten kernel. grad_weight (grad_bias) is None where
    ``weight`` (``bias``) is. The row dims may be sharded (grad_x follows them); grad_weight and
    grad_bias are sums over the rows, so rows sharded on a mesh axis leave them partial (summed) on
    it, as a ``sum`` over a sharded dim does: an allreduce gives the full gradient.
    """
    x = rec.tv(x, "x")
    ns = _normalized_shape("native_layer_norm_backward", normalized_shape)
    given = {k: rec.tv(v, k) for k, v in (("weight", weight), ("bias", bias)) if v is not None}
    outs = rec(rec.tv(grad_y, "grad_y"), x, rec.tv(mean, "mean"), rec.tv(rstd, "rstd"), *given.values(),
               normalized_shape=ns, affine=tuple(given))
    grads = iter(outs if isinstance(outs, tuple) else (outs,))
    grad_x = next(grads)
    return grad_x, *(next(grads) if k in given else None for k in ("weight", "bias"))


register("native_layer_norm_backward", impl=_native_layer_norm_backward, infer=_native_layer_norm_backward_infer,
         traits=Trait.NORMALIZATION, rule=rules.normalization_backward(_normalized_dims, stats=2),
         flops=lambda ins, outs: 2 * math.prod(ins[0]), num_outputs=3, front=_native_layer_norm_backward_front,
         decompose=_native_layer_norm_backward_decomposed)


def _softmax(x, dim):
    return torch.softmax(x, dim)


def _softmax_front(rec, x, dim: int):
    """``torch.softmax(x, dim)``."""
    x = rec.tv(x, "x")
    return rec(x, dim=rec.dim(x, dim))


def _softmax_decomposed(op, b) -> None:
    """``exp(x - max(x)) / sum(exp(x - max(x)))`` along ``dim``, in float32 for a half-precision x (as torch's
    kernel computes): over a sharded dim, the max and the sum leave pending reductions of one value per row."""
    (x,), dim = op.inputs, op.attr("dim")
    if b.tensors[x].shape[dim] == 0:  # nothing to normalize (the result is empty): the op whole, as amax refuses
        return                        # a dim of no elements
    wide = _widened(b, x)
    e = b("exp", b("sub", wide, b("amax", wide, dims=(dim,), keepdim=True)))
    b.finish(b("div", e, b("sum", e, dims=(dim,), keepdim=True, dtype=None)), op.outputs[0])


def _widened(b, x: int) -> int:
    """A decomposition's operand ``x`` in float32 where it is half precision (as torch's kernels compute)."""
    return b("cast", x, dtype=DataType.Float) if b.dtype(x) in (DataType.BFloat16, DataType.Half) else x


register("softmax", impl=_softmax,
         infer=lambda args, attrs: [TensorType(args[0].shape, _torch_dtype(_softmax, args, attrs)[0])],
         traits=Trait.NORMALIZATION, rule=rules.normalization(lambda op, n: (op.attr("dim"),)),
         flops=_flops_input, front=_softmax_front, decompose=_softmax_decomposed)

# --- factories ------------------------------------------------------------------------------------


def _full(shape, fill_value, dtype, device="cpu"):
    return torch.full(shape, fill_value, dtype=dtype.torch, device=device)


def _full_front(rec, shape, fill_value, dtype: DataType):
    """A tensor of ``shape`` (concrete extents) filled with ``fill_value``, a number or a define_scalar
    (nvFuser's ``full``)."""
    shape = _concrete_extents("full", shape)
    fill_value = _number("full", fill_value, "fill_value", NUMBER)
    if isinstance(fill_value, complex) and not rec.dtype(dtype).is_complex:
        _fail("full", f"fill_value {fill_value!r} is complex; dtype {dtype!r} holds no complex number")
    return rec(shape=shape, fill_value=fill_value, dtype=rec.dtype(dtype))


def _full_localize(attrs: dict, s: Localize) -> dict:
    return {**attrs, "shape": s.out_local, "device": s.device}


def _factory_infer(args, attrs):
    """A factory's result: its shape, whose extents given by scalar inputs are checked when bound (>= 0)."""
    if any(_is_number(e) and e < 0 for e in attrs["shape"]):
        _bad(f"shape {list(attrs['shape'])} has a negative extent")
    return [TensorType(_known(attrs["shape"]), attrs["dtype"])]


register("full", impl=_full, infer=_factory_infer,
         traits=Trait.FACTORY, rule=rules.factory, localize=_full_localize, front=_full_front,
         value_attrs=frozenset({"fill_value"}))


def _iota(length, start, step, dtype, device="cpu"):
    wide = torch.float64 if dtype.is_floating else torch.int64
    return (torch.arange(length, dtype=wide, device=device) * step + start).to(dtype.torch)


def _iota_front(rec, length, start=None, step=None, dtype: DataType = DataType.Int):
    """nvFuser's ``iota``: ``[start, start + step, ..., start + (length - 1) * step]`` of ``dtype``;
    ``start`` defaults to 0 and ``step`` to 1 (numbers or define_scalars; ``length`` a concrete int)."""
    n = _number("iota", length, "length", (int,), symbolic=False)
    if n < 0:
        _fail("iota", f"length {n} must be >= 0")
    start = 0 if start is None else _number("iota", start, "start")
    step = 1 if step is None else _number("iota", step, "step")
    if rec.dtype(dtype).is_complex:
        _fail("iota", f"dtype {dtype!r} is complex; iota makes real (integer or floating) sequences")
    if not rec.dtype(dtype).is_floating and not all(_is_integral(v) or (_is_number(v) and float(v).is_integer())
                                                    for v in (start, step)):
        _fail("iota", f"start {start} and step {step} must be whole numbers for dtype {dtype!r}")
    return rec(length=n, start=start, step=step, dtype=rec.dtype(dtype))


register("iota", impl=_iota, infer=lambda args, attrs: [TensorType((attrs["length"],), attrs["dtype"])],
         traits=Trait.FACTORY, rule=rules.replicated_factory,
         localize=lambda attrs, s: {**attrs, "device": s.device}, front=_iota_front,
         value_attrs=frozenset({"start", "step"}))

# --- random numbers -------------------------------------------------------------------------------

# The draws given no rng_seed follow torch's seed, as nvFuser's do: the k-th unseeded draw since torch was
# seeded (``torch.manual_seed``) is the draw of (``torch.initial_seed()``, offset k), so seeding torch makes
# them reproducible, and a new seed gives new draws. Every rank runs the same fusions in the same order and
# takes one (seed, offset) per call of each such op (``OpDef.fresh_seed``), also where the op does not run,
# so ranks seeded alike (torch's default, or the same ``manual_seed``) draw alike.
_unseeded_draws = {"seed": None, "offset": 0}


def take_seed() -> tuple[int, int]:
    """The (seed, offset) of the next unseeded draw: torch's seed and the number of unseeded draws since it
    was set (seeding torch again with the same seed goes on counting: its draws are new ones, not repeats)."""
    seed = torch.initial_seed()
    if seed != _unseeded_draws["seed"]:
        _unseeded_draws.update(seed=seed, offset=0)
    offset = _unseeded_draws["offset"]
    _unseeded_draws["offset"] += 1
    return seed, offset


def _unseeded(attrs: dict) -> bool:
    return attrs["rng_seed"] is None


def _generator(seed: int, offset: int, device) -> torch.Generator:
    """A generator on ``device`` whose stream is a function of (seed, offset) alone."""
    g = torch.Generator(device=device)
    g.manual_seed((seed * 0x9E3779B97F4A7C15 + offset) % 2**63)
    return g


def _draw(sample: Callable, shape, dtype, rng_seed, rng_offset, device) -> torch.Tensor:
    """``sample(shape)`` (torch.rand or torch.randn) from the generator of (rng_seed, rng_offset), or of a
    fresh seed when unseeded."""
    seed, offset = take_seed() if rng_seed is None else (rng_seed, rng_offset)
    return sample(shape, generator=_generator(seed, offset, device), dtype=dtype.torch, device=device)


def _uniform(minval, maxval, shape, dtype, rng_seed=None, rng_offset=None, device="cpu"):
    x = _draw(torch.rand, shape, dtype, rng_seed, rng_offset, device)
    return x if (minval, maxval) == (0, 1) else x * (maxval - minval) + minval


def _normal(mean, std, shape, dtype, rng_seed=None, rng_offset=None, device="cpu"):
    x = _draw(torch.randn, shape, dtype, rng_seed, rng_offset, device)
    return x if (mean, std) == (0, 1) else x * std + mean


def _number(op: str, value, what: str, kind=(int, float), symbolic: bool = True, cast: Callable | None = None):
    """A Python number from a number or a ``define_scalar`` (converted by ``cast`` where given); where
    ``symbolic``, a symbolic ``Scalar`` of a dtype of ``kind`` gives its ScalarRef (bound when the plan is
    built). A tensor or anything else is refused."""
    value = _attribute(value)
    if isinstance(value, ScalarRef) and symbolic:
        category = value.dtype.python_type
        if category in kind or (category is int and float in kind):
            return value
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in kind):
        got = f"a scalar of {value.dtype!r}{'' if symbolic else ' known only at execute'}" \
            if isinstance(value, ScalarRef) else repr(value)
        _fail(op, f"{what} must be {'an int' if kind == (int,) else 'a Python number'} or a define_scalar, got {got}")
    return value if cast is None else cast(value)


def _is_number(value) -> bool:
    """Whether an attribute is a number known now (not a symbol bound when the plan is built)."""
    return not isinstance(value, Symbol)


def _draw_attrs(op: str, shape, dtype, rng_seed, rng_offset) -> dict:
    """A random factory's checked shape (concrete), dtype (floating) and seed and offset (both or neither)."""
    shape = _concrete_extents(op, shape)
    if not isinstance(dtype, DataType) or not dtype.is_floating:
        _fail(op, f"dtype must be a floating DataType, got {dtype!r}")
    if (rng_seed is None) != (rng_offset is None):
        _fail(op, "rng_seed and rng_offset must be given together (or neither)")
    if rng_seed is None:
        return {"shape": shape, "dtype": dtype, "rng_seed": None, "rng_offset": None}
    seed, offset = (_number(op, v, what, (int,)) for v, what in ((rng_seed, "rng_seed"), (rng_offset, "rng_offset")))
    if any(_is_number(v) and v < 0 for v in (seed, offset)):
        _fail(op, f"rng_seed {seed} and rng_offset {offset} must be >= 0")
    return {"shape": shape, "dtype": dtype, "rng_seed": seed, "rng_offset": offset}


def _uniform_front(rec, low=None, high=None, shape=None, *, minval=None, maxval=None, rng_seed=None,
                   rng_offset=None, dtype: DataType = DataType.Float):
    """nvFuser's ``uniform``: a tensor of GLOBAL ``shape`` and floating ``dtype`` drawn uniformly from
    [low, high) (nvFuser names them ``minval`` and ``maxval``; either name works).

    The draw is a function of (``rng_seed``, ``rng_offset``) alone: the same on every rank and in
    every run, so a backward fusion redraws a forward's dropout mask. A sharded result is the matching
    slice of the unsharded draw (each rank draws the whole tensor and keeps its slice). Without a
    seed and offset (give both or neither), every execute draws anew from torch's seed (``take_seed``:
    reproducible after ``torch.manual_seed``), alike on ranks seeded alike. A seed or offset given by a
    scalar input is read at every call (no plan per seed).
    """
    low, high = (_either_name("uniform", *names) for names in ((low, "low", minval, "minval"),
                                                                (high, "high", maxval, "maxval")))
    if shape is None:
        _fail("uniform", "missing its shape")
    attrs = _draw_attrs("uniform", shape, dtype, rng_seed, rng_offset)
    low, high = _number("uniform", low, "low"), _number("uniform", high, "high")
    if _is_number(low) and _is_number(high) and low > high:
        _fail("uniform", f"low {low} is above high {high}: the draw is from [low, high)")
    return rec(minval=low, maxval=high, **attrs)


def _either_name(op: str, value, name: str, alias_value, alias: str):
    """The argument given as ``name`` or as its alias ``alias`` (exactly one of them)."""
    if (value is None) == (alias_value is None):
        _fail(op, f"give {name} or {alias} (one of them)")
    return alias_value if value is None else value


def _normal_front(rec, mean, std, shape, *, rng_seed=None, rng_offset=None, dtype: DataType = DataType.Float):
    """nvFuser's ``normal``: a tensor of GLOBAL ``shape`` and floating ``dtype`` drawn from a normal
    distribution of ``mean`` and ``std`` (numbers); seeds and sharding as ``uniform``'s."""
    attrs = _draw_attrs("normal", shape, dtype, rng_seed, rng_offset)
    return rec(mean=_number("normal", mean, "mean"), std=_number("normal", std, "std"), **attrs)


for _name, _impl, _front in (("uniform", _uniform, _uniform_front), ("normal", _normal, _normal_front)):
    register(_name, impl=_impl, infer=_factory_infer, traits=Trait.FACTORY, rule=rules.replicated_factory,
             flops=_flops_output, localize=_full_localize,
             front=_front, uncapturable=lambda ins, attrs: True, fresh_seed=_unseeded,
             value_attrs=frozenset({"rng_seed", "rng_offset", "minval", "maxval", "mean", "std"}))


def _like_front(name: str, kind: str, front: Callable, what: str):
    """``name(x)``: ``kind`` (0, 1, x's shape, dtype=x's dtype) recorded by ``front``."""
    def like(rec, x, *, rng_seed=None, rng_offset=None):
        x = rec.tv(x, "x")
        if any(e < 0 for e in x.shape):
            _fail(name, f"T{x.name} {x._ir.type_str()} has a symbolic extent; define it with concrete ones")
        return front(Recorder(rec._fd, kind), 0.0, 1.0, x.shape, rng_seed=rng_seed, rng_offset=rng_offset,
                     dtype=x.dtype)
    like.__doc__ = (f"{what} of ``x``'s shape and dtype (``{kind}(0, 1, x.shape, dtype=x.dtype)``; see ``uniform`` "
                    "for ``rng_seed``/``rng_offset``).")
    return like


SPELLINGS["rand_like"] = _like_front("rand_like", "uniform", _uniform_front, "Uniform numbers in [0, 1)")
SPELLINGS["randn_like"] = _like_front("randn_like", "normal", _normal_front, "Standard normal numbers")

# --- attention ------------------------------------------------------------------------------------
#
# Operands are [N*, H, S, E] (batch dims, heads, sequence, head dim). On CUDA, half-precision operands
# with a head dim that aten's flash kernel takes run it (its philox seed and offset carry the dropout
# mask to the backward); without dropout on Hopper and later, cuDNN's kernels run instead, forward and
# backward (what F.scaled_dot_product_attention picks there: in the layer of
# benchmarks/transformer_layer.py on H200, 0.47 ms against flash's 1.09 forward, 1.5 against 3.0
# backward). The backward passes cuDNN the layouts torch's autograd does (``_laid_out_like``): a first
# try without that gave wrong gradients after torch's own attention had run on the same shapes.
# Elsewhere: aten's CPU flash kernel without dropout; with dropout (and on CUDA otherwise) the math
# path, in float32 or wider, whose dropout mask is drawn from the seed and offset it returns, so the
# backward redraws it.


def _aten_flash(q, k, v) -> bool:
    """Whether aten's CUDA flash kernel runs these operands."""
    e = q.shape[-1]
    return (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and e % 8 == 0 and e <= 256
            and k.shape[-1] == v.shape[-1] == e and _nonempty(q, k, v))


def _nonempty(*tensors) -> bool:
    """Whether no operand is empty: aten's attention kernels fail on empty ones (the CPU flash kernel with a
    floating-point exception); the math path gives torch's result (zeros where there are no keys)."""
    return all(t.numel() for t in tensors)


def _cudnn_attention(q, k, v, dropout_p: float) -> bool:
    """Whether cuDNN's attention runs these operands (flash operands, no dropout, Hopper or later), forward
    and backward alike: torch's own SDPA picks it there, and its backward took half the time of aten's flash
    backward in the transformer benchmark (1.5 against 3.0 ms at 8192 tokens x 32 heads on an H200). The
    predicate depends on the operands alone, so ``sdpfa_bwd`` takes the path its ``sdpfa_fwd`` took."""
    return (dropout_p == 0 and _aten_flash(q, k, v) and q.shape[-1] <= 128
            and torch.cuda.get_device_capability(q.device)[0] >= 9 and torch.backends.cuda.cudnn_sdp_enabled()
            and torch.backends.cudnn.is_available() and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1)


def _laid_out_like(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``x`` (a copy where needed) dense in ``like``'s dim order (the layout cuDNN's attention gives its
    output after the query's)."""
    inner_first = sorted(range(like.dim()), key=like.stride)
    return with_stride_order(x, tuple(inner_first.index(d) for d in range(like.dim())))


def _cpu_flash(q, k, v, dropout_p: float) -> bool:
    """Whether aten's CPU flash kernel runs these operands (it has no dropout)."""
    return (q.device.type == "cpu" and dropout_p == 0 and q.dtype in (torch.float32, torch.float16, torch.bfloat16)
            and k.shape[-1] == v.shape[-1] == q.shape[-1] and _nonempty(q, k, v))


def _as_4d(*tensors):
    """[N*, H, S, E] as [B, H, S, E], the last dim of unit stride: aten's attention kernels read a
    tensor whose last dim is strided as if it were not (torch's ``F.scaled_dot_product_attention``
    checks for it; calling the kernels directly does not)."""
    out = [t.reshape(math.prod(t.shape[:-3]), *t.shape[-3:]) for t in tensors]  # (-1 fails on 0 elements)
    return [t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous() for t in out]


def _logits(q, k, is_causal: bool, scale):
    """Scaled q k^T, in float32 or wider, with the causal mask (top-left aligned, as torch's)."""
    acc = torch.promote_types(q.dtype, torch.float32)
    s = torch.matmul(q.to(acc), k.to(acc).transpose(-2, -1)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if is_causal:
        causal = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~causal, float("-inf"))
    return s


def _dropout_scale(shape, dropout_p: float, philox_seed, device):
    """The math path's dropout as a factor: 0 where dropped, 1/(1-p) where kept; None without dropout."""
    if dropout_p == 0:
        return None
    seed, offset = (int(v) for v in philox_seed.tolist())
    keep = torch.rand(shape, generator=_generator(seed, offset, device), device=device) >= dropout_p
    return keep / (1 - dropout_p)


def _no_dropout_rng(device, seed: int = 0, offset: int = 0):
    """The (philox seed u64[2], offset u64[]) outputs of a path that draws no mask from aten's generator:
    (``seed``, ``offset``) seed the math path's own dropout draw. (0, 0) takes no copy from the host (a CUDA
    graph can capture it)."""
    seeds = torch.zeros(2, dtype=torch.uint64, device=device) if (seed, offset) == (0, 0) else \
        torch.tensor([seed, offset], dtype=torch.uint64, device=device)
    return seeds, torch.zeros((), dtype=torch.uint64, device=device)


def _score_terms(terms, q, k) -> torch.Tensor | None:
    """sdpfa_fwd's bias and mask (0 where True, -inf elsewhere) summed in the query's dtype, as nvFuser sums them:
    a [B, H, Q, K] tensor for the 4-d operands (materialized, as nvFuser's); None without them."""
    if not terms:
        return None
    shape = (*q.shape[:-1], k.shape[-2])
    out = sum(torch.where(t, 0.0, float("-inf")) if t.dtype == torch.bool else t for t in terms).to(q.dtype)
    return out.expand(shape).reshape(math.prod(shape[:-3]), *shape[-3:])


def _sdpfa_fwd(q, k, v, *terms, dropout_p=0.0, is_causal=False, scale=None):
    """``terms``: the bias and mask, which run aten's CPU flash kernel or the math path (as torch's
    ``F.scaled_dot_product_attention`` with that ``attn_mask``)."""
    lead = q.shape[:-3]
    q4, k4, v4 = _as_4d(q, k, v)
    bias = _score_terms(terms, q, k)
    fresh = take_seed() if dropout_p else (0, 0)  # taken on every path (fresh_seed), used by the math path's mask
    if bias is None and _cudnn_attention(q, k, v, dropout_p):
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q4, k4, v4, None, True, 0.0, is_causal, False,
                                                                      scale=scale)[:2]
        lse = lse.reshape(q4.shape[:-1])  # cuDNN's is [B, H, S, 1]; sdpfa_fwd returns [N*, H, S], as nvFuser
        seed, offset = _no_dropout_rng(q.device)
    elif bias is None and _aten_flash(q, k, v):
        out, lse, _, _, _, _, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
            q4, k4, v4, dropout_p, is_causal, scale=scale)
    else:
        seed, offset = _no_dropout_rng(q.device, *fresh)
        if _cpu_flash(q, k, v, dropout_p) and not (bias is not None and is_causal):
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q4, k4, v4, 0.0, is_causal,
                                                                                  attn_mask=bias, scale=scale)
        else:
            out, lse = _math_attention(q4, k4, v4, bias, dropout_p, is_causal, scale, seed)
    return out.reshape(*lead, *out.shape[1:]), lse.float().reshape(*lead, *lse.shape[1:]), seed, offset


def _math_attention(q4, k4, v4, bias, dropout_p: float, is_causal: bool, scale, seed):
    """(output, logsumexp) in float32 or wider, ``bias`` (or None) added to the scores; a row that attends to no
    key (all masked) gives zeros, as torch's."""
    s = _logits(q4, k4, is_causal, scale)
    if bias is not None:
        s = s + bias
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.masked_fill(lse == float("-inf"), 0).unsqueeze(-1))
    drop = _dropout_scale(p.shape, dropout_p, seed, q4.device)
    return torch.matmul(p if drop is None else p * drop, v4.to(p.dtype)).to(q4.dtype), lse


def _sdpfa_bwd(grad_out, q, k, v, out, lse, philox_seed, philox_offset, dropout_p=0.0, is_causal=False, scale=None):
    shapes = q.shape, k.shape, v.shape
    g4, q4, k4, v4, o4 = _as_4d(grad_out, q, k, v, out)
    lse3 = lse.reshape(math.prod(lse.shape[:-2]), *lse.shape[-2:])
    if _cudnn_attention(q, k, v, dropout_p):
        # The layouts torch's own autograd passes: the output laid out after the query (as cuDNN's forward
        # allocates it), its gradient with the output's strides, the logsumexp a contiguous [B, H, S, 1].
        # torch caches cuDNN's graphs by the operands' layouts, in some versions by the query's, key's and
        # value's alone: a call with other layouts of these three could run a graph built for torch's.
        o4 = _laid_out_like(o4, q4)
        g4 = _laid_out_like(g4, q4)
        grads = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            g4, q4, k4, v4, o4, lse3.unsqueeze(-1).contiguous(), philox_seed, philox_offset, None, None, None,
            q.shape[-2], k.shape[-2], 0.0, is_causal, scale=scale)
    elif _aten_flash(q, k, v):
        grads = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            g4.contiguous(), q4, k4, v4, o4, lse3, None, None, q.shape[-2], k.shape[-2], dropout_p, is_causal,
            philox_seed, philox_offset, scale=scale)
    elif _cpu_flash(q, k, v, dropout_p):
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            g4, q4, k4, v4, o4, lse3, 0.0, is_causal, scale=scale)
    else:
        s = _logits(q4, k4, is_causal, scale)
        acc = s.dtype
        p = torch.exp(s - lse3.to(acc).unsqueeze(-1))
        drop = _dropout_scale(p.shape, dropout_p, philox_seed, q.device)
        g, qa, ka, va = (t.to(acc) for t in (g4, q4, k4, v4))
        grad_v = torch.matmul((p if drop is None else p * drop).transpose(-2, -1), g)
        grad_p = torch.matmul(g, va.transpose(-2, -1))
        grad_p = grad_p if drop is None else grad_p * drop
        grad_s = p * (grad_p - (g * o4.to(acc)).sum(-1, keepdim=True))
        factor = q.shape[-1] ** -0.5 if scale is None else scale
        grads = (torch.matmul(grad_s, ka) * factor, torch.matmul(grad_s.transpose(-2, -1), qa) * factor, grad_v)
    return tuple(grad.to(q.dtype).reshape(shape) for grad, shape in zip(grads, shapes))


def _check_qkv(q: TensorType, k: TensorType, v: TensorType) -> None:
    if q.ndim < 3 or k.ndim != q.ndim or v.ndim != q.ndim:
        _bad("query, key and value must be [N*, H, S, E] tensors with the same number of dims (at least 3)")
    for d in range(q.ndim - 2):
        _match(q.shape[d], k.shape[d], f"dim {d} (batch or heads) of the query and the key differ")
        _match(q.shape[d], v.shape[d], f"dim {d} (batch or heads) of the query and the value differ")
    _match(q.shape[-1], k.shape[-1], "the query and the key need the same head dim (last)")
    _match(k.shape[-2], v.shape[-2], "the key and the value need the same sequence length (dim -2)")
    if not q.dtype.is_floating or len({q.dtype, k.dtype, v.dtype}) > 1:
        _bad("query, key and value need one floating dtype")


def _sdpfa_fwd_infer(args, attrs):
    q, k, v, *terms = args
    _check_qkv(q, k, v)
    scores = (*q.shape[:-1], k.shape[-2])
    for t in terms:
        if t.ndim != q.ndim or any(e not in (1, -1, s) and s >= 0 for e, s in zip(t.shape, scores)):
            _bad(f"bias and mask must have the query's {q.ndim} dims and broadcast to the scores "
                 f"{list(scores)} (each extent that or 1), got {t}")
    return [TensorType((*q.shape[:-1], v.shape[-1]), q.dtype), TensorType(q.shape[:-1], DataType.Float),
            TensorType((2,), DataType.UInt64), TensorType((), DataType.UInt64)]


def _sdpfa_bwd_infer(args, attrs):
    grad_out, q, k, v, out, lse, seed, offset = args
    _check_qkv(q, k, v)
    want = TensorType((*q.shape[:-1], v.shape[-1]), q.dtype)
    for t, what in ((grad_out, "grad_output"), (out, "output")):
        if t.dtype != q.dtype or t.ndim != want.ndim:
            _bad(f"{what} must be {want}, the shape and dtype of sdpfa_fwd's output")
        for a, b in zip(t.shape, want.shape):
            _match(a, b, f"{what} must be {want}, the shape and dtype of sdpfa_fwd's output")
    if lse.dtype != DataType.Float or lse.ndim != q.ndim - 1:
        _bad(f"logsumexp must be f32{list(q.shape[:-1])}, as sdpfa_fwd returns it")
    if (seed.shape, offset.shape) != ((2,), ()) or {seed.dtype, offset.dtype} != {DataType.UInt64}:
        _bad("philox_seed and philox_offset must be u64[2] and u64[], as sdpfa_fwd returns them")
    return [q, k, v]


def _sdpa_attrs(op: str, dropout_p, is_causal, scale) -> dict:
    """The scalar arguments as attributes."""
    from tp_fusion.fusion_definition import TensorView

    if any(isinstance(a, TensorView) and a.is_tensor() for a in (dropout_p, is_causal, scale)):
        _fail(op, "dropout_p, is_causal and scale are numbers or define_scalars, got a TensorView (sdpfa_fwd "
                  "takes its bias and mask before them)")
    dropout = 0.0 if dropout_p is None else _number(op, dropout_p, "dropout_p", cast=float)
    if _is_number(dropout) and not 0 <= dropout < 1:
        _fail(op, f"dropout_p must lie in [0, 1), got {dropout}")
    causal = False if is_causal is None else _number(op, is_causal, "is_causal", (bool, int), cast=bool)
    scale = None if scale is None else _number(op, scale, "scale", cast=float)
    return {"dropout_p": dropout, "is_causal": causal, "scale": scale}


def _flops_attention(gemms: int, query: int) -> Flops:
    """``gemms`` products of [N*, H, Q, E] by [N*, H, E, K] sizes (the query is operand ``query``, the
    key the next one); softmax and dropout are not counted."""
    def flops(ins, outs) -> int:
        q, k = ins[query], ins[query + 1]
        return 2 * gemms * math.prod(q[:-1]) * k[-2] * q[-1]
    return flops


def _sdpfa_fwd_front(rec, query, key, value, bias=None, mask=None, dropout_p=None, is_causal=None, scale=None):
    """nvFuser's ``sdpfa_fwd``: scaled dot-product attention of [N*, H, S, E] operands ->
    (output [N*, H, Q, Ev], logsumexp f32[N*, H, Q], philox_seed u64[2], philox_offset u64[]).

    ``bias`` (the query's dtype) is added to the scores, ``mask`` (Bool) keeps those where it is True
    (-inf elsewhere; a row with none gives zeros, as torch's); each has the query's dims and broadcasts
    to [N*, H, Q, K]. ``dropout_p`` (default 0), ``is_causal`` (default False) and ``scale`` (default
    1/sqrt(E)) are numbers or define_scalars. nvFuser's older order ``(query, key, value, dropout_p,
    is_causal, scale)`` is taken where a number comes 4th or 5th; ``(q, k, v, None, None, x)`` is read
    in the current order (x is dropout_p). Batch and head dims may be sharded and stay sharded with no
    communication (a bias's or mask's with them, where not broadcast); the sequence and head dims are
    gathered first. Pass the seed and offset to ``sdpfa_bwd``: with dropout, it redraws the same mask
    from them.
    """
    from tp_fusion.fusion_definition import TensorView

    if any(a is not None and not (isinstance(a, TensorView) and a.is_tensor()) for a in (bias, mask)):
        dropout_p, is_causal, scale = _older_sdpa_order(bias, mask, dropout_p, is_causal, scale)
        bias = mask = None
    q, k, v = rec.tv(query, "query"), rec.tv(key, "key"), rec.tv(value, "value")
    terms = [rec.tv(t, what) for t, what in ((bias, "bias"), (mask, "mask")) if t is not None]
    if bias is not None and bias.dtype != q.dtype:
        _fail("sdpfa_fwd", f"bias T{bias.name} {bias._ir.type_str()} must have the query's dtype {q.dtype!r}")
    if mask is not None and mask.dtype != DataType.Bool:
        _fail("sdpfa_fwd", f"mask T{mask.name} {mask._ir.type_str()} must be a Bool tensor")
    return rec(q, k, v, *terms, **_sdpa_attrs("sdpfa_fwd", dropout_p, is_causal, scale))


def _older_sdpa_order(fourth, fifth, sixth, is_causal, scale) -> tuple:
    """(dropout_p, is_causal, scale) of a call in nvFuser's older order, (q, k, v, dropout_p, is_causal, scale),
    whose 4th to 6th arguments landed in the current order's bias, mask and dropout_p."""
    if (fifth is not None and is_causal is not None) or (sixth is not None and scale is not None):
        _fail("sdpfa_fwd", "is_causal or scale given twice (by position in nvFuser's older order and by keyword)")
    return fourth, is_causal if fifth is None else fifth, scale if sixth is None else sixth


def _sdpfa_bwd_front(rec, grad_output, query, key, value, output, logsumexp, dropout_p, is_causal, philox_seed,
                     philox_offset, scale):
    """nvFuser's ``sdpfa_bwd``: the gradients (grad_query, grad_key, grad_value) of ``sdpfa_fwd`` from
    the gradient of its output; ``output``, ``logsumexp``, ``philox_seed`` and ``philox_offset`` are
    what ``sdpfa_fwd`` returned, ``dropout_p``, ``is_causal`` and ``scale`` what it was given."""
    tensors = [rec.tv(t, what) for t, what in ((grad_output, "grad_output"), (query, "query"), (key, "key"),
                                                (value, "value"), (output, "output"), (logsumexp, "logsumexp"),
                                                (philox_seed, "philox_seed"), (philox_offset, "philox_offset"))]
    return rec(*tensors, **_sdpa_attrs("sdpfa_bwd", dropout_p, is_causal, scale))


def _with_dropout(attrs: dict) -> bool:
    return (attrs.get("dropout_p") or 0) > 0


def _draws_dropout(ins, attrs: dict) -> bool:
    return _with_dropout(attrs)


def _sdpfa_fwd_decomposed(op, b) -> None:
    """Attention as its parts where it decodes (no more query rows than the head dim, no dropout): the scores
    ``q kᵀ * scale`` (plus the bias, mask and causal mask), their row max, the exponentials, their row sum and
    the exponentials times v, in float32 for half-precision operands, as the math path computes. Over keys
    sharded on the sequence (context parallelism, a KV cache), each rank scores its own keys, and the max,
    the sum and the product with v leave pending reductions of a few values per query row, where the op
    whole gathers the keys and values (flash-decoding's split of the keys). The scores are [.., Q, K]: with
    Q at most E they take no more memory than the keys. A row that attends to no key gives zeros and a
    logsumexp of -inf, as the op whole does."""
    q, k, v, *terms = op.inputs
    dropout, is_causal, scale = op.attr("dropout_p"), op.attr("is_causal"), op.attr("scale")
    q_shape, k_shape = b.tensors[q].shape, b.tensors[k].shape
    if dropout != 0 or q_shape[-2] > q_shape[-1] or k_shape[-2] == 0:  # no key: the op whole (amax refuses it)
        return
    nd, rows, keys = len(q_shape), q_shape[-2], k_shape[-2]
    scores = (*q_shape[:-1], keys)
    qf, kf, vf = (_widened(b, t) for t in (q, k, v))
    s = b("matmul", qf, b("permute", kf, dims=(*range(nd - 2), nd - 1, nd - 2)))
    if isinstance(scale, Symbol):  # a number each call gives: a value attribute (a 0-d full), as the op takes it
        factor = b("full", shape=(), fill_value=scale, dtype=DataType.Float)
    else:
        factor = Const(q_shape[-1] ** -0.5 if scale is None else scale)
    s = b("mul", s, factor)
    for t in terms:
        if b.dtype(t) == DataType.Bool:
            s = b("where", t, s, Const(float("-inf")))
        else:
            s = b("add", s, _widened(b, t))
    if is_causal:  # top-left aligned, as torch's: query row i sees keys 0..i
        row, col = (b("broadcast_in_dim", b("iota", length=n, start=0, step=1, dtype=DataType.Int), shape=scores,
                      broadcast_dims=(d,)) for n, d in ((rows, nd - 2), (keys, nd - 1)))
        s = b("where", b("le", col, row), s, Const(float("-inf")))
    top = b("amax", s, dims=(nd - 1,), keepdim=True)
    top = b("where", b("eq", top, Const(float("-inf"))), Const(0.0), top)  # a row with no key: exp(-inf) = 0
    e = b("exp", b("sub", s, top))
    total = b("sum", e, dims=(nd - 1,), keepdim=True, dtype=None)
    divisor = b("where", b("eq", total, Const(0.0)), Const(1.0), total)
    b.finish(b("div", b("matmul", e, vf), divisor), op.outputs[0])
    b.finish(b("squeeze", b("add", top, b("log", total)), dims=(nd - 1,)), op.outputs[1])
    b("full", shape=(2,), fill_value=0, dtype=DataType.UInt64, out=op.outputs[2])  # no dropout: no seed used
    b("full", shape=(), fill_value=0, dtype=DataType.UInt64, out=op.outputs[3])


# As nvFuser (and aten's flash kernels): the output takes the query's layout, each gradient its operand's.
register("sdpfa_fwd", impl=_sdpfa_fwd, infer=_sdpfa_fwd_infer, traits=Trait.NONE,
         rule=rules.attention(free_inputs=(0, 1, 2), free_outputs=(0, 1), query_rows=True, scores_from=3),
         flops=_flops_attention(2, query=0),
         num_outputs=4, front=_sdpfa_fwd_front, out_layout=lambda orders, attrs: [orders[0], None, None, None],
         uncapturable=_draws_dropout, fresh_seed=_with_dropout, value_attrs=frozenset({"scale"}),
         decompose=_sdpfa_fwd_decomposed)
register("sdpfa_bwd", impl=_sdpfa_bwd, infer=_sdpfa_bwd_infer, traits=Trait.NONE,
         rule=rules.attention(free_inputs=(0, 1, 2, 3, 4, 5), free_outputs=(0, 1, 2)),
         flops=_flops_attention(4, query=1), num_outputs=3, front=_sdpfa_bwd_front,
         out_layout=lambda orders, attrs: orders[1:4], uncapturable=_draws_dropout, value_attrs=frozenset({"scale"}))


def _sdpa_front(rec, query, key, value, is_causal: bool = False, scale: float | None = None):
    """``F.scaled_dot_product_attention(query, key, value, is_causal=..., scale=...)``: the output of
    ``sdpfa_fwd`` without dropout."""
    return _sdpfa_fwd_front(Recorder(rec._fd, "sdpfa_fwd"), query, key, value, dropout_p=0.0, is_causal=is_causal,
                            scale=scale)[0]


SPELLINGS["scaled_dot_product_attention"] = _sdpa_front

# --- resharding steps (inserted by lowering; run by tp_fusion.runtime.collectives) ----------------

for _name, _traits in (("allgather", Trait.COLLECTIVE), ("reduce_scatter", Trait.COLLECTIVE),
                       ("allreduce", Trait.COLLECTIVE), ("all_to_all", Trait.COLLECTIVE),
                       ("send_recv", Trait.COLLECTIVE), ("broadcast", Trait.COLLECTIVE),
                       ("gather", Trait.COLLECTIVE), ("reduce", Trait.COLLECTIVE), ("scatter", Trait.COLLECTIVE),
                       ("local_slice", Trait.LOCAL_RESHARD | Trait.VIEW),
                       ("to_partial", Trait.LOCAL_RESHARD | Trait.VIEW)):
    register(_name, impl=None, infer=_same_as_input, traits=_traits)


def front_signature(front: Callable) -> inspect.Signature:
    """The signature ``fd.ops.<name>`` shows: the front end's, without its Recorder."""
    sig = inspect.signature(front)
    return sig.replace(parameters=list(sig.parameters.values())[1:])
