"""Registering SP on one model: an ordered list of reversible steps (what ``UlyssesSP.register`` does).

Each step changes one thing and pushes its undo onto a ``contextlib.ExitStack``. :meth:`Registration.apply`
runs the steps in order; if one raises, the stack undoes the steps done so far in reverse order, so
the model is exactly as it was. :meth:`Registration.undo` closes the stack: every step undone, in
reverse order::

    1. offload       checkpointed layers offload their saved inputs (first: raises without checkpointing)
    2. registry key  AttentionInterface.register(key, our function wrapped by wrap_attention's wrappers)
    3. call mask     forward pre-hook on the model: the ulysses_mask of the call in progress
    4. VLM slice     forward pre-hook on a VLM's language model: my slice of the merged embeddings
    5. kernel        set_attn_implementation(key); vision / audio towers keep their own kernel
    6. use_cache     False on the model config and its text config
    7. tiled MLP     every .mlp wrapped in TiledMLP / TiledMoE (config.tiled_mlp_tokens)
    8. norms         Llama-style RMSNorms save only their input (config.recompute_norms)
    9. head blocks   qualifying attention modules run one chunk of heads at a time, projections
                     included (config.sp_head_chunks / sp_head_chunk_mib with sp_head_blocks)
   10. mixers        SP forwards of linear-attention / state-space mixers
   11. RoPE length   dynamic NTK / LongRoPE fed the global batch's length
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from transformers import AttentionInterface, PretrainedConfig, PreTrainedModel

from ulysses_sp.attention import UlyssesAttention
from ulysses_sp.comm.mesh import SPMesh
from ulysses_sp.config import UlyssesSPConfig
from ulysses_sp.integrations import vlm
from ulysses_sp.integrations.adapter import AttentionAdapter, AttentionFunction
from ulysses_sp.integrations.head_blocks import HeadBlocks
from ulysses_sp.integrations.hf_internals import current_attn_implementation, unregister_attention_function
from ulysses_sp.integrations.norms import fuse_rms_norms
from ulysses_sp.integrations.rope import feed_global_length
from ulysses_sp.memory import ActivationOffload, apply_tiled_mlp, remove_tiled_mlp
from ulysses_sp.mixers import SPMixers

Wrapper = Callable[[AttentionFunction], AttentionFunction]


class Registration:
    """The reversible steps that put ``base`` under SP, and their undo.

    Args:
        base: the unwrapped ``PreTrainedModel``.
        mesh: the SP mesh.
        config: the SP config (``tiled_mlp_tokens``).
        key: our ``AttentionInterface`` key.
        adapter: our attention function (it keeps the call's mask).
        offload: activation offload, or None.
    """

    def __init__(
        self, base: PreTrainedModel, mesh: SPMesh, config: UlyssesSPConfig, key: str, adapter: AttentionAdapter,
        offload: ActivationOffload | None,
    ) -> None:
        self.base, self.mesh, self.config, self.key = base, mesh, config, key
        self.adapter, self.offload = adapter, offload
        self.wrappers: list[Wrapper] = []  # wrap_attention's, innermost first
        self.mixers: SPMixers | None = None  # installed by step 9 while registered
        self.head_block_refusals: dict[str, str] = {}  # step 8: attention modules left to attention-call chunking
        self._undo: contextlib.ExitStack | None = None  # the undo of every step done; None: not registered

    @property
    def active(self) -> bool:
        """Whether the steps are applied (registered)."""
        return self._undo is not None

    def apply(self) -> None:
        """Run every step in order (idempotent); on an exception undo the steps done so far, then re-raise."""
        if self._undo is not None:
            return
        steps = (self._offload, self._registry_key, self._call_mask_hook, self._vision_hook, self._kernel,
                 self._no_cache, self._tiled_mlp, self._norms, self._head_blocks, self._mixers, self._rope_length)
        with contextlib.ExitStack() as stack:
            for step in steps:
                step(stack)
            self._undo = stack.pop_all()

    def undo(self) -> None:
        """Undo every step, in reverse order (idempotent)."""
        undo, self._undo = self._undo, None
        if undo is not None:
            undo.close()

    # the steps, in order: each changes one thing and pushes its undo ----------------------------
    def _offload(self, stack: contextlib.ExitStack) -> None:
        if self.offload is not None:
            self.offload.register()  # raises (no checkpointing) before changing anything
            stack.callback(self.offload.unregister)

    def _registry_key(self, stack: contextlib.ExitStack) -> None:
        function: AttentionFunction = self.adapter
        for wrapper in self.wrappers:
            function = wrapper(function)
        stack.callback(unregister_attention_function, self.key)
        AttentionInterface.register(self.key, function)

    def _call_mask_hook(self, stack: contextlib.ExitStack) -> None:
        handle = self.base.register_forward_pre_hook(self.adapter.keep_call_mask, with_kwargs=True)
        stack.callback(setattr, self.adapter, "call_mask", None)
        stack.callback(handle.remove)

    def _vision_hook(self, stack: contextlib.ExitStack) -> None:
        language_model = vlm.language_model(self.base)
        if language_model is not None and self.mesh.sp_size > 1:  # VLM: merged embeddings of the full sequence
            hook = vlm.SlicedEmbeddings(self.mesh, lambda: self.adapter.call_mask)
            stack.callback(language_model.register_forward_pre_hook(hook, with_kwargs=True).remove)

    def _kernel(self, stack: contextlib.ExitStack) -> None:
        implementation = current_attn_implementation(self.base)
        towers = vlm.tower_implementations(self.base)  # vision / audio towers keep their own kernel (full inputs)

        def restore() -> None:
            self.base.set_attn_implementation(implementation)
            if towers:
                self.base.set_attn_implementation(towers)

        stack.callback(restore)
        self.base.set_attn_implementation(self.key)
        if towers:
            self.base.set_attn_implementation(towers)

    def _no_cache(self, stack: contextlib.ExitStack) -> None:
        # VL configs built in code keep use_cache only on the text config, which the text tower reads
        configs: list[PretrainedConfig] = [
            c for c in {id(c): c for c in (self.base.config, self.base.config.get_text_config())}.values()
            if hasattr(c, "use_cache")]
        for c in configs:
            stack.callback(setattr, c, "use_cache", c.use_cache)
            c.use_cache = False

    def _tiled_mlp(self, stack: contextlib.ExitStack) -> None:
        if self.config.tiled_mlp_tokens is not None:
            apply_tiled_mlp(self.base, self.config.tiled_mlp_tokens)  # checks every block before wrapping any
            stack.callback(remove_tiled_mlp, self.base)

    def _norms(self, stack: contextlib.ExitStack) -> None:
        if self.config.recompute_norms:
            for handle in fuse_rms_norms(self.base):
                stack.callback(handle.remove)  # undone in reverse order

    def _head_blocks(self, stack: contextlib.ExitStack) -> None:
        attention, config = self.adapter.attention, self.config
        chunked = config.sp_head_chunks > 1 or config.head_chunk_bytes is not None
        if (config.sp_head_blocks and chunked and isinstance(attention, UlyssesAttention) and attention.ring is None
                and attention.a2a_size > 1):
            blocks = HeadBlocks(self.base, attention, config.sp_head_chunks, config.head_chunk_bytes)
            stack.callback(blocks.remove)  # also the modules swapped before one raised
            stack.callback(setattr, self, "head_block_refusals", {})
            self.head_block_refusals = blocks.install()

    def _mixers(self, stack: contextlib.ExitStack) -> None:
        mixers = SPMixers(self.base, self.mesh)
        stack.callback(setattr, self, "mixers", None)
        stack.callback(mixers.remove)  # also the mixers installed before one raised
        self.mixers = mixers.install()

    def _rope_length(self, stack: contextlib.ExitStack) -> None:
        # dynamic NTK / LongRoPE: frequencies from the GLOBAL batch's largest position, not the shard's
        if self.mesh.sp_size > 1:
            for handle in feed_global_length(self.base, lambda: self.adapter.call_mask):
                stack.callback(handle.remove)
