"""Compile a fusion for the inputs' sizes into a Plan (cached per input signature) and run it.

Every check of the inputs happens before any communication, and under a process group the
ranks agree on the outcome first, so a bad input on one rank raises the same error on all.
The agreement also compares a fingerprint of the fusion and of the inputs' GLOBAL shapes, so
ranks that pass inconsistent shards (e.g. of a symbolic extent) or define different fusions
raise instead of running mismatched collectives. Process groups are created (a collective
step) only after the ranks agree.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Sequence

import torch

from tp_fusion.passes import run_pipeline
from tp_fusion import ops as _ops
from tp_fusion.errors import (
    DefinitionError,
    ExecutionError,
    InputError,
    LoweringError,
    ShardingError,
    TPFusionError,
)
from tp_fusion.ir import Fusion
from tp_fusion.plan import Plan
from tp_fusion.runtime import dist

_ERRORS = {c.__name__: c for c in (InputError, ShardingError, DefinitionError, LoweringError, ExecutionError)}


def _signature(inputs: Sequence) -> tuple:
    return tuple((tuple(t.shape), t.dtype, t.device) if isinstance(t, torch.Tensor) else type(t)
                 for t in inputs)


def _agrees_every_call() -> bool:
    """When the ranks agree on their inputs: on every call where collectives are host-synchronous
    anyway (gloo: a tiny all_reduce costs nothing next to them), but under NCCL only when a plan is
    compiled (the first call per input signature), since a host round trip per call stalls the GPU
    at small sizes (2x H200: 107 us per agreement; a small MLP took 0.84 ms instead of 0.16).
    Under NCCL, a rank that alone changes its input sizes after a plan is cached waits in an
    agreement its peers do not join, and fails at the host group's timeout (``dist.HOST_TIMEOUT_S``)."""
    return dist.backend() == "gloo"


class Executor:
    """Runs one fusion definition; keeps a plan per input signature."""

    def __init__(self, fusion: Fusion):
        self.fusion = fusion
        self._sharded = fusion.has_meshes
        self._text = str(fusion)
        self._plans: dict[tuple, tuple[Plan, int, str]] = {}

    def run(self, inputs: list) -> tuple[list[torch.Tensor], Plan]:
        sig = _signature(inputs)
        cached, error = self._plans.get(sig), None
        multi = self._sharded and dist.is_initialized() and dist.world_size() > 1
        if cached is None:
            try:
                lowered, device, shapes = prepare(self.fusion, inputs)
                detail = _describe_shapes(self.fusion, shapes)
                fingerprint = _fingerprint(self._text, _agreed_shapes(self.fusion, shapes))
            except TPFusionError as e:
                error = e
            except Exception as e:  # an internal error: still agree, so no peer is left waiting
                if not multi:
                    raise
                error = e
        else:
            plan, fingerprint, detail = cached
        if multi and (cached is None or _agrees_every_call()):
            _agree(error, 0 if error is not None else fingerprint, detail if error is None else "")
        elif error is not None:
            raise error
        if cached is None:
            plan = Plan(lowered, dist.rank(), device)  # creates process groups: after the agreement
            self._plans[sig] = (plan, fingerprint, detail)
        return plan.run(inputs), plan


def _fingerprint(text: str, shapes) -> int:
    digest = hashlib.blake2b(repr((text, shapes)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _agreed_shapes(fusion: Fusion, shapes: list[tuple[int, ...]]) -> tuple:
    """The global input shapes every rank must agree on: those of inputs every rank holds (a rank
    outside a tensor's mesh cannot know its symbolic extents)."""
    world = set(range(dist.world_size()))
    out = []
    for name, shape in zip(fusion.inputs, shapes):
        t = fusion.tensor(name)
        held_by_all = t.sharding is None or world <= set(t.sharding.mesh.devices)
        out.append(tuple(shape) if held_by_all else t.shape)
    return tuple(out)


def _describe_shapes(fusion: Fusion, shapes) -> str:
    return ", ".join(f"T{n} {list(s)}" for n, s in zip(fusion.inputs, shapes))


def _agree(error: Exception | None, fingerprint: int, detail: str) -> None:
    """Raise on every rank if any rank's inputs were rejected, or if the ranks compiled different
    fusions or global shapes (one host-side all_reduce; a gather only when something is wrong)."""
    rank = dist.rank()
    try:
        failed, differ = dist.agree(error is not None, fingerprint)
    except Exception as e:  # a peer left (or failed in an earlier plan): the process group is broken
        raise ExecutionError(dist.report_failure(
            rank, "the input agreement before running the plan", f"{type(e).__name__}: {e}",
            primary=False, exc=e)) from (error or e)
    if not failed and not differ:
        return
    if failed:
        report = None if error is None else (type(error).__name__, str(error))
        reports = dist.gather_from_all(report)
        if error is not None:
            raise error
        bad, (name, msg) = next((r, rep) for r, rep in enumerate(reports) if rep is not None)
        if name not in _ERRORS:  # an internal error while compiling on that rank
            raise ExecutionError(f"rank {bad} failed while compiling the plan: {name}: {msg}")
        raise _ERRORS[name](f"rank {bad} rejected its inputs: {msg}")
    views = dist.gather_from_all((fingerprint, detail))
    counts: dict[int, int] = {}
    for fp, _ in views:
        counts[fp] = counts.get(fp, 0) + 1
    common = max(counts, key=lambda fp: (counts[fp], -next(r for r, v in enumerate(views) if v[0] == fp)))
    ref = next(r for r, v in enumerate(views) if v[0] == common)
    odd = [r for r, v in enumerate(views) if v[0] != common]
    if all(v[1] == views[ref][1] for v in views):
        raise DefinitionError(
            f"execute: rank(s) {odd} defined a different fusion than rank {ref} (different ops, shapes "
            "or shardings); every rank must build the same FusionDefinition")
    lines = "; ".join(f"rank {r}: {views[r][1]}" for r in [ref, *odd])
    raise InputError(
        f"execute: the ranks' inputs imply different global shapes ({lines}); rank(s) {odd} differ from "
        f"rank {ref}. Pass every rank its shard (shard_tensor) of the same global tensors")


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


def _check_mesh_sizes(fusion: Fusion) -> None:
    world = dist.world_size()
    for t in fusion.tensors:
        mesh = t.sharding.mesh if t.sharding is not None else None
        if mesh is not None and max(mesh.devices) >= world:
            raise ShardingError(
                f"T{t.name}: {mesh!r} ({mesh.size} devices) names rank {max(mesh.devices)}, but the process "
                f"group has {world} rank(s) (ranks 0..{world - 1}); build the mesh from "
                "range(dist.get_world_size()) or start more ranks")


def _check_meshes(fusion: Fusion, devices) -> None:
    meshes = {t.sharding.mesh for t in fusion.tensors if t.sharding is not None}
    if meshes and not dist.is_initialized() and any(m.devices != (0,) for m in meshes):
        raise InputError("execute: the fusion is sharded across devices, but no torch.distributed process "
                         "group is initialized; start it under torchrun (or tp_fusion.launch.run_on_ranks) "
                         "and call init_process_group first")
    if dist.is_initialized() and meshes:
        backend = dist.backend()
        want = "cuda" if backend == "nccl" else "cpu"
        for device, name in devices.items():
            if device.type != want:
                raise InputError(f"execute: input T{name} is on {device} with a {backend} process group; use "
                                 "CUDA tensors with NCCL and CPU tensors with gloo")


def _check_symbolic_splits(fusion: Fusion, concrete: Fusion) -> None:
    """A split of a symbolic extent could not be checked when it was scheduled: check it now."""
    for t in fusion.tensors:
        if t.loop is None:
            continue
        for d, n in enumerate(concrete.tensor(t.name).shape):
            if t.shape[d] >= 0 or n < 0:
                continue
            factors = [a.extent for a in t.loop if a.dim == d and a.extent >= 0]
            k = math.prod(factors)
            if n % k != 0:
                by = f"{' x '.join(map(str, factors))} = {k}"
                raise ShardingError(
                    f"T{t.name} {t.type_str()}: dim {d} is symbolic and bound to {n} at execute, but its "
                    f"schedule splits it by {by}, which does not divide {n}; pass a size that is a multiple "
                    f"of {k} or change the split")


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


def prepare(fusion: Fusion, inputs: list) -> tuple[Fusion, torch.device, list[tuple[int, ...]]]:
    """Check the inputs and lower the fusion for their sizes; no communication, no process groups.
    Returns the lowered fusion, the device, and the inputs' global shapes."""
    rank = dist.rank()
    if dist.is_initialized():
        _check_mesh_sizes(fusion)  # before the shapes: a local shape is judged against the mesh
    shapes = _check_inputs(fusion, inputs, rank)
    devices: dict[torch.device, int] = {}
    for name, x in zip(fusion.inputs, inputs):
        devices.setdefault(x.device, name)
    _check_meshes(fusion, devices)
    concrete = concretize(fusion, shapes)
    _check_symbolic_splits(fusion, concrete)
    for t in concrete.tensors:
        if t.sharding is not None:
            t.sharding.check_divides(t.shape, f"T{t.name} {t.type_str()}")
    lowered = run_pipeline(concrete, check=os.environ.get("TP_FUSION_VERIFY", "") not in ("", "0"))
    for t in lowered.tensors:
        if t.sharding is not None:
            t.sharding.check_divides(t.shape, f"T{t.name} {t.type_str()}")
    return lowered, next(iter(devices), torch.device("cpu")), shapes
