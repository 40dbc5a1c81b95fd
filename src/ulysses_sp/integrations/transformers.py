"""Make a Transformers model sequence-parallel through the public ``AttentionInterface``.

    sp = UlyssesSP(model, mesh, config)  # validates the model, picks backend and core kernel
    with sp:                             # register(): our key in AttentionInterface, model uses it
        batch = sp.shard(global_batch)   # input_ids/position_ids/shift_labels of my shard + global mask
        logits = model(**sp.model_inputs(batch)).logits          # (B, s, V)
        loss = sp.loss(logits, batch, num_items_in_batch)        # my share of the global token mean
        # or: loss = sp.forward_loss(model, batch, num_items_in_batch)  (tiled when the config says so)
                                         # unregister(): model back to its own kernel

``config`` (a :class:`~ulysses_sp.config.UlyssesSPConfig`) chooses the backend (``ulysses`` or
``ring``), the core kernel and the memory features; ``UlyssesSP(model, mesh)`` uses the defaults.

Nothing of the model is edited and no private transformers function is patched: the model's
attention layers call ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]``, which now is our
key; the global mask travels as the ``ulysses_mask`` keyword that transformers forwards from
``model(...)`` to every attention function. Some decoder layers (StableLM, Nemotron, ...) call
attention without forwarding ``**kwargs``: for them a forward pre-hook on the model keeps the
``ulysses_mask`` of the current ``model(...)`` call, and attention calls that arrive without it
use that one (also when gradient checkpointing recomputes the layer in backward). Masks are never
built by the model (no ``attention_mask`` is passed), so no per-layer or per-rank S x S mask exists.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import zlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from transformers import AttentionInterface, PreTrainedModel

from ulysses_sp.attention import (
    KERNELS, SDPA_NO_SINKS, GlobalMask, SPAttention, build_attention, flash_supports_sinks,
)
from ulysses_sp.comm.collectives import check_same_across_ranks
from ulysses_sp.comm.mesh import SPMesh
from ulysses_sp.config import IGNORE_INDEX, UlyssesSPConfig, auto_ring_size
from ulysses_sp.data import ShardedBatch, check_batch, shard_batch
from ulysses_sp.data.sharding import VISION_KEYS
from ulysses_sp.integrations.rope import feed_global_length
from ulysses_sp.integrations.hf_internals import (
    builds_bidirectional_blocks, current_attn_implementation, dispatches_attention, unregister_attention_function,
)
from ulysses_sp.loss import sp_token_loss, tiled_token_loss
from ulysses_sp.loss.router_aux import aux_from_sums, router_sums, sp_router_aux_loss
from ulysses_sp.memory import ActivationOffload, apply_tiled_mlp, remove_tiled_mlp
from ulysses_sp.mixers import install_sp_mixers, unsupported_mixer_reasons

AttentionFunction = Callable[..., tuple[torch.Tensor, Any]]
"""transformers' attention-function contract: ``fn(module, q, k, v, attention_mask, **kw) -> (o, weights)``."""

_KEY_PREFIX = "ulysses_sp"
_counter = itertools.count()
_SUPPORTED_LAYER_TYPES = {"full_attention", "sliding_attention", "chunked_attention"}


def _base_model(model: torch.nn.Module) -> PreTrainedModel:
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
    elif _bidirectional_attention(model):
        reasons.append(
            f"its attention is bidirectional ({_bidirectional_attention(model)} has is_causal=False: an encoder such as "
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
    base = _base_model(model)
    current = current_attn_implementation(base)
    if config.sp_attn_implementation is None and current is not None and current.startswith(_KEY_PREFIX):
        raise ValueError("this model is already registered with another UlyssesSP; unregister that one first.")
    kernel = config.sp_attn_implementation or current or "sdpa"
    if kernel not in KERNELS:
        raise ValueError(f"attention implementation {kernel!r} cannot run under Ulysses SP; use one of {sorted(KERNELS)}.")
    reasons = unsupported_reasons(base, config.sp_size, kernel, config.sp_backend, config.sp_ring_size)
    if reasons:
        raise ValueError(f"{type(base).__name__} cannot be made sequence-parallel: " + "; ".join(reasons) + ".")
    return kernel


def _language_model(model: PreTrainedModel) -> torch.nn.Module | None:
    """The text tower of a vision-language model (``model.model.language_model``), else None."""
    inner = getattr(model, "model", None)
    language_model = getattr(inner, "language_model", None) if inner is not None else None
    return language_model if isinstance(language_model, torch.nn.Module) else None


def _tower_implementations(model: PreTrainedModel) -> dict[str, str]:
    """``{sub-config name: attention implementation}`` of a multimodal model's non-text towers."""
    config, text = model.config, model.config.get_text_config()
    towers = {}
    for name in getattr(config, "sub_configs", None) or {}:
        sub = getattr(config, name, None)
        if sub is not None and sub is not text and getattr(sub, "_attn_implementation", None) is not None:
            towers[name] = sub._attn_implementation
    return towers


def _uses_mrope(model: PreTrainedModel) -> bool:
    """Whether the text decoder applies multimodal rotary embeddings (``mrope_section`` in its rope config)."""
    config = model.config.get_text_config()
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return isinstance(rope, Mapping) and "mrope_section" in rope


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


class UlyssesSP:
    """Sequence parallelism for one Transformers model, scoped to that model.

    Args:
        model: a causal LM (``PreTrainedModel``, optionally wrapped by PEFT / DDP / FSDP / DeepSpeed).
        mesh: the ``dp x sp`` mesh (``SPMesh.from_world(sp_size)`` or ``config.build_mesh()``).
        config: what to run (default ``UlyssesSPConfig(sp_size=mesh.sp_size)``); its ``sp_size``
            must be the mesh's. Used fields:

            - ``sp_backend``: ``"ulysses"`` (all-to-all) or ``"ring"`` (``ulysses_sp.attention``);
            - ``sp_attn_implementation``: the core kernel on the full sequence; None = the model's own
              (``sdpa``, ``eager``, ``flex_attention``, ``flash_attention_2`` or ``flash_attention_3``);
            - ``tiled_mlp_tokens``: while registered, every dense MLP / MoE block runs in sequence tiles
              of this many tokens, recomputed in backward; ``state_dict`` keys do not change;
            - ``tiled_loss_tokens``: :meth:`forward_loss` computes lm_head + CE in tiles;
            - ``offload_activations``: while registered, the inputs of checkpointed layers live in CPU
              memory between forward and backward (needs ``model.activation_checkpointing_enable()``).

    Raises:
        ValueError: at construction, naming every reason the model cannot be made sequence-parallel.
    """

    def __init__(self, model: torch.nn.Module, mesh: SPMesh, config: UlyssesSPConfig | None = None) -> None:
        config = config if config is not None else UlyssesSPConfig(sp_size=mesh.sp_size)
        if not isinstance(config, UlyssesSPConfig):
            raise ValueError(f"config must be a UlyssesSPConfig, got {type(config).__name__}.")
        if config.sp_size != mesh.sp_size:
            raise ValueError(
                f"the config says sp_size={config.sp_size} but the mesh has sp_size={mesh.sp_size}; build the mesh "
                "from the config (config.build_mesh()) or pass UlyssesSPConfig(sp_size=mesh.sp_size, ...)."
            )
        self.config = config
        self.model = model
        self.base = _base_model(model)
        self.mesh = mesh
        self.kernel = check_model_support(self.base, config)
        self.offload = ActivationOffload(model) if config.offload_activations else None
        self.ring_size = config.ring_size_for(self.base.config.get_text_config().num_attention_heads)
        if self.ring_size > 1:  # Ulysses x ring: all-to-all inside sp_size // ring_size ranks, a ring across
            a2a_group, ring_group = mesh.ulysses_ring_groups(self.ring_size)
            self.attention: SPAttention = build_attention(
                "ulysses", a2a_group, self.kernel, config.sp_head_chunks, ring_group=ring_group)
        else:
            self.attention = build_attention(
                config.sp_backend, mesh.sp_group if mesh.sp_size > 1 else None, self.kernel, config.sp_head_chunks
            )
        self.key = f"{_KEY_PREFIX}_{next(_counter)}_{config.sp_backend}_{self.kernel}"
        self._wrappers: list[Callable[[AttentionFunction], AttentionFunction]] = []
        self._saved: tuple[str, bool] | None = None
        self._mask_hook: Any = None
        self._vision_hook: Any = None
        self._call_mask: GlobalMask | None = None  # ulysses_mask of the model call in progress
        self._aux_checked = False  # router_aux_loss has compared its formula with the model's own aux loss
        self._group_checked = False  # the first checked shard() samples every weight (_group_signature)
        self._forward_args = frozenset(inspect.signature(type(self.base).forward).parameters)  # per-batch lookups

    def _group_signature(self) -> tuple[dict[str, list[int]], str]:
        """What every rank of the SP group must agree on, as integers, and the fix if they do not.

        Compared with the batch in :meth:`shard`'s all-gather (no extra collective):
        config, kernel and model shape (different head chunks, backends or ring sizes would issue
        different collectives: a hang or mixed-up data), and a checksum of the weights where
        parameters are whole tensors on every rank (not FSDP2 DTensors or ZeRO-3 partitions). At the
        first batch every parameter is sampled (a random init without a common seed, and no DDP /
        DeepSpeed broadcast, would run another model on each shard); afterwards up to 32 trainable
        ones (weights that drift apart mean the gradients are not averaged over the SP group).
        """
        c, text = self.config, self.base.config.get_text_config()
        params = list(self.base.parameters())
        whole = all(type(p) is torch.nn.Parameter or type(p) is torch.Tensor for p in params) and not any(
            p.is_meta or p.numel() == 0 or hasattr(p, "ds_id") for p in params)
        first = not self._group_checked
        checksum = 0
        if whole:  # a strided sample of each tensor; the same weights give the same bits on every rank
            chosen = params if first else [p for p in params if p.requires_grad]
            if len(chosen) > 32:
                chosen = [chosen[i * len(chosen) // 32] for i in range(32)]
            with torch.no_grad():
                samples = [p.detach().reshape(-1)[:: max(1, p.numel() // 64)][:64].double() for p in chosen]
                total = torch.cat(samples).sum() if samples else torch.zeros((), dtype=torch.float64)
            checksum = int(total.reshape(1).cpu().view(torch.int64).item())
        values = {
            "UlyssesSPConfig (sp_backend, sp_head_chunks, sp_ring_size, tiled_mlp_tokens, tiled_loss_tokens)":
                [zlib.crc32(c.sp_backend.encode()), c.sp_head_chunks, self.ring_size, c.tiled_mlp_tokens or 0,
                 c.tiled_loss_tokens or 0],
            "attention kernel": [zlib.crc32(self.kernel.encode())],
            "model shape (parameters, layers, heads, kv heads)":
                [sum(p.numel() for p in params), int(getattr(text, "num_hidden_layers", 0) or 0),
                 int(getattr(text, "num_attention_heads", 0) or 0), int(getattr(text, "num_key_value_heads", 0) or 0)],
            "weights (a checksum of every parameter)" if first else "trained weights (a checksum)": [checksum],
        }
        hint = ("Every rank must build the same model and UlyssesSPConfig: load the same checkpoint or seed a random "
                "init identically (torch.manual_seed(s) before building the model on every rank), and pass the same "
                "options." if first else
                "They agreed at the first batch, so the gradients are not averaged over the SP group: wrap the model "
                "in DDP / FSDP2 / DeepSpeed over the world, or all-reduce every gradient over mesh.sp_group (and the "
                "DP group) before optimizer.step().")
        return values, hint

    # registration -------------------------------------------------------------------------
    def wrap_attention(self, wrapper: Callable[[AttentionFunction], AttentionFunction]) -> UlyssesSP:
        """Have ``wrapper(fn)`` registered with transformers instead of our attention function ``fn``.

        The public hook for instrumentation around every attention call, forward and backward
        (e.g. ``sp.wrap_attention(counter.scoped)`` with a :class:`~ulysses_sp.comm.CommCounter`).
        Call before :meth:`register`; wrappers apply in the order given (the last is outermost).
        """
        if self._saved is not None:
            raise ValueError("wrap_attention must be called before register(); unregister() first.")
        self._wrappers.append(wrapper)
        return self

    def register(self) -> UlyssesSP:
        """Route the model's attention through SP (idempotent). Sets ``use_cache=False``."""
        if self._saved is not None:
            return self
        if self.offload is not None:  # first: raises (no checkpointing) before anything is changed
            self.offload.register()
        function: AttentionFunction = self._attention_forward
        for wrapper in self._wrappers:
            function = wrapper(function)
        AttentionInterface.register(self.key, function)
        self._mask_hook = self.base.register_forward_pre_hook(self._keep_call_mask, with_kwargs=True)
        language_model = _language_model(self.base)
        if language_model is not None and self.mesh.sp_size > 1:  # VLM: merged embeddings of the full sequence
            self._vision_hook = language_model.register_forward_pre_hook(self._shard_merged_embeddings,
                                                                         with_kwargs=True)
        # VL configs built in code keep use_cache only on the text config, which the text tower reads
        caches = [c for c in {id(c): c for c in (self.base.config, self.base.config.get_text_config())}.values()
                  if hasattr(c, "use_cache")]
        self._saved = (current_attn_implementation(self.base), [(c, c.use_cache) for c in caches])
        towers = _tower_implementations(self.base)  # vision / audio towers keep their own kernel (full inputs)
        self.base.set_attn_implementation(self.key)
        if towers:
            self.base.set_attn_implementation(towers)
        for c in caches:
            c.use_cache = False
        if self.config.tiled_mlp_tokens is not None:
            apply_tiled_mlp(self.base, self.config.tiled_mlp_tokens)
        self._mixers = install_sp_mixers(self.base, self.mesh)
        # dynamic NTK / LongRoPE: frequencies from the GLOBAL batch's largest position, not the shard's
        self._rope_hooks = feed_global_length(self.base, lambda: self._call_mask) if self.mesh.sp_size > 1 else []
        return self

    def unregister(self) -> None:
        """Restore the model's own kernel and remove our key from the registry."""
        if self._saved is None:
            return
        implementation, use_cache = self._saved
        if self.config.tiled_mlp_tokens is not None:
            remove_tiled_mlp(self.base)
        if getattr(self, "_mixers", None) is not None:
            self._mixers.remove()
            self._mixers = None
        if self.offload is not None:
            self.offload.unregister()
        self.base.set_attn_implementation(implementation)
        for c, value in use_cache:
            c.use_cache = value
        unregister_attention_function(self.key)
        if self._mask_hook is not None:
            self._mask_hook.remove()
            self._mask_hook, self._call_mask = None, None
        if self._vision_hook is not None:
            self._vision_hook.remove()
            self._vision_hook = None
        for handle in getattr(self, "_rope_hooks", []):
            handle.remove()
        self._rope_hooks = []
        self._saved = None

    def _shard_merged_embeddings(self, module: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> Any:
        """Pre-hook of a VLM's language model: keep my slice of the full-sequence merged embeddings.

        With images (``UlyssesSP.shard`` of a batch with ``pixel_values``) every rank runs the vision
        tower on all images and merges the features into the embeddings of the FULL sequence; the
        text tower then gets this rank's ``s`` tokens of them (and of Qwen3-VL's deepstack
        features). Each image token lives in one rank's slice, so the vision tower's gradients,
        summed over the SP group by DDP, are those of one process. Text-only batches arrive sharded.
        """
        embeds = kwargs.get("inputs_embeds")
        mask = self._call_mask
        if embeds is None or mask is None or embeds.shape[1] != mask.seq_len:
            return None
        s = mask.seq_len // self.mesh.sp_size
        a, b = self.mesh.sp_rank * s, (self.mesh.sp_rank + 1) * s
        kwargs = {**kwargs, "inputs_embeds": embeds[:, a:b]}
        visual = kwargs.get("visual_pos_masks")
        if visual is not None:  # deepstack features: rows in the order of the full mask's True positions
            mine = torch.zeros_like(visual)
            mine[:, a:b] = visual[:, a:b]
            keep = mine[visual]
            kwargs["visual_pos_masks"] = visual[:, a:b]
            if kwargs.get("deepstack_visual_embeds") is not None:
                kwargs["deepstack_visual_embeds"] = [e[keep] for e in kwargs["deepstack_visual_embeds"]]
        return args, kwargs

    def _keep_call_mask(self, module: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        """Forward pre-hook: the global mask of this ``model(...)`` call (None for a raw batch)."""
        self._call_mask = kwargs.get("ulysses_mask")

    def __enter__(self) -> UlyssesSP:
        return self.register()

    def __exit__(self, *exc: object) -> None:
        self.unregister()

    def _attention_forward(
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
        if ulysses_mask is None:  # a decoder layer that does not forward **kwargs: the call's mask
            ulysses_mask = self._call_mask
        if ulysses_mask is None:
            if self.mesh.sp_size > 1 or attention_mask is not None:
                raise ValueError(
                    "the model was called without `ulysses_mask`: feed batches through UlyssesSP.shard(batch) "
                    "(or UlyssesDataLoader) and call model(**sp.model_inputs(batch))."
                )
            ulysses_mask = GlobalMask(query.shape[2], causal=getattr(module, "is_causal", True))
        elif isinstance(attention_mask, torch.Tensor):
            # models under our key get no mask from transformers (we pass no attention_mask): a tensor here
            # was built by the model itself, e.g. Doge's learned dynamic-mask bias over its local keys
            raise ValueError(
                f"{type(module).__name__} passes its own attention mask / bias ({attention_mask.dtype} "
                f"{tuple(attention_mask.shape)}) to the attention function; Ulysses SP attends with the global "
                "mask only and cannot shard a bias the model computes from its local keys, so this model cannot be "
                "made sequence-parallel (train it with sp_size=1)."
            )
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

    # batches and loss ---------------------------------------------------------------------
    def shard(
        self, batch: Mapping[str, Any], *, check_same: bool = True, packed: bool = False,
        ignore_index: int = IGNORE_INDEX,
    ) -> ShardedBatch:
        """This rank's shard of a global batch: the one check-then-shard path of every integration.

        1. :func:`ulysses_sp.data.check_batch`: a packed batch (``packed=True`` or packed-attention
           keys) must carry ``position_ids``; with ``check_same`` and ``sp_size > 1``, every rank of
           the SP group must hold the same batch, config, model shape and weights
           (:meth:`_group_signature`), all in one tiny all-gather.
        2. :func:`ulysses_sp.data.shard_batch` (pad S to a multiple of P, shift labels, global mask).
        """
        group = self.mesh.sp_group if check_same and self.mesh.sp_size > 1 else None
        agree, hint = self._group_signature() if group is not None else ({}, "")
        check_batch(batch, group, packed=packed, agree=agree, agree_hint=hint)
        self._group_checked = True
        positions = batch.get("position_ids")
        if isinstance(positions, torch.Tensor) and positions.dim() == 3 and not _uses_mrope(self.base):
            raise ValueError(
                f"position_ids of shape {tuple(positions.shape)} are multimodal (MRoPE) positions, but "
                f"{type(self.base).__name__} has no mrope_section in its rope config; give (batch, seq) position_ids."
            )
        self._check_token_types(batch)
        media = {k: v for k, v in batch.items() if k in VISION_KEYS and v is not None}
        if media.get("pixel_values") is None and media.get("pixel_values_videos") is None:
            shard = shard_batch(batch, self.mesh.sp_rank, self.mesh.sp_size, ignore_index=ignore_index)
        else:
            shard = self._shard_with_images(batch, media, ignore_index)
        if "token_type_ids" in shard and "token_type_ids" not in self._forward_args:
            del shard["token_type_ids"]  # the model has no such argument: it ignores them without SP too
        return shard

    def _check_token_types(self, batch: Mapping[str, Any]) -> None:
        """Refuse image / prefix blocks that the model would let attend bidirectionally: the global
        mask is causal, so they would silently train causal under SP."""
        for key in ("token_type_ids", "mm_token_type_ids"):
            types = batch.get(key)
            if (key in self._forward_args and isinstance(types, torch.Tensor) and bool((types != 0).any())
                    and builds_bidirectional_blocks(self.base)):
                raise ValueError(
                    f"batch[{key!r}] marks tokens that {type(self.base).__name__} lets attend bidirectionally "
                    "(image / prefix blocks), but Ulysses SP's global mask is causal: those tokens would train "
                    "differently than in one process. Train this model with sp_size=1, or on text-only batches "
                    f"(all {key} 0)."
                )

    def _shard_with_images(self, batch: Mapping[str, Any], media: dict[str, Any], ignore_index: int) -> ShardedBatch:
        """A VLM batch with images: text fields sharded, the full padded tokens and pixels kept for the
        model (it merges the features on the whole sequence; ``_shard_merged_embeddings`` slices)."""
        if _language_model(self.base) is None:
            raise ValueError(f"the batch carries {sorted(media)} but {type(self.base).__name__} has no vision tower "
                             "(model.model.language_model); feed input_ids-only batches.")
        if batch.get("position_ids") is None:
            raise ValueError("a batch with images needs position_ids computed on the FULL batch (the multimodal rope "
                             "index), e.g. model.model.get_rope_index(input_ids, ..., image_grid_thw=...)[0].")
        if "inputs_embeds" in media or "mm_encoder_outputs" in media:
            raise ValueError("pass pixel inputs, not precomputed inputs_embeds / mm_encoder_outputs, under SP.")
        text = {k: v for k, v in batch.items() if k not in VISION_KEYS}
        shard = shard_batch(text, self.mesh.sp_rank, self.mesh.sp_size, ignore_index=ignore_index)
        ids = batch["input_ids"]
        pad = getattr(self.base.config.get_text_config(), "pad_token_id", None) or 0
        num_pad = -ids.shape[1] % self.mesh.sp_size  # never an image token: the model counts them
        full = torch.nn.functional.pad(ids, (0, num_pad), value=pad)
        shard["vision_inputs"] = {"input_ids": full, **{k: v for k, v in media.items() if k != "input_ids"}}
        return shard

    @staticmethod
    def model_inputs(batch: Mapping[str, Any]) -> dict[str, Any]:
        """The keyword arguments for ``model(...)``: tokens, global positions and the global mask.

        A batch with images (``vision_inputs`` from :meth:`shard`) passes the FULL padded
        ``input_ids`` with the pixel inputs instead of the shard's tokens: the model merges the image
        features on the whole sequence and its language model keeps this rank's slice.
        """
        inputs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"],
                  "ulysses_mask": batch["ulysses_mask"]}
        if "token_type_ids" in batch:  # (B, s): the model embeds them token-wise (GPT-2's token type embedding)
            inputs["token_type_ids"] = batch["token_type_ids"]
        return {**inputs, **batch.get("vision_inputs", {})}

    def loss(
        self, logits_BsV: torch.Tensor, batch: Mapping[str, Any], num_items_in_batch: int | torch.Tensor,
        grad_average_world: int | None = None,
    ) -> torch.Tensor:
        """My share of the global token-mean cross entropy (``ulysses_sp.loss.sp_token_loss``).

        ``grad_average_world`` defaults to the world size (DDP / FSDP average gradients over all
        ``dp * sp`` ranks).
        """
        world = grad_average_world if grad_average_world is not None else self.mesh.dp_size * self.mesh.sp_size
        return sp_token_loss(logits_BsV, batch["shift_labels"], num_items_in_batch, grad_average_world=world)

    def forward_loss(
        self, model: torch.nn.Module, batch: Mapping[str, Any], num_items_in_batch: int | torch.Tensor, *,
        grad_average_world: int | None = None,
    ) -> torch.Tensor:
        """Forward ``model`` (or its DDP / FSDP2 / DeepSpeed wrapper) on a sharded batch and return :meth:`loss`.

        With ``config.tiled_loss_tokens``, lm_head and cross entropy run in token tiles (``tiled_token_loss``)
        and the ``(B, s, V)`` logits never exist:

        1. for this call, lm_head's ``forward`` becomes one that takes the final hidden states
           ``(B, s, D)`` and returns the tiled loss (shape ``(1, 1, 1)``) instead of logits;
        2. the model runs as usual, so lm_head's weight is whatever the wrapper's own hooks made it
           for the module's forward (FSDP2 unshards, ZeRO-3 gathers); it is never read sharded;
        3. the returned loss is ``tiled + 0 * model_output``: equal to the tiled loss, and the
           backward passes through the model's output, where the wrappers hook their backward
           (re-gather lm_head, then one gradient reduction, as for untiled logits).

        Final logit softcapping (Gemma2) and an lm_head bias are applied inside the tiles.
        """
        tile_tokens = self.config.tiled_loss_tokens
        world = grad_average_world if grad_average_world is not None else self.mesh.dp_size * self.mesh.sp_size
        if tile_tokens is None:
            output = model(**self.model_inputs(batch))
            return self.loss(output.logits, batch, num_items_in_batch, world) + self.router_aux_loss(output, batch, world)
        softcap = getattr(self.base.config.get_text_config(), "final_logit_softcapping", None)
        scale = _logit_multiplier(self.base)
        head = self.base.get_output_embeddings()
        losses: list[torch.Tensor] = []

        def tiled_head(hidden_BsD: torch.Tensor) -> torch.Tensor:
            bias = head.bias
            if scale != 1.0:  # the model scales lm_head's output: (W h + b) * c = W (c h) + c b
                hidden_BsD, bias = hidden_BsD * scale, None if bias is None else bias * scale
            losses.append(tiled_token_loss(
                hidden_BsD, head.weight, batch["shift_labels"], num_items_in_batch, grad_average_world=world,
                tile_tokens=tile_tokens, lm_head_bias=bias, final_logit_softcapping=softcap,
            ))
            return losses[-1].view(1, 1, 1).clone()  # not a view: wrappers hook the output's backward

        with _forward_replaced(head, tiled_head):
            output = model(**self.model_inputs(batch))
        if len(losses) != 1:
            raise ValueError(
                f"tiled_loss_tokens: {type(self.base).__name__} called its lm_head {len(losses)} times in one forward; "
                "only causal LMs that apply lm_head once to the final hidden states can tile the loss."
            )
        _check_logit_transform(self.base, losses[0], output.logits, scale, softcap)
        return losses[0] + output.logits.sum() * 0 + self.router_aux_loss(output, batch, world)

    def router_aux_loss(self, output: Any, batch: Mapping[str, Any], grad_average_world: int) -> torch.Tensor | float:
        """``router_aux_loss_coef`` x this rank's share of the MoE load-balancing loss of the SP group's tokens.

        For MoE models with ``output_router_logits=True`` (0 otherwise): the model's own ``aux_loss``
        would be the loss of this shard's tokens, a different (nonlinear) function; the shares of
        :func:`~ulysses_sp.loss.sp_router_aux_loss` sum to the one-process value. Scaled by
        ``grad_average_world`` as the token loss is, so the gradient average over the world gives
        ``coef * grad(aux)`` (summed over data-parallel replicas, as transformers' Trainer does).
        The first call checks that the model's own aux loss is this formula on the shard (else
        ``ValueError``: a family with another load-balancing rule).
        """
        text = self.base.config.get_text_config()
        coef = float(getattr(text, "router_aux_loss_coef", 0.0) or 0.0)
        logits = getattr(output, "router_logits", None)
        if not coef or not getattr(text, "output_router_logits", False) or not logits:
            return 0.0
        logits = tuple(t.reshape(-1, t.shape[-1]) for t in logits if t is not None)
        top_k = getattr(text, "num_experts_per_tok", None)
        own = getattr(output, "aux_loss", None)
        if not self._aux_checked and isinstance(own, torch.Tensor):
            with torch.no_grad():
                local = aux_from_sums(*router_sums(logits, top_k or 0, None)) if top_k else None
            if local is None or not torch.allclose(local, own.detach().float(), rtol=1e-4, atol=1e-6):
                raise ValueError(
                    f"{type(self.base).__name__}'s router aux loss is not the Switch-style load-balancing loss "
                    "UlyssesSP computes over the whole sequence (E * sum(top-k fraction * mean router probability) "
                    f"with top_k = config.num_experts_per_tok = {top_k}); set config.output_router_logits = False "
                    "or router_aux_loss_coef = 0 to train it sequence-parallel."
                )
            self._aux_checked = True
        mask: GlobalMask = batch["ulysses_mask"]
        s = batch["shift_labels"].shape[-1]
        r = self.mesh.sp_rank if self.mesh.sp_size > 1 else 0
        valid = None if mask.valid is None else mask.valid[:, r * s : (r + 1) * s].reshape(-1)
        group = self.mesh.sp_group if self.mesh.sp_size > 1 else None
        return coef * sp_router_aux_loss(logits, top_k, valid, group) * grad_average_world


def _logit_multiplier(base: PreTrainedModel) -> float:
    """The constant the model multiplies lm_head's output by before the loss (1.0: none).

    Cohere / Command-R: ``model.logit_scale``; Granite families: ``1 / config.logits_scaling``.
    The tiled loss must apply it inside its tiles; :func:`_check_logit_transform` catches any
    other transform of the logits after the first tiled forward.
    """
    scale = getattr(base, "logit_scale", None)
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        return float(scale)
    text = base.config.get_text_config()
    if str(getattr(text, "model_type", "")).startswith("granite") and getattr(text, "logits_scaling", None):
        return 1.0 / float(text.logits_scaling)
    return 1.0


def _check_logit_transform(
    base: PreTrainedModel, returned: torch.Tensor, logits: torch.Tensor, scale: float, softcap: float | None
) -> None:
    """Raise if the model transformed lm_head's output other than the tiled loss assumed.

    The tiled head returns the loss ``v`` in place of the logits; the model's own post-processing
    turns it into ``logits``. Expected: ``v * scale``, softcapped when ``final_logit_softcapping``.
    Anything else (another multiplier, an offset, a nonlinearity) is a logit transform the tiles
    did not apply, which would train silently wrong.
    """
    with torch.no_grad():
        expected = returned.detach().float() * scale
        if softcap is not None:
            expected = torch.tanh(expected / softcap) * softcap
        found = logits.detach().float().reshape(-1)
        if found.numel() != 1 or not torch.allclose(found[0], expected, rtol=1e-4, atol=1e-6):
            raise ValueError(
                f"tiled_loss_tokens: {type(base).__name__} transforms lm_head's output before the loss (it returned "
                f"{found.tolist()[:4]} for {float(returned):.6g}, expected {float(expected):.6g}), which the tiled "
                "loss cannot reproduce; unset tiled_loss_tokens for this model."
            )


@contextlib.contextmanager
def _forward_replaced(module: torch.nn.Module, forward: Callable[..., Any]) -> Iterator[None]:
    """Run ``module`` with ``forward`` as its forward (an instance attribute: the class, its hooks and
    any wrapper hooks stay as they are); the original forward is back on exit."""
    own = module.__dict__.get("forward")
    module.forward = forward
    try:
        yield
    finally:
        if own is None:
            del module.forward
        else:
            module.forward = own
