"""Which models can run sequence-parallel, and with which core kernel: checks that need no process group.

    check_model_support(model, config)  -> the kernel, or ValueError naming every reason it cannot
    unsupported_reasons(model, sp_size, kernel, backend, ring_size) -> the reasons (empty: supported)

The CLI and scripts call these before launching anything; ``UlyssesSP`` calls them at construction.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from ulysses_sp.attention import KERNELS, SDPA_NO_SINKS, flash_supports_sinks
from ulysses_sp.config import UlyssesSPConfig, auto_ring_size
from ulysses_sp.integrations.hf_internals import current_attn_implementation, dispatches_attention
from ulysses_sp.mixers import unsupported_mixer_reasons

KEY_PREFIX = "ulysses_sp"
"""Every ``AttentionInterface`` key a ``UlyssesSP`` registers starts with it."""
_SUPPORTED_LAYER_TYPES = {"full_attention", "sliding_attention", "chunked_attention"}


def base_model(model: torch.nn.Module) -> PreTrainedModel:
    """The ``PreTrainedModel`` inside PEFT / DDP / FSDP / DeepSpeed wrappers."""
    seen = model
    for _ in range(6):
        if isinstance(seen, PreTrainedModel):
            return seen
        if hasattr(seen, "get_base_model"):
            seen = seen.get_base_model()
        elif hasattr(seen, "module"):
            seen = seen.module
        else:
            break
    raise ValueError(
        f"{type(model).__name__} is not a transformers PreTrainedModel (nor a PEFT / DDP / DeepSpeed "
        "wrapper of one); UlyssesSP needs a Hugging Face causal LM."
    )


def unsupported_reasons(
    model: PreTrainedModel, sp_size: int, kernel: str, backend: str = "ulysses", ring_size: int | None = None
) -> list[str]:
    """Why ``model`` cannot run under sequence parallelism with ``kernel`` / ``backend`` (empty: it can).

    ``ring_size``: ``UlyssesSPConfig.sp_ring_size`` (Ulysses x ring; None = automatic).
    """
    config = model.config.get_text_config()
    reasons = []
    if getattr(model.config, "is_encoder_decoder", False):
        reasons.append("encoder-decoder models are not supported; Ulysses SP here shards decoder-only causal LMs")
    elif bidirectional := _bidirectional_attention(model):
        reasons.append(
            f"its attention is bidirectional ({bidirectional} has is_causal=False: an encoder such as "
            "BERT, or a decoder config without is_decoder=True); Ulysses SP here trains causal language models, "
            "whose targets are the next tokens - use a causal LM (or set is_decoder=True if the model supports it)"
        )
    if not dispatches_attention(model):
        reasons.append(
            f"{type(model).__name__} does not dispatch attention through transformers' AttentionInterface, so its "
            "attention cannot be wrapped"
        )
    N = getattr(config, "num_attention_heads", None)
    K = getattr(config, "num_key_value_heads", None) or N
    if N is None:
        reasons.append("the config has no num_attention_heads")
    elif backend == "ulysses" and sp_size // (ring_size or auto_ring_size(sp_size, N)) > N:
        reasons.append(f"sp_ring_size {ring_size} leaves an all-to-all over {sp_size // ring_size} ranks > "
                       f"num_attention_heads {N}: use sp_ring_size >= {auto_ring_size(sp_size, N)} (a divisor of "
                       f"sp_size {sp_size}) or None to choose it")
    elif N % K:
        reasons.append(f"num_attention_heads {N} is not a multiple of num_key_value_heads {K}")
    layer_types = set(getattr(config, "layer_types", None) or [])
    reasons.extend(unsupported_mixer_reasons(model, sp_size, layer_types - _SUPPORTED_LAYER_TYPES))
    if "chunked_attention" in layer_types:
        reasons.append("chunked attention (Llama 4 style) needs a chunk mask the Ulysses kernels do not build")
    if getattr(config, "alibi", False) or getattr(config, "position_embedding_type", None) == "alibi":
        reasons.append("ALiBi position bias is not passed to attention functions and cannot be sharded")
    modules = list(model.modules())
    if any(hasattr(m, "create_position_ids_from_input_ids") for m in modules):
        reasons.append(
            "its embeddings derive position ids from input_ids (RoBERTa-style: padding_idx + 1 + the count of "
            "non-padding tokens so far), a rule over the whole row that the global position_ids of the shards "
            "do not follow"
        )
    if any(type(m).__name__.endswith("Attention") and isinstance(getattr(m, "A", None), torch.nn.Parameter)
           and hasattr(m, "dt_proj") for m in modules):
        reasons.append("its attention adds a learned dynamic mask (Doge-style, computed from this rank's keys) "
                       "that the global mask cannot carry")
    if any(getattr(m, "attn_temperature_tuning", False) and not getattr(m, "use_rope", True) for m in modules):
        reasons.append(
            "its NoPE layers use attention temperature tuning (Llama 4 style), which scales each query by its index in "
            "the sequence the layer sees (torch.arange over the local shard under SP, not the global position), so "
            "SP would change what the model computes: train it with sp_size=1 (attn_temperature_tuning = False would "
            "run, but is a different model than the one that was pretrained)"
        )
    ring = backend == "ring" or (backend == "ulysses" and N is not None and
                                  (ring_size or auto_ring_size(sp_size, N)) > 1)
    if any(getattr(m, "sinks", None) is not None for m in modules):
        reasons.extend(_sink_reasons(kernel, ring, backend))
    softcap = getattr(config, "attn_logit_softcapping", None)
    if ring and softcap:
        fix = ("use sp_size <= num_attention_heads (plain Ulysses) with attn_implementation='eager' (or flash / flex "
               "on GPU)") if backend == "ulysses" else ("use sp_backend='ulysses' with attn_implementation='eager' (or "
                                                        "flash / flex on GPU)")
        reasons.append("the model uses attention logit softcapping, which ring attention (sp_backend='ring', or "
                       f"Ulysses x ring when sp_size > num_attention_heads) cannot apply: {fix}")
    elif kernel == "sdpa" and softcap:
        reasons.append(
            "the model uses attention logit softcapping, which SDPA cannot apply: load it with "
            "attn_implementation='eager' (or flash_attention_2 / flex_attention on GPU)"
        )
    if ring and float(getattr(config, "attention_dropout", 0.0) or 0.0) > 0:
        reasons.append(f"attention_dropout={config.attention_dropout}: ring attention (sp_backend='ring', or Ulysses x "
                       "ring when sp_size > num_attention_heads) applies no attention dropout; set "
                       "config.attention_dropout = 0 or use sp_size <= num_attention_heads")
    return reasons


def _sink_reasons(kernel: str, ring: bool, backend: str) -> list[str]:
    """Why a model with attention sinks (GPT-OSS style) cannot run with ``kernel`` (empty: it can)."""
    if ring:
        fix = "sp_backend='ulysses'" if backend == "ring" else "sp_size <= num_attention_heads (plain Ulysses)"
        return [f"the model has attention sinks, which ring attention cannot apply: use {fix}"]
    if kernel in ("eager", "flex_attention") or (kernel.startswith("flash_attention") and flash_supports_sinks(kernel)):
        return []
    if kernel == "sdpa":
        return [SDPA_NO_SINKS]
    return [f"the model has attention sinks and the installed {kernel} takes none (no 's_aux' / 'learnable_sink'): "
            "load it with attn_implementation='flex_attention' (GPU) or 'eager'"]


def check_model_support(model: torch.nn.Module, config: UlyssesSPConfig) -> str:
    """The core kernel ``model`` will run under ``config``, or ``ValueError`` naming every reason it cannot.

    Needs no process group: the CLI and scripts validate a model before launching anything.
    ``model`` may be wrapped (PEFT / DDP / FSDP / DeepSpeed).
    """
    base = base_model(model)
    current = current_attn_implementation(base)
    if config.sp_attn_implementation is None and current is not None and current.startswith(KEY_PREFIX):
        raise ValueError("this model is already registered with another UlyssesSP; unregister that one first.")
    kernel = config.sp_attn_implementation or current or "sdpa"
    if kernel not in KERNELS:
        raise ValueError(
            f"attention implementation {kernel!r} cannot run under Ulysses SP; use one of {sorted(KERNELS)}.")
    reasons = unsupported_reasons(base, config.sp_size, kernel, config.sp_backend, config.sp_ring_size)
    if reasons:
        raise ValueError(f"{type(base).__name__} cannot be made sequence-parallel: " + "; ".join(reasons) + ".")
    return kernel


def _bidirectional_attention(model: PreTrainedModel) -> str | None:
    """The class name of a text-decoder attention module that declares ``is_causal=False``, if any.

    Modules without the attribute count as causal (every decoder-only family sets ``is_causal = True``).
    Only the text decoder is inspected (``get_decoder()``): a VLM's vision tower may be bidirectional.
    """
    try:
        decoder = model.get_decoder()
    except (AttributeError, NotImplementedError, ValueError):
        decoder = model
    for module in (decoder if isinstance(decoder, torch.nn.Module) else model).modules():
        if getattr(module, "is_causal", True) is False:
            return type(module).__name__
    return None

