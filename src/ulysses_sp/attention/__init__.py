"""The Ulysses attention layer, the global mask and the core-kernel adapters."""

from ulysses_sp.attention.kernels import KERNELS, get_kernel
from ulysses_sp.attention.masks import GlobalMask, document_ids_from_position_ids
from ulysses_sp.attention.ring import RingAttention
from ulysses_sp.attention.ulysses import UlyssesAttention

__all__ = ["KERNELS", "GlobalMask", "RingAttention", "UlyssesAttention", "document_ids_from_position_ids", "get_kernel"]
