"""RMSNorm modules whose forward is ``LlamaRMSNorm``'s code run as ``memory.rms_norm`` (input-only saving).

A module qualifies when its class forward is, line for line, transformers' ``LlamaRMSNorm.forward``
(Mistral, Qwen2/3 and the other families that copy it), with a ``(D,)`` ``weight`` as its only
parameter and a float ``variance_epsilon``: then :func:`~ulysses_sp.memory.rms_norm.rms_norm` computes
the same output bit for bit. Other norms (Gemma's ``1 + weight``, LayerNorms, fused kernels, remote
code written otherwise) keep their own forward.
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from ulysses_sp.memory.rms_norm import rms_norm
from ulysses_sp.swaps import InstanceForward, instance_forward


@functools.lru_cache(maxsize=None)  # per class: every norm of a model shares one
def _source(cls: type) -> str | None:
    try:
        return "\n".join(line.strip() for line in inspect.getsource(cls.forward).splitlines())
    except (OSError, TypeError):
        return None


def fusable(module: nn.Module) -> bool:
    """Whether ``module`` runs as :func:`~ulysses_sp.memory.rms_norm.rms_norm` (module docstring)."""
    weight = getattr(module, "weight", None)
    return (type(module).__name__.endswith("RMSNorm") and isinstance(weight, torch.Tensor) and weight.dim() == 1
            and isinstance(getattr(module, "variance_epsilon", None), float)
            and [name for name, _ in module.named_parameters(recurse=False)] == ["weight"]
            and _source(type(module)) == _source(LlamaRMSNorm))


def _fused(module: nn.Module):
    original = module.forward  # the forward before ours (an instance forward someone set, or the class's)

    def forward(hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        weight = module.weight
        if (args or kwargs or not torch.is_grad_enabled() or hidden_states.shape[-1] != weight.shape[0]
                or hasattr(weight, "ds_id")):  # other inputs, no grad, or ZeRO-3 weights: the module's own
            return original(hidden_states, *args, **kwargs)
        return rms_norm(hidden_states, weight, module.variance_epsilon)
    return forward


def fuse_rms_norms(model: nn.Module) -> list[InstanceForward]:
    """Give every :func:`fusable` RMSNorm of ``model`` the input-only-saving forward.

    Returns:
        the forward swaps, to ``remove()`` in reverse order to restore the model.
    """
    return [instance_forward(module, _fused(module)) for module in model.modules() if fusable(module)]
