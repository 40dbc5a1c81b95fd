"""Batch sharding for sequence parallelism.

Main entry points:
    shard_batch(batch, sp_rank, sp_size)   one rank's shard of a global causal-LM batch
    UlyssesDataLoader(loader, sp_rank, sp_size)
                                           a DataLoader wrapper yielding shard_batch(...) per batch
    dp_sampler_kwargs(mesh)                DistributedSampler arguments: split data by DP replica
    validate_same_batch(input_ids, group)  check that an SP group holds one batch
"""

from ulysses_sp.data.sharding import (
    ShardedBatch,
    UlyssesDataLoader,
    dp_sampler_kwargs,
    shard_batch,
    validate_same_batch,
)

__all__ = ["ShardedBatch", "UlyssesDataLoader", "dp_sampler_kwargs", "shard_batch", "validate_same_batch"]
