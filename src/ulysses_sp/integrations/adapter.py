"""Our function in transformers' ``AttentionInterface``: the contract around an SP attention backend.

Shapes: ``B`` batch, ``N`` query heads, ``K`` kv heads, ``s`` local shard, ``H`` head dim.

    fn(module, q (B,N,s,H), k/v (B,K,s,H), attention_mask, dropout=, scaling=, ..., ulysses_mask=)
      -> (o (B,s,N,H), None)

The global mask travels as the ``ulysses_mask`` keyword that transformers forwards from
``model(...)``. Decoder layers that drop ``**kwargs`` (StableLM, Nemotron, ...) get the mask of the
model call in progress, which a forward pre-hook on the model keeps (:meth:`AttentionAdapter.keep_call_mask`;
also right when gradient checkpointing recomputes the layer in backward).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ulysses_sp.attention import GlobalMask, SPAttention

AttentionFunction = Callable[..., tuple[torch.Tensor, Any]]
"""transformers' attention-function contract: ``fn(module, q, k, v, attention_mask, **kw) -> (o, weights)``."""


class AttentionAdapter:
    """transformers' attention-function contract around ``attention`` (an :class:`SPAttention`).

    Args:
        attention: the SP backend (Ulysses, ring, Ulysses x ring).
        sp_size: the SP degree (1: a raw batch without ``ulysses_mask`` gets a default causal mask).
    """

    def __init__(self, attention: SPAttention, sp_size: int) -> None:
        self.attention = attention
        self.sp_size = sp_size
        self.call_mask: GlobalMask | None = None  # ulysses_mask of the model call in progress

    def keep_call_mask(self, module: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        """Forward pre-hook of the model: the global mask of this ``model(...)`` call (None for a raw batch)."""
        self.call_mask = kwargs.get("ulysses_mask")

    def __call__(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        dropout: float = 0.0,
        scaling: float | None = None,
        sliding_window: int | None = None,
        softcap: float | None = None,
        ulysses_mask: GlobalMask | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        """The ``AttentionInterface`` contract: q ``(B,N,s,H)``, k/v ``(B,K,s,H)`` -> ``(B,s,N,H)``."""
        if key.shape[2] != query.shape[2]:
            raise ValueError(
                "keys are longer than queries (a KV cache?): generation is not supported under Ulysses SP; "
                "call sp.unregister() before generate(), or pass use_cache=False."
            )
        ulysses_mask = self._mask(module, query, attention_mask, ulysses_mask)
        device_type = query.device.type
        if torch.is_autocast_enabled(device_type):
            # under autocast (Trainer / Accelerate bf16) RoPE leaves q, k in fp32 while v is bf16; SDPA and
            # eager matmuls would run in the autocast dtype, so exchange and attend in it
            dtype = torch.get_autocast_dtype(device_type)
            query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
        sinks = kwargs.get("s_aux")  # GPT-OSS style learned sink logits, one per query head
        extra = {} if sinks is None else {"sinks": sinks}
        out = self.attention(
            query, key, value, ulysses_mask, scaling=scaling, sliding_window=sliding_window, softcap=softcap,
            dropout=dropout, **extra,
        )
        return out, None

    def _mask(
        self, module: torch.nn.Module, query: torch.Tensor, attention_mask: torch.Tensor | None,
        ulysses_mask: GlobalMask | None,
    ) -> GlobalMask:
        """The global mask of this call: the keyword, else the model call's, else (one rank, no mask) causal."""
        if ulysses_mask is None:  # a decoder layer that does not forward **kwargs: the call's mask
            ulysses_mask = self.call_mask
        if ulysses_mask is None:
            if self.sp_size > 1 or attention_mask is not None:
                raise ValueError(
                    "the model was called without `ulysses_mask`: feed batches through UlyssesSP.shard(batch) "
                    "(or UlyssesDataLoader) and call model(**sp.model_inputs(batch))."
                )
            return GlobalMask(query.shape[2], causal=getattr(module, "is_causal", True))
        if isinstance(attention_mask, torch.Tensor):
            # models under our key get no mask from transformers (we pass no attention_mask): a tensor here
            # was built by the model itself, e.g. Doge's learned dynamic-mask bias over its local keys
            raise ValueError(
                f"{type(module).__name__} passes its own attention mask / bias ({attention_mask.dtype} "
                f"{tuple(attention_mask.shape)}) to the attention function; Ulysses SP attends with the global "
                "mask only and cannot shard a bias the model computes from its local keys, so this model cannot be "
                "made sequence-parallel (train it with sp_size=1)."
            )
        return ulysses_mask
