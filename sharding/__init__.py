"""Sharding state of a tensor, per-op propagation rules, shard/unshard of real tensors."""

from tp_fusion.sharding.sharding import Partial, Replicate, Shard, Sharding, shard_tensor, unshard_tensor

__all__ = ["Partial", "Replicate", "Shard", "Sharding", "shard_tensor", "unshard_tensor"]
