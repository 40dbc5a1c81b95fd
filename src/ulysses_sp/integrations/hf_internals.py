"""The only places this package touches private transformers names, each where no public route exists.

Everything else uses transformers' public API (``AttentionInterface.register``,
``set_attn_implementation``, ``get_decoder`` ...). If transformers adds a public route, replace the
helper's body and keep its name.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from collections.abc import Iterator
from typing import Any

import torch
from transformers import AttentionInterface, PreTrainedModel


def unregister_attention_function(key: str) -> None:
    """Remove ``key`` from transformers' global attention registry (and from its mask registry).

    ``AttentionInterface.register`` / ``AttentionMaskInterface.register`` are public but have no
    inverse, and ``del`` on an interface instance only removes local overrides; without this, every
    ``UlyssesSP`` ever created would stay referenced by the class-wide registry (and keep its
    model's process group alive).
    """
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface._global_mapping.pop(key, None)
    AttentionMaskInterface._global_mapping.pop(key, None)


def dispatches_attention(model: PreTrainedModel) -> bool:
    """Whether ``model`` calls attention through ``ALL_ATTENTION_FUNCTIONS`` (so our key reaches it).

    ``set_attn_implementation`` only logs a warning (and keeps the old kernel) for models that do
    not dispatch; transformers' own test of that, ``_can_set_attn_implementation``, is private, and
    refusing such a model at construction is the only way to avoid a silently non-parallel run.
    """
    return bool(model._can_set_attn_implementation())


def current_attn_implementation(model: PreTrainedModel) -> str | None:
    """The attention implementation ``model`` dispatches to (``"sdpa"``, ``"eager"``, our key ...).

    transformers exposes it only as ``config._attn_implementation`` (there is a setter,
    ``set_attn_implementation``, but no public getter).
    """
    return model.config._attn_implementation


def config_attn_implementation(config: Any) -> str | None:
    """The attention implementation a (sub-)config holds (None: none set, or not a ``PretrainedConfig``).

    A multimodal model's vision / audio tower configs keep their own kernel there; the same private
    ``_attn_implementation`` as :func:`current_attn_implementation`, read with a default.
    """
    return getattr(config, "_attn_implementation", None)


@functools.lru_cache(maxsize=None)
def _module_mentions(module_name: str, word: str) -> bool:
    module = sys.modules.get(module_name)
    try:
        return module is not None and word in inspect.getsource(module)
    except (OSError, TypeError):  # no source (compiled / frozen): assume it may
        return True


def builds_bidirectional_blocks(model: PreTrainedModel) -> bool:
    """Whether ``model``'s modeling code lets token-type blocks (images in Gemma 3 / Gemma 4 /
    PaliGemma / Molmo2 ...) attend bidirectionally.

    Those models turn ``token_type_ids`` / ``mm_token_type_ids`` into ``block_sequence_ids`` for
    transformers' mask builder inside their own ``forward``; there is no config field or public
    attribute that says so, so the modeling module's source is searched for that name.
    """
    return any(_module_mentions(cls.__module__, "block_sequence_ids") for cls in type(model).__mro__
               if cls.__module__.startswith("transformers.models."))


def recorded_output_modules(model: torch.nn.Module, key: str) -> list[tuple[torch.nn.Module, int]]:
    """The submodules (and the index in their output) whose outputs transformers collects as ``key``
    (``"router_logits"``, ...), with the rule of the first module class that declares one.

    transformers 5 gathers such outputs with forward hooks described by each model class's private
    ``_can_record_outputs`` (a module class, or an ``OutputRecorder`` with ``target_class`` /
    ``class_name`` / ``layer_name`` / ``index``); an output that a forward does not return (TRL's
    fused LM head drops ``router_logits``) can only be recovered by the same hooks.
    """
    spec = next((rules[key] for m in model.modules()
                 if key in (rules := getattr(type(m), "_can_record_outputs", None) or {})), None)
    if spec is None:
        return []
    target = spec if isinstance(spec, type) else getattr(spec, "target_class", None)
    class_name, layer_name = getattr(spec, "class_name", None), getattr(spec, "layer_name", None)
    index = 0 if isinstance(spec, type) else int(getattr(spec, "index", 0) or 0)
    found = []
    for name, module in model.named_modules():
        if target is not None and not isinstance(module, target):
            continue
        if class_name is not None and not type(module).__name__.endswith(class_name):
            continue
        if layer_name is not None and layer_name not in name:
            continue
        found.append((module, index))
    return found


@contextlib.contextmanager
def recording_outputs(model: torch.nn.Module, key: str) -> Iterator[list[torch.Tensor]]:
    """While open, the ``key`` outputs (see :func:`recorded_output_modules`) of every forward of
    ``model`` are appended to the yielded list, in call order."""
    recorded: list[torch.Tensor] = []
    handles = []
    for module, index in recorded_output_modules(model, key):
        def hook(mod: torch.nn.Module, args: Any, output: Any, index: int = index) -> None:
            recorded.append(output[index] if isinstance(output, (tuple, list)) else output)

        handles.append(module.register_forward_hook(hook))
    try:
        yield recorded
    finally:
        for handle in handles:
            handle.remove()
