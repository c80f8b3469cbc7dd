"""Compile a fusion for the inputs' sizes into a Plan (cached per input signature) and run it.

Every check of the inputs happens before any communication, and under a process group the
ranks agree on the outcome first, so a bad input on one rank raises the same error on all.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from passes import run_pipeline
from tp_fusion import ops as _ops
from tp_fusion.errors import DefinitionError, InputError, ShardingError, TPFusionError
from tp_fusion.ir import Fusion
from tp_fusion.plan import Plan
from tp_fusion.runtime import dist


def _signature(inputs: Sequence) -> tuple:
    return tuple((tuple(t.shape), t.dtype, t.device) if isinstance(t, torch.Tensor) else type(t)
                 for t in inputs)


class Executor:
    """Runs one fusion definition; keeps a plan per input signature."""

    def __init__(self, fusion: Fusion):
        self.fusion = fusion
        self._plans: dict[tuple, Plan] = {}

    def run(self, inputs: list) -> tuple[list[torch.Tensor], Plan]:
        sig = _signature(inputs)
        plan, error = self._plans.get(sig), None
        if plan is None:
            try:
                plan = compile_plan(self.fusion, inputs)
            except TPFusionError as e:
                error = e
        if self.fusion.has_meshes and dist.is_initialized() and dist.world_size() > 1:
            _agree(error)
        elif error is not None:
            raise error
        self._plans[sig] = plan
        return plan.run(inputs), plan


def _agree(error: TPFusionError | None) -> None:
    """Raise on every rank if any rank's inputs were rejected (a host-side exchange)."""
    if not dist.any_rank_flagged(error is not None):
        return
    reports = dist.gather_from_all(None if error is None else (type(error).__name__, str(error)))
    if error is not None:
        raise error
    bad = next((r, rep) for r, rep in enumerate(reports) if rep is not None)
    cls = next((c for c in (InputError, ShardingError, DefinitionError) if c.__name__ == bad[1][0]), InputError)
    raise cls(f"rank {bad[0]} rejected its inputs: {bad[1][1]}")


def _check_inputs(fusion: Fusion, inputs: list, rank: int) -> list[tuple[int, ...]]:
    """Global shapes of the inputs, from their local shards; raises InputError on any mismatch."""
    names = ", ".join(f"T{i}" for i in fusion.inputs)
    if len(inputs) != len(fusion.inputs):
        raise InputError(f"execute: the fusion takes {len(fusion.inputs)} inputs ({names}), got {len(inputs)}")
    shapes, devices = [], set()
    for name, x in zip(fusion.inputs, inputs):
        t = fusion.tensor(name)
        if not isinstance(x, torch.Tensor):
            raise InputError(f"execute: input T{name} must be a torch.Tensor, got {type(x).__name__}")
        if t.sharding is not None and rank not in t.sharding.mesh:
            shapes.append(t.shape)  # this rank holds no shard of it; its input is ignored
            continue
        if x.dtype != t.dtype.torch:
            raise InputError(f"execute: input T{name} has dtype {x.dtype}, the fusion defines it as "
                             f"{t.dtype.torch}; cast it or change define_tensor's dtype")
        devices.add(x.device)
        local_expected = t.sharding.local_shape(t.shape) if t.sharding else t.shape
        if x.dim() != t.ndim:
            raise InputError(f"execute: input T{name} has {x.dim()} dims {list(x.shape)}, the fusion defines "
                             f"{t.ndim} dims {list(t.shape)}")
        for d, (got, want) in enumerate(zip(x.shape, local_expected)):
            factor = t.sharding.dim_factor(d) if t.sharding else 1
            if want >= 0 and got != want:
                raise InputError(
                    f"execute: input T{name} dim {d} has local extent {got}; its global extent {t.shape[d]} "
                    f"split {factor} ways gives {want}. Pass this rank's shard (shard_tensor) of a "
                    f"{list(t.shape)} tensor; expected local shape {list(local_expected)}")
        shapes.append(t.sharding.global_shape(tuple(x.shape)) if t.sharding else tuple(x.shape))
    if len(devices) > 1:
        raise InputError(f"execute: inputs are on several devices {sorted(map(str, devices))}; use one")
    return shapes


def _check_meshes(fusion: Fusion, devices) -> None:
    meshes = {t.sharding.mesh for t in fusion.tensors if t.sharding is not None}
    world = dist.world_size()
    for mesh in meshes:
        if max(mesh.devices) >= world:
            raise ShardingError(
                f"{mesh!r} names rank {max(mesh.devices)}, but the process group has {world} rank(s) "
                f"(ranks 0..{world - 1}); build the mesh from range(dist.get_world_size())")
    if meshes and not dist.is_initialized() and any(m.devices != (0,) for m in meshes):
        raise InputError("execute: the fusion is sharded across devices, but no torch.distributed process "
                         "group is initialized; start it under torchrun (or tp_fusion.launch.run_on_ranks) "
                         "and call init_process_group first")
    if dist.is_initialized() and meshes:
        backend = dist.backend()
        for device in devices:
            if (device.type == "cuda") != (backend == "nccl"):
                raise InputError(f"execute: inputs on {device} with a {backend} process group; use CUDA tensors "
                                 "with NCCL and CPU tensors with gloo")


def concretize(fusion: Fusion, input_shapes: list[tuple[int, ...]]) -> Fusion:
    """The fusion with every symbolic extent bound, shapes re-inferred from the inputs' sizes."""
    tensors = list(fusion.tensors)
    for name, shape in zip(fusion.inputs, input_shapes):
        tensors[name] = tensors[name].replace(shape=tuple(shape), loop=None)
    for op in fusion.ops:
        args = [(tensors[a].shape, tensors[a].dtype) if isinstance(a, int) else a.value for a in op.inputs]
        attrs = dict(op.attrs)
        try:
            outs = _ops.infer(op.kind, args, attrs, lambda op=op: ", ".join(
                f"T{a} {tensors[a].type_str()}" for a in op.tensor_inputs))
        except DefinitionError as e:
            raise InputError(f"execute: the inputs' sizes do not fit the fusion: {e}") from None
        for o, (shape, _) in zip(op.outputs, outs):
            tensors[o] = tensors[o].replace(shape=shape, loop=None)
    return fusion.replace(tensors=tuple(tensors))


def compile_plan(fusion: Fusion, inputs: list) -> Plan:
    rank = dist.rank()
    shapes = _check_inputs(fusion, inputs, rank)
    devices = {x.device for x in inputs if isinstance(x, torch.Tensor)}
    _check_meshes(fusion, devices)
    concrete = concretize(fusion, shapes)
    for t in concrete.tensors:
        if t.sharding is not None:
            t.sharding.check_divides(t.shape, f"T{t.name} {t.type_str()}")
    lowered = run_pipeline(concrete, check=os.environ.get("TP_FUSION_VERIFY", "") not in ("", "0"))
    for t in lowered.tensors:
        if t.sharding is not None:
            t.sharding.check_divides(t.shape, f"T{t.name} {t.type_str()}")
    device = next(iter(devices), torch.device("cpu"))
    return Plan(lowered, rank, device)
