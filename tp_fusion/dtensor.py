"""DTensor interop: run a fusion on torch DTensors and get DTensors back.

``execute_with_dtensors(fd, dtensors)`` (the name nvFuser uses) reads each DTensor input's torch
DeviceMesh and placements, annotates the matching fusion input with them, runs ``fd.execute`` on
the local shards (``dt.to_local()``) and wraps every output shard in a DTensor with the placements
the plan produced (``fd.output_shardings()``).

Translation (both sides index placements by mesh axis 0..n-1, axis 0 outermost):

- the torch mesh's rank layout (``device_mesh.mesh``) becomes a ``tp_fusion.DeviceMesh`` of the
  same shape; ``Shard(d)`` on mesh axis ``a`` becomes ``outer_split`` of dim ``d`` by the axis's
  size plus ``parallelize`` on the parallel type of axis ``a`` (``mesh_x`` is the LAST axis, so on
  a 2-D mesh axis 1 is ``mesh_x`` and axis 0 is ``mesh_y``); ``Replicate()`` adds nothing.
- supported: ``Shard(dim)``, ``_StridedShard(dim, split_factor)`` and ``Replicate()`` on 1-D, 2-D
  (and 3-D) meshes, evenly, a dim on one mesh axis or several. DTensor applies placements left to
  right (mesh axis 0 first), each on what the axes before it left; ``split_factor`` counts the pieces
  outside the device piece at that point. tp_fusion's ``Shard(dim, outer)`` counts them in the global
  dim; the two are translated both ways (``_split_factors``, ``_global_outers``), and a strided shard
  becomes the matching splits of the input's loop domain. ``Partial`` inputs, and a strided shard
  that straddles another mesh axis' piece, raise ``UnsupportedPlacementError`` (a
  ``NotImplementedError``); uneven shards raise ``UnevenShardError`` (a ``ValueError``). Every rank
  raises the same error, before any communication of the fusion starts.
- a DTensor on a submesh that differs between ranks (``mesh_2d["tp"]``) is rejected: the fusion
  must be the same on every rank. Pass DTensors on the full mesh instead.

What happens to ``fd`` (as in nvFuser, annotating inputs is the point): each input that receives a
DTensor keeps the mesh and sharding of that DTensor afterwards, exactly as if the schedule had been
written by hand, so ``print(fd)`` shows it and a later ``fd.execute`` with local shards expects
them. An input the user scheduled by hand must agree with its DTensor (else ``ShardingError``);
annotations made by an earlier ``execute_with_dtensors`` are replaced when the placements change
(which recompiles, as any schedule change does). Plain ``torch.Tensor`` inputs are passed through
unchanged. Nothing else of ``fd`` changes. Forward only, as ``execute``: training with DTensor
weights goes through ``tp_fusion.autograd.function``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch

from tp_fusion.compile import scalar_inputs
from tp_fusion.errors import InputError, ShardingError, TPFusionError, UnevenShardError, UnsupportedPlacementError
from tp_fusion.executor import raise_reported, report_of
from tp_fusion.fusion_definition import FusionDefinition, TensorView
from tp_fusion.loop import pieces
from tp_fusion.mesh import DeviceMesh
from tp_fusion.runtime import dist
from tp_fusion.sharding.sharding import REPLICATE, Partial, Replicate, Shard, Sharding
from tp_fusion.types import ParallelType


@functools.cache
def _dtensor_api():
    """torch's ``DTensor``, ``Shard``, ``Replicate``, ``Partial`` and ``DeviceMesh``, imported on first
    use: the rest of tp_fusion never needs them."""
    from types import SimpleNamespace

    from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    return SimpleNamespace(DTensor=DTensor, Shard=Shard, StridedShard=_StridedShard, Replicate=Replicate,
                           Partial=Partial, DeviceMesh=TorchDeviceMesh)


def mesh_from_torch(device_mesh) -> DeviceMesh:
    """The tp_fusion DeviceMesh with the same rank layout as a torch DeviceMesh."""
    mesh = DeviceMesh(device_mesh.mesh.detach().cpu())
    _check_increasing(mesh)
    return mesh


def _check_increasing(mesh: DeviceMesh) -> None:
    """UnsupportedPlacementError unless the ranks increase along every axis of ``mesh``. torch places a
    DTensor's shards by the rank order of each mesh axis' process group, which sorts its ranks, not by
    the order the mesh lists them in (``DeviceMesh("cpu", [1, 0])`` gives rank 0 the first shard): such
    a mesh would give tp_fusion and torch different data."""
    for axis in range(len(mesh.shape)):
        if mesh.unordered_group(axis) is not None:
            raise UnsupportedPlacementError(
                f"execute_with_dtensors: {mesh!r} lists the ranks of mesh axis {axis} out of increasing order; "
                "torch places DTensor shards by each axis' sorted ranks, so list them in increasing order")


def sharding_from_dtensor(dt, what: str = "DTensor") -> Sharding:
    """The tp_fusion Sharding of a DTensor; raises for placements tp_fusion cannot take."""
    api = _dtensor_api()
    mesh = mesh_from_torch(dt.device_mesh)
    placements = []
    for axis, p in enumerate(dt.placements):
        if isinstance(p, (api.Shard, api.StridedShard)):  # torch 2.13's strided shard is no Shard
            placements.append(Shard(p.dim % dt.ndim, getattr(p, "split_factor", 1)))
        elif isinstance(p, api.Replicate):
            placements.append(REPLICATE)
        elif p.is_partial():
            raise UnsupportedPlacementError(
                f"{what}: mesh axis {axis} holds a Partial placement ({p!r}); tp_fusion takes only Shard(dim) and "
                "Replicate() inputs. "
                "Reduce it first, e.g. dt.redistribute(dt.device_mesh, [Replicate()] * dt.device_mesh.ndim)")
        else:
            raise UnsupportedPlacementError(
                f"{what}: mesh axis {axis} holds {p!r}; tp_fusion takes only Shard(dim) and Replicate() "
                "placements. Redistribute the DTensor to one of those first")
    sharding = Sharding(mesh, _global_outers(placements, mesh, f"{what} ({_fmt(dt.placements)})"))
    for dim in sorted({p.dim for p in placements if isinstance(p, Shard)}):
        axes = [a for a, _ in sharding.dim_shards(dim)]
        n, factor = dt.shape[dim], sharding.dim_factor(dim)
        if n % factor != 0:
            raise UnevenShardError(
                f"{what}: global shape {list(dt.shape)} shards dim {dim} (extent {n}) across {factor} devices "
                f"on mesh axes {axes}, which is uneven ({n} % {factor} = {n % factor}). Pad dim {dim} to a "
                f"multiple of {factor}, or Replicate it")
        sharding.dim_view(dim, n)  # the pieces fit the extent
    return sharding


def _global_outers(placements: list, mesh: DeviceMesh, what: str) -> tuple:
    """DTensor's left-to-right placements (a Shard's ``outer`` holding its local split factor) with each
    ``outer`` counted in the global dim instead."""
    out = list(placements)
    for axis, p in enumerate(placements):
        if not isinstance(p, Shard):
            continue
        placed = sorted((q.outer, mesh.shape[a]) for a, q in enumerate(out[:axis]) if isinstance(q, Shard)
                        and q.dim == p.dim)
        outer, m = p.outer, mesh.shape[axis]
        for o, n in placed:  # restore the pieces taken before, outermost first
            if outer >= o and outer % o == 0:
                outer *= n  # inside that piece's rest
            elif outer * m > o:
                raise UnsupportedPlacementError(
                    f"{what}: the shard of dim {p.dim} on mesh axis {axis} straddles the piece another mesh axis "
                    "took; tp_fusion shards a dim only at places of a split. Redistribute the DTensor first")
        out[axis] = Shard(p.dim, outer)
    return tuple(out)


def _split_factors(sharding: Sharding) -> list:
    """Per mesh axis, a Shard's ``outer`` as DTensor's left-to-right split factor (see the docstring)."""
    out = []
    for axis, p in enumerate(sharding.placements):
        if isinstance(p, Shard):
            taken = [sharding.mesh.shape[a] for a, q in enumerate(sharding.placements[:axis])
                     if isinstance(q, Shard) and q.dim == p.dim and q.outer < p.outer]
            out.append(p.outer // math.prod(taken))
        else:
            out.append(None)
    return out


def _fmt(placements) -> str:
    return "(" + ", ".join(map(str, placements)) + ")"


def _annotate(fd: FusionDefinition, tv: TensorView, sharding: Sharding, shape, what: str) -> None:
    """Give ``tv`` (of global ``shape``) ``sharding`` through its schedule methods (a no-op if it has it)."""
    if tv.sharding == sharding:
        return
    ours = getattr(fd, "_dtensor_annotated", frozenset())
    if tv._ir.annotated and tv.name not in ours:
        raise ShardingError(
            f"{what}: T{tv.name} is scheduled as {tv.sharding}, but its DTensor is {sharding}; drop the "
            "hand-written schedule of this input or redistribute the DTensor to match it")
    tv._update(loop=None, sharding=None, annotated=False)
    mesh = sharding.mesh
    tv.set_device_mesh(mesh)
    for dim in reversed(range(tv.ndim)):  # right to left: loop indices of the dims before stay valid
        view = sharding.dim_view(dim, shape[dim])
        if all(axis is None for _, axis in view):
            continue
        at = pieces(tv._loop(), dim)[0]  # past reduction axes kept in place before it (a sum's r{T})
        for i, (extent, _) in enumerate(view[:-1]):  # [e0, e1, ..., rest]: an outer split per piece but the last
            tv.outer_split(at + i, extent)
        for i, (_, axis) in enumerate(view):
            if axis is not None:
                tv.axis(at + i).parallelize(ParallelType.for_mesh_axis(axis, mesh.ndim))
    fd._dtensor_annotated = ours | {tv.name}


def schedule_output(fd: FusionDefinition, index: int, sharding: Sharding, shape, what: str) -> None:
    """Give output ``index`` of ``fd`` (of global ``shape``) ``sharding``, unless the user scheduled it:
    autograd computes each gradient of a DTensor input in that input's sharding, so that it is
    reduce_scattered, not allreduced and then sliced."""
    tv = TensorView(fd, fd.fusion.outputs[index])
    if tv._ir.annotated and tv.name not in getattr(fd, "_dtensor_annotated", frozenset()):
        return
    _annotate(fd, tv, sharding, shape, what)


def _agree_on_inputs(shardings: list[Sharding | None], error: Exception | None) -> None:
    """Raise on every rank if any rank's DTensor inputs were refused, or if the ranks' DTensors differ
    in mesh or placements (one host-side gather): each rank annotates its fusion from its own DTensors,
    so the fusions must come out alike."""
    if not dist.is_initialized() or dist.world_size() == 1:
        if error is not None:
            raise error
        return
    key = [None if s is None else (s.mesh.devices, s.mesh.shape, str(s)) for s in shardings]
    everyone = dist.gather_from_all((key, report_of(error)))
    raise_reported([report for _, report in everyone], error)
    for r, (other, _) in enumerate(everyone):
        i = next((i for i, (a, b) in enumerate(zip(key, other)) if a != b), None)
        if i is None:
            continue
        mine, theirs = shardings[i], other[i]
        if mine is not None and theirs is not None and (mine.mesh.devices, mine.mesh.shape) == theirs[:2]:
            raise UnsupportedPlacementError(
                f"execute_with_dtensors: input {i} is a DTensor sharded as {mine} on rank {dist.rank()} but as "
                f"{theirs[2]} on rank {r}; every rank must pass DTensors of the same placements")
        fix = ("a submesh such as mesh_2d['tp'] differs between ranks, and a fusion must be the same on every rank. "
               "Build the DTensors on the full mesh (e.g. placements (Replicate(), Shard(d)) on the 2-D mesh)"
               if mine is not None and theirs is not None else "pass a DTensor for it on every rank or on none")
        raise UnsupportedPlacementError(
            f"execute_with_dtensors: input {i} is {_passed_as(key[i])} on rank {dist.rank()} but {_passed_as(theirs)} "
            f"on rank {r}; {fix}")


def _passed_as(key) -> str:
    """An input as a rank passed it, from its entry in ``_agree_on_inputs``' key: a DTensor on its mesh
    (printed as a DeviceMesh, whatever rank it came from), or a plain tensor (None)."""
    if key is None:
        return "a plain tensor"
    devices, shape, _ = key
    return f"a DTensor on mesh {DeviceMesh(torch.tensor(devices).reshape(shape))!r}"


def _torch_placements(sharding: Sharding) -> list:
    api = _dtensor_api()
    out = []
    for p, factor in zip(sharding.placements, _split_factors(sharding)):
        if isinstance(p, Shard):
            out.append(api.Shard(p.dim) if factor == 1 else api.StridedShard(p.dim, split_factor=factor))
        elif isinstance(p, Replicate):
            out.append(api.Replicate())
        else:
            assert isinstance(p, Partial), p
            out.append(api.Partial(p.op))
    return out


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for e in reversed(shape):
        stride.append(acc)
        acc *= max(e, 1)
    return tuple(reversed(stride))


def _read_inputs(fd: FusionDefinition, inputs: list, local: list, shardings: list, torch_meshes: dict) -> None:
    """Each input's local tensor and sharding (None for a plain tensor), and the torch meshes by tp_fusion
    mesh, into ``local``, ``shardings`` and ``torch_meshes``; raises for inputs the fusion cannot take."""
    api = _dtensor_api()
    names = list(fd.fusion.inputs)
    if len(inputs) != len(names):
        raise InputError(f"execute_with_dtensors: the fusion takes {len(names)} inputs "
                         f"({', '.join(f'T{n}' for n in names)}), got {len(inputs)}")
    for i, (name, x) in enumerate(zip(names, inputs)):
        what = f"execute_with_dtensors: input {i} (T{name})"
        if isinstance(x, api.DTensor):
            tv = TensorView(fd, name)
            if tv.ndim != x.ndim or any(e not in (-1, g) for e, g in zip(tv.shape, x.shape)):
                raise InputError(f"{what}: the DTensor's global shape {list(x.shape)} does not match the fusion's "
                                 f"{list(tv.shape)} (-1 = any); define_tensor takes the GLOBAL shape")
            sharding = sharding_from_dtensor(x, what)
            shardings.append(sharding)
            torch_meshes.setdefault(sharding.mesh, x.device_mesh)
            local.append(x.to_local())
        elif isinstance(x, torch.Tensor) or name in scalar_inputs(fd.fusion):  # (execute checks a scalar's value)
            shardings.append(None)
            local.append(x)
        else:
            raise InputError(f"{what} must be a DTensor or a torch.Tensor, got {type(x).__name__}")


def execute_with_dtensors(fd: FusionDefinition, dtensors: Sequence) -> list:
    """Run ``fd`` on DTensor inputs (one per fusion input, in order; one tensor alone as a list of one,
    as ``fd.execute`` takes it); returns one DTensor per output.

    Each DTensor input annotates its fusion input with its mesh and placements (see the module
    docstring for what this does to ``fd``); plain tensors are passed through as local inputs, and so
    are the numbers given for scalar inputs.
    Outputs are DTensors on the torch mesh of the inputs (a new torch DeviceMesh if an output's
    mesh is none of theirs) with the placements in ``fd.output_shardings()``, the global shape and
    contiguous global strides.
    """
    api = _dtensor_api()
    inputs = fd._input_list(dtensors)
    local: list = []
    shardings: list[Sharding | None] = []
    torch_meshes: dict[DeviceMesh, object] = {}
    error = None
    try:
        _read_inputs(fd, inputs, local, shardings, torch_meshes)
    except TPFusionError as e:  # raised on every rank below, before any rank annotates its fusion
        error = e
    _agree_on_inputs(shardings, error)
    for i, (name, sharding) in enumerate(zip(fd.fusion.inputs, shardings)):
        if sharding is not None:
            _annotate(fd, TensorView(fd, name), sharding, tuple(inputs[i].shape),
                      f"execute_with_dtensors: input {i} (T{name})")

    outputs = fd.execute(local)

    plan = fd.plan
    default_mesh = next(iter(torch_meshes.items()), None)
    result = []
    for name, out, sharding in zip(plan.returned(), outputs, fd.output_shardings()):
        if sharding.mesh is None:  # no mesh: the same full value on every rank
            if default_mesh is None:
                raise InputError("execute_with_dtensors: no input is a DTensor; use fd.execute")
            sharding = Sharding.replicated(default_mesh[0])
        tmesh = torch_meshes.get(sharding.mesh)
        if tmesh is None:
            _check_increasing(sharding.mesh)
            ranks = torch.tensor(sharding.mesh.devices).reshape(sharding.mesh.shape)
            tmesh = torch_meshes[sharding.mesh] = _dtensor_api().DeviceMesh(out.device.type, ranks)
        shape = plan.fusion.tensor(name).shape
        result.append(api.DTensor.from_local(out, tmesh, _torch_placements(sharding), run_check=False,
                                             shape=torch.Size(shape), stride=_contiguous_stride(shape)))
    return result
