"""tp_fusion: a tensor-parallel fusion frontend in the style of nvFuser's multidevice Python API."""

from tp_fusion.sharding.sharding import Partial, Replicate, Shard, Sharding, shard_tensor
from tp_fusion.errors import (
    DefinitionError,
    ExecutionError,
    InputError,
    LoweringError,
    ShardingError,
    TPFusionError,
)
from tp_fusion.fusion_definition import FusionDefinition, TensorView
from tp_fusion.mesh import DeviceMesh
from tp_fusion.types import DataType, ParallelType

__all__ = [
    "DataType", "DefinitionError", "DeviceMesh", "ExecutionError", "FusionDefinition", "InputError",
    "LoweringError", "ParallelType", "Partial", "Replicate", "Shard", "Sharding", "ShardingError",
    "TPFusionError", "TensorView", "execute_with_dtensors", "release_cuda_graphs", "shard_tensor",
]


def release_cuda_graphs() -> None:
    """Release the CUDA graphs plans replay; call before ``torch.distributed.destroy_process_group``
    (``tp_fusion.runtime.dist.destroy_process_group`` does it for you)."""
    from tp_fusion.runtime import graphs

    graphs.release_all()


def execute_with_dtensors(fd, dtensors):
    """Run ``fd`` on DTensor inputs; see ``tp_fusion.dtensor``."""
    from tp_fusion.dtensor import execute_with_dtensors as run

    return run(fd, dtensors)
