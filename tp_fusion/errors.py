"""One hierarchy for every error tp_fusion raises on purpose.

Messages say what failed, which tensor and axis, the sizes, and what to change.
"""


class TPFusionError(Exception):
    """Base of every error the library raises on purpose."""


class DefinitionError(TPFusionError, ValueError):
    """An op recorded with operands whose shapes, dtypes or arguments do not fit."""


class EmptyFusionError(DefinitionError, NotImplementedError):
    """``execute``, ``compile`` or ``validate`` of a fusion without outputs (nvFuser raises a NotImplementedError)."""


class UnknownOpError(DefinitionError, AttributeError):
    """``fd.ops.<name>`` for an op that does not exist; the message lists the ops there are."""


class ShardingError(TPFusionError, ValueError):
    """A bad mesh or sharding schedule (non-dividing split, axis out of range, ...)."""


class InputError(TPFusionError, ValueError):
    """Inputs handed to ``execute`` that do not match the fusion or their sharding; arguments of
    ``compile`` and ``shard_tensor``, which stand for or make such inputs, that do not fit."""


class LoweringError(TPFusionError, NotImplementedError):
    """An op or a resharding the library cannot lower."""


class ExecutionError(TPFusionError, RuntimeError):
    """A rank failed while running a plan; says which rank and in which segment."""


class ValidationError(TPFusionError, AssertionError):
    """``fd.validate``: an output that differs from its reference beyond the tolerance (the message names the
    output and the largest difference)."""


class UnsupportedPlacementError(LoweringError):
    """A DTensor placement that cannot annotate a fusion input (Partial, strided, one dim on two mesh axes)."""


class UnevenShardError(ShardingError):
    """A DTensor input whose sharded dim does not split evenly across its mesh axis."""


class LaunchError(TPFusionError, RuntimeError):
    """Ranks that ``tp_fusion.launch`` could not start (``run_on_ranks`` under torchrun) or that failed."""


class LaunchArgumentError(TPFusionError, ValueError, TypeError):
    """``run_on_ranks`` given what it cannot start ranks with: an ``nproc`` that is no positive integer, or
    an ``fn`` that cannot be pickled. Both a ValueError and a TypeError, so that code catching the
    built-in one of either case catches it."""


class RanksFailed(LaunchError):
    """Some spawned ranks failed: ``exitcodes`` per rank (None: killed), ``failures`` rank -> traceback."""

    def __init__(self, message: str, exitcodes: list, failures: dict[int, str]):
        super().__init__(message)
        self.exitcodes, self.failures = exitcodes, failures
