"""The only places this package touches private transformers names, each where no public route exists.

Everything else uses transformers' public API (``AttentionInterface.register``,
``set_attn_implementation``, ``get_decoder`` ...). If transformers adds a public route, replace the
helper's body and keep its name.
"""

from __future__ import annotations

import functools
import inspect
import sys

from transformers import AttentionInterface, PreTrainedModel


def unregister_attention_function(key: str) -> None:
    """Remove ``key`` from transformers' global attention registry.

    ``AttentionInterface.register`` is public but has no inverse, and ``del`` on an interface
    instance only removes local overrides; without this, every ``UlyssesSP`` ever created would
    stay referenced by the class-wide registry (and keep its model's process group alive).
    """
    AttentionInterface._global_mapping.pop(key, None)


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
