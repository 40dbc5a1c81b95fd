"""The only places the library touches private names of torch objects, each where no public route exists.

Checked on torch 2.6 - 2.13 and transformers 5.0 - 5.25 (the versions pyproject allows and the ones
installed here). If a public route appears, replace the helper's body and keep its name. Names of
transformers itself live in ``integrations/hf_internals.py``; those of the Trainer / TRL in
``integrations/trainer_internals.py``. This module imports torch only, so every layer may use it.

| name                                                  | why no public route                          |
|-------------------------------------------------------|----------------------------------------------|
| ``nn.Module._forward_hooks``                          | torch has no public way to hold a module's   |
|                                                       | forward hooks back for a while, or to call   |
|                                                       | them on an output computed elsewhere          |
| ``layer._gradient_checkpointing_func`` (an attribute  | transformers' checkpointed decoder layers    |
| transformers sets on torch modules)                   | call it; wrapping it is the only way to see  |
|                                                       | the checkpointed inputs                      |
| ``torch.ops.aten._scaled_dot_product_flash_attention_ | SDPA returns no log-sum-exp, and its backward |
| for_cpu`` and ``..._for_cpu_backward``                | cannot take another output / lse: ring       |
|                                                       | attention merges blocks by their lse and     |
|                                                       | differentiates each block against the global |
|                                                       | output (attention/ring.py, CPU fp32 / bf16)  |
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn


@contextlib.contextmanager
def forward_hooks_held_back(module: nn.Module) -> Iterator[None]:
    """While open, ``module``'s forward hooks do not run; hooks registered meanwhile (through the
    public ``register_forward_hook``) do, and stay registered afterwards.

    The held-back hooks keep their ids (their handles still remove them), their order and their
    ``with_kwargs`` / ``always_call`` flags: the hook dict is emptied and refilled, never replaced.
    TiledMoE runs the router once per tile and must not let recorders of its output see every tile.
    """
    hooks = module._forward_hooks
    held = list(hooks.items())
    hooks.clear()
    try:
        yield
    finally:
        added = list(hooks.items())
        hooks.clear()
        hooks.update(held)
        hooks.update(added)


def call_forward_hooks(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
    """Call ``module``'s forward hooks once on ``(args, output)`` as ``module(*args)`` would have
    (hooks registered ``with_kwargs`` get empty kwargs); their return values are ignored."""
    with_kwargs = module._forward_hooks_with_kwargs
    for hook_id, hook in list(module._forward_hooks.items()):
        if with_kwargs.get(hook_id, False):
            hook(module, args, {}, output)
        else:
            hook(module, args, output)


def checkpoint_function(layer: nn.Module) -> Callable[..., Any] | None:
    """The checkpoint function transformers calls in a checkpointed decoder layer (None: not checkpointed)."""
    return getattr(layer, "_gradient_checkpointing_func", None)


def set_checkpoint_function(layer: nn.Module, function: Callable[..., Any]) -> None:
    """Make ``function`` the checkpoint function of ``layer`` (see :func:`checkpoint_function`)."""
    layer._gradient_checkpointing_func = function


def flash_attention_cpu(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU flash attention with its log-sum-exp: ``o (B,N,S,H)``, ``lse (B,N,S)`` fp32, no dropout.

    ``torch.nn.functional.scaled_dot_product_attention`` returns no log-sum-exp; this aten op (the
    kernel SDPA dispatches to on CPU, fp32 / bf16) does.
    """
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return o, lse


def flash_attention_cpu_backward(
    do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
    causal: bool, scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward of :func:`flash_attention_cpu` given the output ``o`` and ``lse`` to use (ring
    attention passes the GLOBAL ones of all blocks): ``dq, dk, dv`` of ``q, k, v``'s shapes."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        do, q, k, v, o, lse, 0.0, causal, scale=scale
    )
