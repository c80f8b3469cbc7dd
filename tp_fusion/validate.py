"""``fd.validate``: execute a fusion and compare its outputs with references, as nvFuser's
``FusionDefinition.validate`` does.

The references are given (the outputs' GLOBAL values: each rank compares its shard) or computed here
by ``reference``, a small interpreter that evaluates the definition's ops one by one on the whole
inputs: each op's aten implementation (``OPS[kind].impl``) with its global attributes, no planner and
no sharding. Tolerances are nvFuser's (``csrc/validator_utils.cpp``): by dtype, widened for floating
outputs by how many elements each of their values sums up on its way from the inputs (reductions,
GEMM contractions, normalizations).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from tp_fusion.compile import concretize, global_input_shapes, numbers_as_tensors, per_call_numbers, scalar_inputs
from tp_fusion.errors import InputError, ValidationError
from tp_fusion.ir import Fusion, Op, resolve_symbols
from tp_fusion.ops import Localize, Trait, opdef
from tp_fusion.passes import remove_unused
from tp_fusion.runtime import dist
from tp_fusion.sharding.sharding import shard_tensor
from tp_fusion.types import DataType

# nvFuser's ValidationConstants: (elements summed, max abs error measured) of randn + add + sum, against float64
_SUM_TOLERANCES_FLOAT = (
    (4, 1.68222e-06), (8, 2.23704e-06), (16, 2.95788e-06), (32, 4.4778e-06), (64, 6.75395e-06),
    (128, 8.57934e-06), (256, 1.30594e-05), (512, 2.19122e-05), (1024, 3.3451e-05), (2048, 5.78476e-05),
    (4096, 0.000108292), (8192, 0.00012207), (16384, 0.000136882), (32768, 0.000248561), (65536, 0.000407594),
    (131072, 0.000500901), (262144, 0.000923019), (524288, 0.00156909), (1048576, 0.00223107),
    (2097152, 0.00343043))
_SUM_TOLERANCES_HALF = (
    (4, 0.00390625), (8, 0.0078125), (16, 0.0078125), (32, 0.0155334), (64, 0.0156269), (128, 0.0312042),
    (256, 0.0312548), (512, 0.0619979), (1024, 0.0625103), (2048, 0.124686), (4096, 0.12501), (8192, 0.24945),
    (16384, 0.250049), (32768, 0.498946), (65536, 0.500071), (131072, 0.985087), (262144, 1.00006),
    (524288, 1.99234), (1048576, 2.00032), (2097152, 3.99073))


def tolerance(dtype: DataType, reduced: int) -> tuple[float, float]:
    """nvFuser's (atol, rtol) for an output of ``dtype`` whose values each sum up ``reduced`` elements:
    exact for integers and booleans; bfloat16 ten times half's where something was reduced."""
    if not (dtype.is_floating or dtype.is_complex):
        return 0.0, 0.0
    table = _SUM_TOLERANCES_HALF if dtype in (DataType.Half, DataType.BFloat16) else _SUM_TOLERANCES_FLOAT
    if reduced <= 1:
        return table[0][1], table[1][1]
    entry = next((k for k, (n, _) in enumerate(table) if n >= reduced), len(table))
    atol = table[entry + 1][1] if entry + 1 < len(table) else table[-1][1] * 2
    scale = 10.0 if dtype == DataType.BFloat16 else 1.0
    return atol * scale, atol * 0.01 * scale


def reduced_sizes(fusion: Fusion) -> dict[int, int]:
    """Per tensor of a fusion of concrete shapes: how many elements each of its values sums up, the most
    along any path from the inputs (nvFuser's ReductionSizeMapper)."""
    sizes = {name: 1 for name in fusion.inputs}
    for op in fusion.ops:
        before = max((sizes.get(a, 1) for a in op.tensor_inputs), default=1)
        own = _reduced_by(op, fusion)
        for o in op.outputs:
            sizes[o] = before * own
    return sizes


def _reduced_by(op: Op, fusion: Fusion) -> int:
    """How many elements ``op`` sums into each value: a GEMM's contraction, a reduction's or a
    normalization's extents; 1 for other ops."""
    od = opdef(op.kind)
    if not od.has(Trait.GEMM | Trait.REDUCTION | Trait.NORMALIZATION):
        return 1
    x = fusion.tensor(op.tensor_inputs[0]).shape
    if od.has(Trait.GEMM):
        return x[-1]
    if op.attr("normalized_shape") is not None:
        return math.prod(op.attr("normalized_shape"))
    dims = op.attr("dims", op.attr("dim"))
    dims = (dims,) if isinstance(dims, int) else dims or ()
    return math.prod(x[d] for d in dims)


def reference(fusion: Fusion, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The outputs of ``fusion`` (one per output position) computed op by op on the whole ``inputs``: each
    op's aten implementation with its global attributes (a factory made on the inputs' device). Meshes
    and schedules are ignored, so ``inputs`` are the GLOBAL tensors. An unseeded random draw has no
    reference (it draws anew on every call): InputError."""
    inputs = numbers_as_tensors(fusion, list(inputs))
    device = next((x.device for x in inputs if isinstance(x, torch.Tensor)), torch.device("cpu"))
    whole = fusion.with_tensors({t.name: t.replace(sharding=None, loop=None, annotated=False)
                                 for t in fusion.tensors if t.sharding is not None or t.loop is not None})
    shapes = global_input_shapes(whole, inputs, 0)
    scalars = {name: x.item() for name, x in zip(fusion.inputs, inputs) if name in scalar_inputs(fusion)}
    concrete = concretize(whole, shapes, scalars)
    per_call = per_call_numbers(concrete)
    numbers = {} if per_call is None else per_call(scalars)
    concrete = remove_unused(concrete)
    env = dict(zip(concrete.inputs, inputs))
    last_use = {a: k for k, op in enumerate(concrete.ops) for a in op.tensor_inputs}
    with torch.no_grad(), torch.autocast(device.type, enabled=False):
        for k, op in enumerate(concrete.ops):
            od = opdef(op.kind)
            attrs = {k: resolve_symbols(v, None, numbers.__getitem__) for k, v in op.attrs}
            if od.fresh_seed is not None and od.fresh_seed(attrs):
                raise InputError(f"validate: {op} draws unseeded random numbers, anew on every call, so it has no "
                                 "reference; give it rng_seed and rng_offset, or pass reference_outputs")
            if od.localize is not None:  # unsharded: the local attributes are the global ones, on this device
                shapes = [concrete.tensor(a).shape if isinstance(a, int) else None for a in op.inputs]
                attrs = od.localize(attrs, Localize(
                    in_global=shapes, in_local=shapes, out_local=concrete.tensor(op.outputs[0]).shape,
                    device=device, in_indices=lambda i, d, shapes=shapes: torch.arange(shapes[i][d])))
            result = od.impl(*(env[a] if isinstance(a, int) else a.value for a in op.inputs), **attrs)
            env.update(zip(op.outputs, result if len(op.outputs) > 1 else (result,)))
            for a in set(op.tensor_inputs):  # dropped after their last use, as large fusions hold much
                if last_use[a] == k and a not in concrete.outputs:
                    del env[a]
    return [env[o] for o in concrete.outputs]


def validate(fd, inputs: Sequence, reference_outputs: Sequence[torch.Tensor] | None = None,
             atol: float | None = None, rtol: float | None = None) -> list[torch.Tensor]:
    """``fd.validate``: ``fd.execute(inputs)``, each returned output checked against its reference (see
    ``FusionDefinition.validate``); returns the outputs."""
    fusion = fd.fusion
    returned = [(p, fusion.outputs[p]) for p in fusion.returned]
    inputs = fd._input_list(inputs)
    if reference_outputs is None:
        if fusion.has_meshes and dist.is_initialized() and dist.world_size() > 1:
            raise InputError("validate: the fusion is sharded over several ranks, whose inputs are local shards; "
                             "its outputs have no reference from them: pass reference_outputs (their GLOBAL "
                             "values; each rank compares its shard)")
        computed = reference(fusion, inputs)  # before execute, which writes aliased inputs
        references = [computed[p] for p, _ in returned]
    else:
        references = [reference_outputs] if isinstance(reference_outputs, torch.Tensor) else list(reference_outputs)
        if len(references) != len(returned) or not all(isinstance(r, torch.Tensor) for r in references):
            raise InputError(f"validate: reference_outputs must hold one tensor per output execute returns "
                             f"({len(returned)}: {', '.join(f'T{o}' for _, o in returned)}), got {len(references)} "
                             "items")
    outputs = fd.execute(inputs)
    plan = fd.plan
    lowered = plan.fusion
    sizes = reduced_sizes(lowered)
    for k, ((p, name), out, ref) in enumerate(zip(returned, outputs, references)):
        t = lowered.tensor(lowered.outputs[p])
        what = f"validate: output {k} (T{name} {t.type_str()})"
        if tuple(ref.shape) != t.shape:
            raise ValidationError(f"{what}: its reference has shape {list(ref.shape)}, the output's global shape "
                                  f"is {list(t.shape)}")
        if reference_outputs is not None:
            ref = shard_tensor(ref, t.sharding, plan.rank) if t.sharding is not None else ref
        ref = ref.to(out.device)
        if not (out.is_floating_point() or out.is_complex()):
            if not torch.equal(ref, out.to(ref.dtype)):
                raise ValidationError(f"{what}: its values differ from the reference's ({ref.dtype}), which must be "
                                      "equal for a non-floating dtype")
            continue
        default_atol, default_rtol = tolerance(t.dtype, sizes.get(lowered.outputs[p], 1))
        a = default_atol if atol is None else atol
        r = default_rtol if rtol is None else rtol
        got = out.to(ref.dtype)
        if not torch.allclose(got, ref, rtol=r, atol=a, equal_nan=True):
            same = (got == ref) | (got.isnan() & ref.isnan())  # what allclose takes as equal (infinities, NaNs)
            diff = (got - ref).abs().masked_fill(same, 0).nan_to_num(nan=math.inf).max().item()
            raise ValidationError(f"{what}: max abs difference {diff:.6g} from its reference, beyond the "
                                  f"tolerance atol={a:.6g}, rtol={r:.6g}")
    return outputs
