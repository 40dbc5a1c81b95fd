"""ulysses-sp: train Hugging Face language models on very long sequences with Ulysses sequence parallelism.

Main entry points (all importable from ``ulysses_sp``):
    UlyssesSPConfig                 the one configuration object: sp_size, sp_backend ("ulysses" |
                                    "ring"), sp_ring_size (Ulysses x ring when sp_size > heads),
                                    sp_attn_implementation, tiled MLP / loss, offload
    UlyssesTrainer / UlyssesSFTTrainer
                                    Transformers Trainer / TRL SFTTrainer with SP (sp_config=...)
    UlyssesAccelerate               a custom Accelerate loop with SP; config_from_accelerate
    UlyssesSP(model, mesh, config)  any supported HF causal LM in a plain torchrun loop
    SPMesh.from_world(sp_size)      split an initialised torch.distributed world into dp x sp groups
    UlyssesAttention / RingAttention / build_attention
                                    exact attention over a sequence sharded across sp ranks
    GlobalMask, shard_batch, UlyssesDataLoader, global_num_items, reported_loss, tiled_token_loss
                                    the layers underneath (data, loss)
    answer_scores, AnswerScores     teacher-forced passkey / needle scores under SP (eval-long)
    apply_tiled_mlp, ActivationOffload, estimate_peak_memory
                                    memory features and the peak-memory estimator
    CommCounter, attention_comm     communication instrumentation and its formulas
    ulysses-sp (CLI)                `train` (the main job), `eval-long`, `plan`, `bench`, `check`, `demo`:
                                    applications of the names above (ulysses_sp.cli)

Names that need transformers / accelerate / trl (the integrations) load on first use, so
``import ulysses_sp`` needs only torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from ulysses_sp.attention import (
    KERNELS,
    GlobalMask,
    RingAttention,
    SPAttention,
    UlyssesAttention,
    build_attention,
    get_kernel,
)
from ulysses_sp.comm import (
    DEFAULT_TIMEOUT_S,
    AttentionComm,
    CommCounter,
    SPMesh,
    all_reduce_sum,
    attention_comm,
    check_same_across_ranks,
    check_sp_size,
    close_world,
    collective_device,
    free_port,
    gather_signature,
    local_backend,
    spawn,
)
from ulysses_sp.config import ATTN_IMPLEMENTATIONS, IGNORE_INDEX, SP_BACKENDS, UlyssesSPConfig, auto_ring_size
from ulysses_sp.data import (
    PACKED_KEYS,
    ShardedBatch,
    UlyssesDataLoader,
    check_batch,
    dp_sampler_kwargs,
    shard_batch,
    validate_same_batch,
)
from ulysses_sp.loss import (
    AnswerScores,
    answer_positions,
    answer_scores,
    global_num_items,
    reported_loss,
    sp_token_loss,
    tiled_token_loss,
)
from ulysses_sp.memory import (
    ActivationOffload,
    MemoryBreakdown,
    MemoryFeatures,
    ModelDims,
    OffloadStats,
    TiledMLP,
    TiledMoE,
    apply_tiled_mlp,
    estimate_peak_memory,
    longest_sequence,
    memory_mark,
    memory_peak,
    process_status_bytes,
    remove_tiled_mlp,
)

__version__ = "0.1.0"

# name -> module, imported on first access (these import transformers, accelerate or trl)
_LAZY = {
    "UlyssesSP": "ulysses_sp.integrations.transformers",
    "check_model_support": "ulysses_sp.integrations.transformers",
    "unsupported_reasons": "ulysses_sp.integrations.transformers",
    "UlyssesTrainer": "ulysses_sp.integrations.trainer",
    "UlyssesTrainerMixin": "ulysses_sp.integrations.trainer",
    "UlyssesSFTTrainer": "ulysses_sp.integrations.trl",
    "feed_global_length": "ulysses_sp.integrations.rope",
    "UlyssesAccelerate": "ulysses_sp.integrations.accelerate",
    "config_from_accelerate": "ulysses_sp.integrations.accelerate",
    "current_attn_implementation": "ulysses_sp.integrations.hf_internals",
    "unregister_attention_function": "ulysses_sp.integrations.hf_internals",
}

__all__ = [
    "ATTN_IMPLEMENTATIONS", "DEFAULT_TIMEOUT_S", "IGNORE_INDEX", "KERNELS", "PACKED_KEYS", "SP_BACKENDS",
    "ActivationOffload", "AnswerScores", "AttentionComm", "CommCounter", "GlobalMask", "MemoryBreakdown",
    "MemoryFeatures", "ModelDims", "OffloadStats", "RingAttention", "SPAttention", "SPMesh", "ShardedBatch",
    "TiledMLP", "TiledMoE", "UlyssesAttention", "UlyssesDataLoader", "UlyssesSPConfig",
    "all_reduce_sum", "answer_positions", "answer_scores", "apply_tiled_mlp", "attention_comm", "auto_ring_size",
    "build_attention", "check_batch", "check_same_across_ranks", "check_sp_size", "close_world", "collective_device",
    "dp_sampler_kwargs", "estimate_peak_memory", "free_port", "gather_signature", "get_kernel", "global_num_items",
    "local_backend", "longest_sequence", "memory_mark", "memory_peak", "process_status_bytes", "remove_tiled_mlp",
    "reported_loss", "shard_batch", "sp_token_loss", "spawn",
    "tiled_token_loss", "validate_same_batch",
    *_LAZY, "__version__",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ulysses_sp' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
