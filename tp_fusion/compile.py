"""Compiling a fusion for given input sizes: pure, no process group, no communication.

``compile_program`` checks the sizes against the fusion, binds symbolic extents, runs the pass
pipeline and builds this rank's ``Program`` (``tp_fusion.program``). ``global_input_shapes`` reads
the global shapes off a rank's local input shards, with every check that can be made before any
communication. The executor calls both on every rank; ``FusionDefinition.compile`` calls
``compile_program`` directly, so a GPU job's plan can be inspected on a laptop.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from tp_fusion import loop as loops
from tp_fusion.errors import DefinitionError, InputError, ShardingError, TPFusionError
from tp_fusion.ir import Fusion, Op, ScalarRef, Tensor, resolve_symbols, symbols_of
from tp_fusion.ops import OPS, opdef, operand_types, python_scalar, with_stride_order
from tp_fusion.passes import run_pipeline
from tp_fusion.program import Program, build_program
from tp_fusion.runtime import dist
from tp_fusion.runtime.dist import is_dtensor
from tp_fusion.types import DataType

if TYPE_CHECKING:
    from tp_fusion.fusion_definition import Layout  # (it imports this module)


def global_input_shapes(fusion: Fusion, inputs: Sequence, rank: int) -> list[tuple[int, ...]]:
    """Global shapes of the inputs, from this rank's local shards; raises InputError on any mismatch
    of count, type, dtype, rank (number of dims), device or local extent."""
    names = ", ".join(f"T{i}" for i in fusion.inputs)
    if len(inputs) != len(fusion.inputs):
        raise InputError(f"execute: the fusion takes {len(fusion.inputs)} inputs ({names}), got {len(inputs)}")
    shapes, devices = [], set()
    layouts = declared_layouts(fusion)
    scalars = scalar_inputs(fusion)
    for name, x in zip(fusion.inputs, inputs):
        t = fusion.tensor(name)
        if name in scalars and not (isinstance(x, torch.Tensor) and x.dim() == 0):
            raise InputError(f"execute: input T{name} is a scalar of {t.dtype.torch} (define_scalar); pass a number "
                             f"of its kind, got {_described(x)}")
        if not isinstance(x, torch.Tensor):
            raise InputError(f"execute: input T{name} must be a torch.Tensor, got {type(x).__name__}")
        if is_dtensor(x):
            raise InputError(f"execute: input T{name} is a DTensor; execute takes this rank's local shards. Run "
                             "the fusion on DTensors with tp_fusion.execute_with_dtensors(fd, inputs), or pass "
                             "x.to_local()")
        if x.layout != torch.strided:
            raise InputError(f"execute: input T{name} has layout {x.layout}; pass a dense tensor (x.to_dense())")
        if not t.held_by(rank):
            check_unheld(name, t, x, rank)
            shapes.append(t.shape)  # this rank holds no shard of it: its extents are its holders' to say
            continue
        if x.dtype != t.dtype.torch:
            raise InputError(f"execute: input T{name} has dtype {x.dtype}, the fusion defines it as "
                             f"{t.dtype.torch}; cast it or change define_tensor's dtype")
        devices.add(x.device)
        if x.dim() != t.ndim:
            raise InputError(f"execute: input T{name} has {x.dim()} dims {list(x.shape)}, the fusion defines "
                             f"{t.ndim} dims {list(t.shape)}")
        local_expected = t.sharding.local_shape(t.shape) if t.sharding else t.shape
        for d, (got, want) in enumerate(zip(x.shape, local_expected)):
            if want >= 0 and got != want:
                if t.sharding is not None and t.sharding.dim_shards(d):  # sharded, if only on mesh axes of size 1
                    factor = t.sharding.dim_factor(d)
                    held = f"its global extent {t.shape[d]} split {factor} way{'s' * (factor != 1)} gives {want}"
                else:
                    held = f"it is not sharded (global extent {t.shape[d]})" + _unparallelized_split(t, d)
                raise InputError(
                    f"execute: input T{name} dim {d} has local extent {got}; {held}. Pass this rank's shard "
                    f"(shard_tensor) of a {list(t.shape)} tensor; expected local shape {list(local_expected)}")
        layout = layouts.get(name)
        if layout is not None and layout.constrains:
            check_layout(f"T{name}", x, layout)
        shapes.append(t.sharding.global_shape(tuple(x.shape)) if t.sharding else tuple(x.shape))
    if len(devices) > 1:
        raise InputError(f"execute: inputs are on several devices {sorted(map(str, devices))}; use one")
    return shapes


def _unparallelized_split(t: Tensor, dim: int) -> str:
    """A hint where ``dim`` of ``t`` was split but none of its pieces parallelized (a forgotten
    ``parallelize`` leaves the dim whole); else nothing."""
    pieces = loops.pieces(t.loop or (), dim)
    if len(pieces) < 2:
        return ""
    return (f": it was split into loop axes {pieces}, none of them parallelized; to shard it, call "
            f"T{t.name}.axis({pieces[0]}).parallelize(ParallelType.mesh_x)")


def _described(x) -> str:
    return f"a tensor of shape {list(x.shape)}" if isinstance(x, torch.Tensor) else repr(x)


def scalar_inputs(fusion: Fusion) -> frozenset[int]:
    """The inputs ``execute`` takes as numbers (``define_scalar(None, dtype)``), by name."""
    return getattr(fusion.inputs, "scalars", frozenset())


def numbers_as_tensors(fusion: Fusion, inputs: list) -> list:
    """``inputs`` with each number given for a scalar input as the 0-d tensor of its dtype that the plan takes,
    on the inputs' device (``_device_of``). A value of another kind is left as it is, for
    ``global_input_shapes`` to refuse (on every rank alike)."""
    scalars = scalar_inputs(fusion)
    if not scalars:
        return inputs
    out, device = list(inputs), _device_of(inputs)
    for i, (name, x) in enumerate(zip(fusion.inputs, inputs)):
        dtype = fusion.tensor(name).dtype
        if name in scalars and fits_scalar(value := python_scalar(x), dtype):
            out[i] = torch.tensor(value, dtype=dtype.torch, device=device)
    return out


def _device_of(inputs: list) -> torch.device:
    """Where scalar inputs' tensors go: the first tensor input's device; without one, the current CUDA device
    under NCCL, else the CPU."""
    tensor = next((x for x in inputs if isinstance(x, torch.Tensor)), None)
    if tensor is not None:
        return tensor.device
    if dist.is_initialized() and dist.backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def fits_scalar(value, dtype: DataType) -> bool:
    """Whether ``value`` is a Python number of ``dtype``'s kind: a bool for bool, an int (or a bool) for the
    integers, any real number for the floats, any number for the complex."""
    if dtype == DataType.Bool:
        return isinstance(value, bool)
    return isinstance(value, (int, dtype.python_type)) or (dtype.is_complex and isinstance(value, float))


def _attribute_refs(fusion: Fusion, per_call: bool) -> tuple[ScalarRef, ...]:
    """The ScalarRefs the ops take as attributes: those read per call (in ``OpDef.value_attrs``) or those a
    plan is built for (the others), in order, once each."""
    refs = (ref for op in fusion.ops for k, v in op.attrs
            if (k in opdef(op.kind).value_attrs) == per_call for ref in symbols_of(v))
    return tuple(dict.fromkeys(refs))


def _inputs_read(fusion: Fusion, refs: Sequence[ScalarRef]) -> frozenset[int]:
    """The scalar inputs whose values ``refs`` depend on (through ops on scalars too)."""
    todo = [ref.tensor for ref in refs]
    seen: set[int] = set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        producer = fusion.producer(name)
        if producer is not None:
            todo.extend(producer.tensor_inputs)
            todo.extend(ref.tensor for ref in symbols_of(producer.attrs))
    return frozenset(seen & set(fusion.inputs))


def bound_scalar_inputs(fusion: Fusion) -> frozenset[int]:
    """The scalar inputs whose values some op takes as an attribute that shapes the plan (an extent, an
    index): a plan is built for their values."""
    return _inputs_read(fusion, _attribute_refs(fusion, per_call=False))


def per_call_scalar_inputs(fusion: Fusion) -> frozenset[int]:
    """The scalar inputs whose values some op takes as a value attribute (``OpDef.value_attrs``): read at
    every call."""
    return _inputs_read(fusion, _attribute_refs(fusion, per_call=True))


def per_call_numbers(fusion: Fusion) -> Callable[[dict], dict] | None:
    """For a concrete fusion (``concretize``): ``numbers(scalars)``, the numbers of its value attributes
    that scalar inputs give (``OpDef.value_attrs``), by ScalarRef, from the scalar inputs' values (by
    name); computed at every call, so a new seed or fill value builds no new plan. None: no such
    attribute."""
    refs = _attribute_refs(fusion, per_call=True)
    if not refs:
        return None

    def numbers(scalars: dict) -> dict:
        value_of = _scalar_evaluator(fusion, scalars, lambda name: fusion.tensor(name).shape)
        return {ref: value_of(ref) for ref in refs}
    return numbers


def _scalar_evaluator(fusion: Fusion, scalars: dict, shape_of):
    """``value_of(ref)``: the number a ScalarRef stands for, from the scalar inputs' values ``scalars`` (by
    name) and the ops on them, run now on 0-d CPU tensors (as torch computes them at run time)."""
    values: dict[int, torch.Tensor] = {}

    def tensor(name: int) -> torch.Tensor:
        if name not in values:
            op = fusion.producer(name)
            if op is None:  # a scalar input: execute and compile give the values of those attributes read
                values[name] = torch.tensor(scalars[name], dtype=fusion.tensor(name).dtype.torch)
            else:
                args = [tensor(a) if isinstance(a, int) else a.value for a in op.inputs]
                attrs = {k: resolve_symbols(v, shape_of, value_of) for k, v in op.attrs}
                outs = OPS[op.kind].impl(*args, **attrs)
                values.update(zip(op.outputs, outs if isinstance(outs, tuple) else (outs,)))
        return values[name]

    def value_of(ref: ScalarRef):
        value = tensor(ref.tensor).item()
        if ref.dtype in (DataType.Int, DataType.Int32) and not isinstance(value, int):  # an extent
            if not float(value).is_integer():
                raise InputError(f"execute: the scalar inputs' values do not fit the fusion: scalar T{ref.tensor} is "
                                 f"{value}, where an op takes an integer (an extent)")
            value = int(value)
        return value
    return value_of


def declared_layouts(fusion: Fusion) -> dict:
    """The inputs' layouts declared by ``define_tensor`` (``fusion_definition.Layout``), by name."""
    return getattr(fusion.inputs, "layouts", {})


def as_declared(fusion: Fusion, index: int, x):
    """Input ``index``'s value ``x`` in the layout ``define_tensor`` declared for it: ``x`` itself when
    nothing is declared or when it is laid out so already (no copy)."""
    layout = declared_layouts(fusion).get(fusion.inputs[index])
    if layout is None or not layout.constrains:
        return x
    return x.contiguous() if layout.stride_order is None else with_stride_order(x, layout.stride_order)


def check_unheld(name: int, t: Tensor, x, rank: int) -> None:
    """A rank outside an input's mesh passes an empty tensor for it (what ``shard_tensor`` gives)."""
    if not isinstance(x, torch.Tensor) or x.numel():
        got = f"a {type(x).__name__}" if not isinstance(x, torch.Tensor) else f"shape {list(x.shape)}"
        raise InputError(f"execute: rank {rank} holds no part of input T{name} (its mesh is "
                         f"{list(t.sharding.mesh.devices)}) and must pass an empty tensor for it (what "
                         f"shard_tensor gives), got {got}")


def check_layout(what: str, x: torch.Tensor, layout: Layout) -> None:
    """Raise InputError if ``x``'s strides contradict its declared ``Layout`` (nvFuser's meanings, see
    ``FusionDefinition.define_tensor``). Dims of extent 1 and broadcast (None) dims are free; so is
    a tensor without elements."""
    n = x.dim()
    if x.numel() == 0 or n == 0:
        return
    contiguity, stride_order = layout.contiguity, layout.stride_order
    order = tuple(stride_order) if stride_order is not None else tuple(range(n - 1, -1, -1))
    sizes, strides = tuple(x.shape), x.stride()
    declared = f"contiguity {list(layout.declared)}" + (f", stride_order {list(stride_order)}" if stride_order else "")
    fix = ("pass a tensor with this layout (e.g. .contiguous()" + (", or .permute(...).contiguous().permute(...)"
           if stride_order else "") + ") or declare the layout it has")
    # the dims that have strides, fastest first
    fast_first = [d for d in sorted(range(n), key=lambda d: order[d])
                  if sizes[d] != 1 and contiguity[d] is not None]
    for slower, faster in zip(fast_first[1:], fast_first):
        if strides[slower] < strides[faster]:
            raise InputError(
                f"execute: input {what} (shape {list(sizes)}, strides {list(strides)}) does not match its declared "
                f"layout ({declared}): dim {slower} must have a larger stride than dim {faster}; {fix}")
    want = 1
    for d in fast_first:
        if contiguity[d] is True and strides[d] != want:
            raise InputError(
                f"execute: input {what} (shape {list(sizes)}, strides {list(strides)}) does not match its declared "
                f"layout ({declared}): dim {d} is declared contiguous, so its stride must be {want}, got "
                f"{strides[d]}; {fix}")
        want = strides[d] * sizes[d]


def check_mesh_sizes(fusion: Fusion, world: int) -> None:
    """Every mesh names ranks of a world of ``world`` ranks."""
    for t in fusion.tensors:
        mesh = t.sharding.mesh if t.sharding is not None else None
        if mesh is not None and max(mesh.devices) >= world:
            raise ShardingError(
                f"T{t.name}: {mesh!r} ({mesh.size} devices) names rank {max(mesh.devices)}, but the process "
                f"group has {world} rank(s) (ranks 0..{world - 1}); build the mesh from "
                "range(dist.get_world_size()) or start more ranks")


def concretize(fusion: Fusion, input_shapes: Sequence[tuple[int, ...]], scalars: dict | None = None) -> Fusion:
    """The fusion with its symbols bound: shapes re-inferred from the inputs' sizes, the attributes that
    scalars give (``ScalarRef``) from the values ``scalars`` of the scalar inputs (by name) that they read,
    except value attributes (``OpDef.value_attrs``), which each call gives (``per_call_numbers``).
    A fusion without symbols whose inputs have the defined shapes is returned as it is."""
    if all(tuple(s) == fusion.tensor(n).shape for n, s in zip(fusion.inputs, input_shapes)) and \
            not any(-1 in t.shape for t in fusion.tensors) and not _attribute_refs(fusion, per_call=False):
        return fusion
    tensors = list(fusion.tensors)
    for name, shape in zip(fusion.inputs, input_shapes):
        tensors[name] = _bound(tensors[name], tuple(shape), None, None)
    shape_of = lambda name: tensors[name].shape  # noqa: E731
    value_of = _scalar_evaluator(fusion, scalars or {}, shape_of)
    ops = []
    for op in fusion.ops:
        per_call = opdef(op.kind).value_attrs
        try:
            op = op.replace(attrs=tuple((k, resolve_symbols(v, shape_of, _kept if k in per_call else value_of))
                                        for k, v in op.attrs))
        except TPFusionError:
            raise
        except (RuntimeError, TypeError, ValueError, IndexError) as e:
            raise InputError(f"execute: the scalar inputs' values do not fit the fusion: {op.kind}: "
                             f"{str(e).splitlines()[0]}") from None
        ops.append(op)
        args = operand_types(op, tensors.__getitem__)
        try:
            outs = opdef(op.kind).infer(args, dict(op.attrs))
        except DefinitionError as e:
            described = ", ".join(f"T{a} {t}" for a, t in zip(op.inputs, args) if isinstance(a, int))
            applied = f"cannot apply to {described}: " if described else ""  # (a factory has no operand)
            raise InputError(f"execute: the inputs' sizes do not fit the fusion: {op.kind}: {applied}{e}") from None
        for o, out in zip(op.outputs, outs):
            tensors[o] = _bound(tensors[o], out.shape, op, shape_of)
    return fusion.replace(tensors=tuple(tensors), ops=tuple(ops))


def _kept(ref: ScalarRef) -> ScalarRef:
    """A value attribute's ScalarRef, left for each call to give its number (``per_call_numbers``)."""
    return ref


def _bound(t: Tensor, shape: tuple[int, ...], producer: Op | None, shape_of) -> Tensor:
    """``t`` (made by ``producer``, whose operands' bound shapes ``shape_of`` gives; None: an input) with the
    extents ``shape``: its schedule's symbolic pieces sized, its reduction axes' too (a split of a symbolic
    extent could not be checked when it was scheduled: ShardingError now if it does not fit), its sharding
    derived again from them."""
    if t.loop is None:
        return t.replace(shape=shape)
    reduced = () if producer is None else \
        tuple(a.extent for a in loops.default_loop(shape, producer, shape_of) if a.reduction)
    loop = loops.bind(t.loop, shape, f"T{t.name} {t.type_str()}", " at execute", reduced)
    sharding = t.sharding if t.sharding is None else loops.sharding(loop, t.sharding.mesh, f"T{t.name}",
                                                                    loops.pending_of(producer))
    return t.replace(shape=shape, loop=loop, sharding=sharding)


def check_aliases(fusion: Fusion) -> None:
    """An output aliased to an input (written into it in place) has the input's shape, symbolic extents
    bound (``add_output`` checked the defined ones)."""
    for p, i in fusion.aliases:
        out, inp = fusion.tensor(fusion.outputs[p]), fusion.tensor(i)
        if out.shape != inp.shape:
            raise InputError(f"execute: output {p} (T{out.name}) is aliased to input T{i} (written into it in place), "
                             f"but the inputs' sizes make it {list(out.shape)} and T{i} {list(inp.shape)}")


def resolve_layouts(fusion: Fusion) -> Fusion:
    """Each op output's memory layout (``Tensor.stride_order``): the one the user fixed
    (``set_allocation_domain``), else the one its op gives from its operands' (``OpDef.out_layout``),
    else row-major. The runner returns fusion outputs in these layouts, as nvFuser does."""
    tensors = list(fusion.tensors)
    for op in fusion.ops:
        rule = opdef(op.kind).out_layout
        if rule is None:
            continue
        orders = rule([tensors[a].stride_order if isinstance(a, int) else None for a in op.inputs], dict(op.attrs))
        for o, order in zip(op.outputs, orders):
            if tensors[o].stride_order is None and order is not None:
                tensors[o] = tensors[o].replace(stride_order=order)
    return fusion.replace(tensors=tuple(tensors))


def compile_program(fusion: Fusion, input_shapes: Sequence[tuple[int, ...]], rank: int,
                    device: torch.device, scalars: dict | None = None) -> Program:
    """This rank's program for inputs of these GLOBAL shapes (and values ``scalars`` of the scalar inputs that
    attributes read, by name). Raises the library's errors for anything that does not fit; never
    communicates."""
    concrete = resolve_layouts(concretize(fusion, input_shapes, scalars))
    check_aliases(concrete)
    for t in concrete.tensors:
        if t.sharding is not None:
            t.sharding.check_divides(t.shape, f"T{t.name} {t.type_str()}")
    lowered = run_pipeline(concrete, check=os.environ.get("TP_FUSION_VERIFY", "") not in ("", "0"))
    for t in lowered.tensors:
        if t.sharding is not None:
            t.sharding.check_divides(t.shape, f"T{t.name} {t.type_str()}")
    return dataclasses.replace(build_program(lowered, rank, device), numbers=per_call_numbers(concrete))
