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

from tp_fusion.errors import (
    DefinitionError,
    EmptyFusionError,
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
    ValidationError,
)
from tp_fusion.fusion_definition import FusionDefinition, TensorView, compute_tensor_descriptor
from tp_fusion.mesh import DeviceMesh
from tp_fusion.sharding.sharding import Partial, Replicate, Shard, Sharding, shard_tensor  # noqa: F401
from tp_fusion.types import DataType, ParallelType

# Partial, Replicate and Shard are importable by name (tp_fusion.Shard) but not exported by ``import *``,
# where they would shadow torch.distributed.tensor's placements of the same names.
__all__ = [
    "DataType", "DefinitionError", "DeviceMesh", "EmptyFusionError", "ExecutionError", "FusionDefinition", "InputError",
    "LaunchArgumentError", "LaunchError", "LoweringError", "ParallelType", "Sharding", "ShardingError",
    "TPFusionError", "TensorView", "UnevenShardError", "UnknownOpError", "UnsupportedPlacementError",
    "ValidationError", "autograd", "compute_tensor_descriptor", "execute_with_dtensors", "multidevice",
    "release_cuda_graphs", "shard_tensor",
]


def release_cuda_graphs() -> None:
    """Release the CUDA graphs plans replay; call before ``torch.distributed.destroy_process_group``
    (``tp_fusion.runtime.dist.destroy_process_group`` does it for you)."""
    from tp_fusion.runtime import graphs

    graphs.release_all()


def execute_with_dtensors(fd, dtensors):
    """Run ``fd`` on ``dtensors``, one per fusion input in order: a torch DTensor annotates its input
    with its mesh and placements (kept in ``fd`` afterwards) and passes its local shard; a plain tensor
    is passed as this rank's local input. Returns one DTensor per output, placed as the plan left it
    (``fd.output_shardings()``). Placements tp_fusion cannot take raise ``UnsupportedPlacementError``
    or ``UnevenShardError`` on every rank; the translation is in ``tp_fusion.dtensor``."""
    from tp_fusion.dtensor import execute_with_dtensors as run

    return run(fd, dtensors)


from tp_fusion import autograd, multidevice  # noqa: E402  (multidevice is nvFuser's namespace)
