"""tp_fusion: a tensor-parallel fusion frontend in the style of nvFuser's multidevice Python API.

The map: ``FusionDefinition`` records ops (``fd.ops.*``, see ``dir(fd.ops)``) on ``TensorView``s with
GLOBAL shapes; ``tv.set_device_mesh(DeviceMesh(...))``, ``tv.outer_split(axis, d)`` and
``tv.axis(axis).parallelize(ParallelType.mesh_x)`` shard them; ``fd.execute(local_inputs)`` runs on
every rank; ``fd.plan`` / ``fd.compile(shapes)`` show the program; ``shard_tensor`` gives a rank's
shard; ``execute_with_dtensors`` takes DTensors; ``tp_fusion.autograd.function`` joins a forward and a
backward fusion into a ``torch.autograd.Function`` for training. Errors derive from ``TPFusionError``. The guide is
docs/guide.md, the code layout docs/architecture.md.
"""

__version__ = "0.2.0"

import numbers

import torch

from tp_fusion.errors import (
    DefinitionError,
    ExecutionError,
    InputError,
    LaunchArgumentError,
    LaunchError,
    LoweringError,
    ShardingError,
    TPFusionError,
    UnevenShardError,
    UnknownOpError,
    UnsupportedPlacementError,
)
from tp_fusion.fusion_definition import FusionDefinition, TensorView
from tp_fusion.mesh import DeviceMesh
from tp_fusion.sharding import sharding as _sharding
from tp_fusion.sharding.sharding import Sharding
from tp_fusion.types import DataType, ParallelType

__all__ = [
    "DataType", "DefinitionError", "DeviceMesh", "ExecutionError", "FusionDefinition", "InputError",
    "LaunchArgumentError", "LaunchError", "LoweringError", "ParallelType", "Sharding", "ShardingError",
    "TPFusionError", "TensorView", "UnevenShardError", "UnknownOpError", "UnsupportedPlacementError",
    "autograd", "execute_with_dtensors", "multidevice", "release_cuda_graphs", "shard_tensor",
]


def release_cuda_graphs() -> None:
    """Release the CUDA graphs plans replay; call before ``torch.distributed.destroy_process_group``
    (``tp_fusion.runtime.dist.destroy_process_group`` does it for you)."""
    from tp_fusion.runtime import graphs

    graphs.release_all()


def shard_tensor(full, tv_or_sharding, rank: int | None = None):
    """The local shard of the whole tensor ``full`` that ``rank`` (default: this rank) holds under the
    sharding of a TensorView (of its schedule, a pending sum done) or a ``Sharding``; a rank outside the
    mesh holds an empty tensor. Wrong kinds of arguments raise ``InputError`` here; the sharding itself is
    ``tp_fusion.sharding.shard_tensor``'s."""
    if not isinstance(full, torch.Tensor):
        hint = "; torch.from_numpy(full) converts a numpy array" if type(full).__module__ == "numpy" else ""
        raise InputError(f"shard_tensor: full must be a torch.Tensor (the whole, unsharded value), got "
                         f"{type(full).__module__}.{type(full).__qualname__}{hint}")
    if not isinstance(tv_or_sharding, (TensorView, Sharding)):
        raise InputError(f"shard_tensor: expected a TensorView (or a Sharding, e.g. fd.output_shardings()[i]) to shard "
                         f"by, got {tv_or_sharding!r}")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, numbers.Integral) or rank < 0):
        raise InputError(f"shard_tensor: rank must be a rank of the process group (an int >= 0), or None for this "
                         f"rank, got {rank!r}")
    return _sharding.shard_tensor(full, tv_or_sharding, rank)


def execute_with_dtensors(fd, dtensors):
    """Run ``fd`` on ``dtensors``, one per fusion input in order: a torch DTensor annotates its input
    with its mesh and placements (kept in ``fd`` afterwards) and passes its local shard; a plain tensor
    is passed as this rank's local input. Returns one DTensor per output, placed as the plan left it
    (``fd.output_shardings()``). Placements tp_fusion cannot take raise ``UnsupportedPlacementError``
    or ``UnevenShardError`` on every rank; the translation is in ``tp_fusion.dtensor``."""
    from tp_fusion.dtensor import execute_with_dtensors as run

    return run(fd, dtensors)


from tp_fusion import autograd, multidevice  # noqa: E402  (multidevice is nvFuser's namespace)
