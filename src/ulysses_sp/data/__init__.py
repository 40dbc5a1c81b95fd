"""Batch sharding for sequence parallelism.

Main entry points:
    shard_batch(batch, sp_rank, sp_size)   one rank's shard of a global causal-LM batch
    UlyssesDataLoader(loader, sp_rank, sp_size)
                                           a DataLoader wrapper yielding shard_batch(...) per batch
    dp_sampler_kwargs(mesh)                DistributedSampler arguments: split data by DP replica
    validate_same_batch(input_ids, group)  check that an SP group holds one batch
    check_batch(batch, group, packed=...)  every check before sharding (packed rows keep positions,
                                           one batch per SP group), one message per mistake
"""

from ulysses_sp.data.checks import PACKED_KEYS, check_batch, validate_same_batch
from ulysses_sp.data.sharding import ShardedBatch, UlyssesDataLoader, dp_sampler_kwargs, shard_batch

__all__ = ["PACKED_KEYS", "ShardedBatch", "check_batch", "UlyssesDataLoader", "dp_sampler_kwargs", "shard_batch",
           "validate_same_batch"]
