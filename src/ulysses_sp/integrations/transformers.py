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

One concern per module: ``model_support`` (which models can run), ``adapter`` (our attention
function), ``vlm`` (vision-language models), ``lm_head`` (the tiled loss), ``moe_aux`` (the router
aux loss), ``group_check`` (what the SP group must agree on). This module holds the class that
registers them on one model.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ulysses_sp.attention import GlobalMask, SPAttention, build_attention
from ulysses_sp.comm.mesh import SPMesh
from ulysses_sp.config import IGNORE_INDEX, UlyssesSPConfig
from ulysses_sp.data import ShardedBatch, check_batch, shard_batch
from ulysses_sp.integrations import vlm
from ulysses_sp.integrations.adapter import AttentionAdapter, AttentionFunction
from ulysses_sp.integrations.group_check import group_signature
from ulysses_sp.integrations.lm_head import tiled_head_loss
from ulysses_sp.integrations.model_support import KEY_PREFIX, base_model, check_model_support, unsupported_reasons
from ulysses_sp.integrations.moe_aux import RouterAuxLoss
from ulysses_sp.integrations.registration import Registration
from ulysses_sp.loss import sp_token_loss
from ulysses_sp.memory import ActivationOffload
from ulysses_sp.mixers import SPMixers

__all__ = ["AttentionFunction", "UlyssesSP", "check_model_support", "unsupported_reasons"]

_counter = itertools.count()


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
        self.base = base_model(model)
        self.mesh = mesh
        self.kernel = check_model_support(self.base, config)
        self.offload = ActivationOffload(model) if config.offload_activations else None
        self.ring_size = config.ring_size_for(self.base.config.get_text_config().num_attention_heads)
        if self.ring_size > 1:  # Ulysses x ring: all-to-all inside sp_size // ring_size ranks, a ring across
            a2a_group, ring_group = mesh.ulysses_ring_groups(self.ring_size)
            self.attention: SPAttention = build_attention(
                "ulysses", a2a_group, self.kernel, config.sp_head_chunks, ring_group=ring_group,
                head_chunk_bytes=config.head_chunk_bytes)
        else:
            self.attention = build_attention(
                config.sp_backend, mesh.sp_group if mesh.sp_size > 1 else None, self.kernel, config.sp_head_chunks,
                head_chunk_bytes=config.head_chunk_bytes)
        self.key = f"{KEY_PREFIX}_{next(_counter)}_{config.sp_backend}_{self.kernel}"
        self._adapter = AttentionAdapter(self.attention, mesh.sp_size)
        self._router_aux = RouterAuxLoss(self.base, mesh)
        self._registration = Registration(self.base, mesh, config, self.key, self._adapter, self.offload)
        self._group_checked = False  # the first checked shard() samples every weight (group_signature)
        self._forward_args = frozenset(inspect.signature(type(self.base).forward).parameters)  # per-batch lookups

    @property
    def _call_mask(self) -> GlobalMask | None:
        """The ``ulysses_mask`` of the model call in progress (None outside one)."""
        return self._adapter.call_mask

    @property
    def _mixers(self) -> SPMixers | None:
        """The installed SP forwards of the model's token mixers (None while not registered)."""
        return self._registration.mixers

    @property
    def _attention_forward(self) -> AttentionFunction:
        """Our attention function (before :meth:`wrap_attention`'s wrappers)."""
        return self._adapter

    @property
    def head_block_refusals(self) -> dict[str, str]:
        """While registered with head chunks: ``{attention module name: why}`` for the modules that keep
        attention-call chunks instead of running as head blocks (``UlyssesSPConfig.sp_head_blocks``);
        empty when every one runs as blocks, when blocks are off, or while not registered."""
        return dict(self._registration.head_block_refusals) if self._registration.active else {}

    # registration -------------------------------------------------------------------------
    def wrap_attention(self, wrapper: Callable[[AttentionFunction], AttentionFunction]) -> UlyssesSP:
        """Have ``wrapper(fn)`` registered with transformers instead of our attention function ``fn``.

        The public hook for instrumentation around every attention call, forward and backward
        (e.g. ``sp.wrap_attention(counter.scoped)`` with a :class:`~ulysses_sp.comm.CommCounter`).
        Call before :meth:`register`; wrappers apply in the order given (the last is outermost).
        """
        if self._registration.active:
            raise ValueError("wrap_attention must be called before register(); unregister() first.")
        self._registration.wrappers.append(wrapper)
        return self

    def register(self) -> UlyssesSP:
        """Route the model's attention through SP (idempotent). Sets ``use_cache=False``.

        The ordered, reversible steps of :class:`~ulysses_sp.integrations.registration.Registration`:
        if one raises, those done are undone and the model is exactly as it was.
        """
        self._registration.apply()
        return self

    def unregister(self) -> None:
        """Undo :meth:`register` in reverse order: the model's own kernel, our key out of the registry."""
        self._registration.undo()

    def __enter__(self) -> UlyssesSP:
        return self.register()

    def __exit__(self, *exc: object) -> None:
        self.unregister()

    # batches and loss ---------------------------------------------------------------------
    def shard(
        self, batch: Mapping[str, Any], *, check_same: bool = True, packed: bool = False,
        ignore_index: int = IGNORE_INDEX,
    ) -> ShardedBatch:
        """This rank's shard of a global batch: the one check-then-shard path of every integration.

        1. :func:`ulysses_sp.data.check_batch`: a packed batch (``packed=True`` or packed-attention
           keys) must carry ``position_ids``; with ``check_same`` and ``sp_size > 1``, every rank of
           the SP group must hold the same batch, config, model shape and weights
           (:func:`~ulysses_sp.integrations.group_check.group_signature`), all in one tiny all-gather.
        2. VLM checks (:func:`~ulysses_sp.integrations.vlm.check_vision_batch`).
        3. :func:`ulysses_sp.data.shard_batch` (pad S to a multiple of P, shift labels, global mask), or
           :func:`~ulysses_sp.integrations.vlm.shard_with_images` for a batch with images.
        """
        group = self.mesh.sp_group if check_same and self.mesh.sp_size > 1 else None
        agree, hint = ((group_signature(self.base, self.config, self.kernel, self.ring_size, not self._group_checked))
                       if group is not None else ({}, ""))
        check_batch(batch, group, packed=packed, agree=agree, agree_hint=hint)
        self._group_checked = True
        vlm.check_vision_batch(self.base, self._forward_args, batch)
        shard = vlm.shard_with_images(self.base, self.mesh, batch, ignore_index)
        if shard is None:
            shard = shard_batch(batch, self.mesh.sp_rank, self.mesh.sp_size, ignore_index=ignore_index)
        if "token_type_ids" in shard and "token_type_ids" not in self._forward_args:
            del shard["token_type_ids"]  # the model has no such argument: it ignores them without SP too
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
        """Forward ``model`` (or its DDP / FSDP2 / DeepSpeed wrapper) on a sharded batch and return :meth:`loss`
        plus :meth:`router_aux_loss`.

        With ``config.tiled_loss_tokens``, lm_head and cross entropy run in token tiles and the
        ``(B, s, V)`` logits never exist (:func:`~ulysses_sp.integrations.lm_head.tiled_head_loss`).
        """
        tile_tokens = self.config.tiled_loss_tokens
        world = grad_average_world if grad_average_world is not None else self.mesh.dp_size * self.mesh.sp_size
        if tile_tokens is None:
            output = model(**self.model_inputs(batch))
            loss = self.loss(output.logits, batch, num_items_in_batch, world)
            return loss + self.router_aux_loss(output, batch, world)
        loss, output = tiled_head_loss(model, self.base, self.model_inputs(batch), batch["shift_labels"],
                                       num_items_in_batch, world, tile_tokens)
        return loss + self.router_aux_loss(output, batch, world)

    def router_aux_loss(self, output: Any, batch: Mapping[str, Any], grad_average_world: int) -> torch.Tensor | float:
        """``router_aux_loss_coef`` x this rank's share of the MoE load-balancing loss of the SP group's tokens
        (:class:`~ulysses_sp.integrations.moe_aux.RouterAuxLoss`; 0 without ``output_router_logits``)."""
        return self._router_aux(output, batch, grad_average_world)
