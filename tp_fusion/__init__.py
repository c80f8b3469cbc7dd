"""tp_fusion: a tensor-parallel fusion frontend in the style of nvFuser's multidevice Python API."""

from sharding.sharding import Partial, Replicate, Shard, Sharding, shard_tensor
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
    "TPFusionError", "TensorView", "execute_with_dtensors", "shard_tensor",
]


def execute_with_dtensors(fd, dtensors):
    """Run ``fd`` on DTensor inputs; see ``tp_fusion.dtensor``."""
    from tp_fusion.dtensor import execute_with_dtensors as run

    return run(fd, dtensors)
