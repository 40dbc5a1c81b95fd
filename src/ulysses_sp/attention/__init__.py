"""Sequence-parallel attention: the global mask, the core kernels and the backends.

    GlobalMask                     the mask of the global sequence, O(B*S), shared by all layers
    build_attention(backend, group, kernel)
                                   the backend of ``UlyssesSPConfig.sp_backend``:
    UlyssesAttention(group, kernel)    all-to-all to heads around an unchanged kernel
    RingAttention(group)               k/v blocks passed around the ring
    SPAttentionBackend             their base: the call prologue (first-call check, default mask)
    KERNELS / get_kernel(name)     sdpa, eager, flex_attention, flash_attention_2/3, torch_varlen
                                   on the full sequence (sdpa: packed documents in length buckets)
"""

from ulysses_sp.attention.backends import build_attention
from ulysses_sp.attention.contract import SPAttention, SPAttentionBackend, check_inputs_across_ranks, check_qkv_shapes
from ulysses_sp.attention.kernels import KERNELS, SDPA_NO_SINKS, flash_supports_sinks, get_kernel
from ulysses_sp.attention.masks import GlobalMask, document_ids_from_position_ids
from ulysses_sp.attention.ring import RingAttention
from ulysses_sp.attention.ulysses import UlyssesAttention

__all__ = [
    "KERNELS", "GlobalMask", "RingAttention", "SPAttention", "SPAttentionBackend", "UlyssesAttention",
    "build_attention", "SDPA_NO_SINKS", "check_inputs_across_ranks", "check_qkv_shapes",
    "document_ids_from_position_ids", "flash_supports_sinks", "get_kernel",
]
