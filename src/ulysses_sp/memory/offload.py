"""Activation-checkpoint offload: the hidden states a checkpointed layer keeps go to host memory.

Shapes: ``B`` batch, ``s`` local sequence, ``D`` hidden, ``L`` checkpointed layers.

With gradient checkpointing every decoder layer keeps only its input ``h_BsD`` until backward, so
the forward leaves ``L`` such tensors on the device (``L * B * s * D`` elements: the term that
dominates at long sequences once the MLP and the loss are tiled). Here they live on an offload
device (CPU, pinned when the source is CUDA) instead::

    forward, layer l:  checkpoint(layer, h_BsD)  --saves h_BsD-->  pack:   copy to offload device
                                                                           (device copy freed)
    backward, layer l: checkpoint recompute needs h_BsD     <--   unpack: copy back to its device

Mechanism: ``torch.autograd.graph.saved_tensors_hooks`` around the checkpoint call of each layer.
Both checkpoint flavours save the layer inputs through ``save_for_backward`` *outside* their own
inner hooks (non-reentrant: ``_NoopSaveInputs``; reentrant: ``CheckpointFunction``), so our
hooks see exactly the checkpoint inputs and nothing the layer saves internally. The checkpoint
function is the per-layer ``_gradient_checkpointing_func`` that Transformers'
``model.activation_checkpointing_enable(...)`` installs; we wrap it while registered and put the
original back on ``unregister()``. No model code or transformers function is changed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ulysses_sp.torch_internals import checkpoint_function, set_checkpoint_function


@dataclasses.dataclass
class OffloadStats:
    """What the hooks moved since the last :meth:`ActivationOffload.reset_stats`.

    Attributes:
        num_tensors: tensors copied to the offload device.
        num_bytes: their total size.
        num_restored: tensors copied back for backward.
    """

    num_tensors: int = 0
    num_bytes: int = 0
    num_restored: int = 0


def _checkpointed_layers(model: nn.Module) -> list[nn.Module]:
    """Modules with checkpointing on and no checkpointed module inside (the decoder layers, not
    the ``LlamaModel`` that also carries the flag but never calls its checkpoint function)."""

    def on(m: nn.Module) -> bool:
        return getattr(m, "gradient_checkpointing", False) is True and checkpoint_function(m) is not None

    return [m for m in model.modules() if on(m) and not any(on(c) for c in m.modules() if c is not m)]


class _Offloaded:
    """A packed saved tensor: its copy on the offload device and the device it came from."""

    __slots__ = ("copy", "device")

    def __init__(self, copy: torch.Tensor, device: torch.device) -> None:
        self.copy, self.device = copy, device


class ActivationOffload:
    """Offload the inputs of every checkpointed layer of ``model`` while registered.

    Args:
        model: a module whose layers have gradient checkpointing enabled (``gradient_checkpointing``
            True and a ``_gradient_checkpointing_func``, as set by
            ``model.activation_checkpointing_enable(...)``).
        device: where saved inputs go (default ``"cpu"``). On a CPU-only machine this still copies
            (the device copy is freed), which is what the tests observe.
        pin_memory: pin the host copies (default: when the source tensor is on CUDA) so the
            device-to-host copy can be asynchronous.
        min_bytes: smaller saved tensors (masks, positions, checkpoint's 0-element dummy) stay put.

    Raises:
        ValueError: on ``register()`` when no layer is checkpointed (nothing would be offloaded).
    """

    def __init__(
        self, model: nn.Module, device: str | torch.device = "cpu", pin_memory: bool | None = None,
        min_bytes: int = 1024,
    ) -> None:
        self.model = model
        self.device = torch.device(device)
        self.pin_memory = pin_memory
        self.min_bytes = min_bytes
        self.stats = OffloadStats()
        self._originals: dict[nn.Module, Callable] = {}

    def register(self) -> ActivationOffload:
        """Wrap the checkpoint function of every checkpointed layer (idempotent).

        Calling it again re-wraps layers whose checkpoint function was replaced since (e.g. the
        Trainer calls ``gradient_checkpointing_enable`` at the start of ``train()``).
        """
        layers = _checkpointed_layers(self.model)
        if not layers:
            raise ValueError(
                "activation offload needs gradient checkpointing: call "
                "model.activation_checkpointing_enable() (or gradient_checkpointing_enable()) before registering."
            )
        for layer in layers:
            current = checkpoint_function(layer)
            if getattr(current, "ulysses_offload", None) is self:
                continue
            self._originals[layer] = current
            set_checkpoint_function(layer, self._wrap(current))
        return self

    def unregister(self) -> None:
        """Put the original checkpoint functions back."""
        for layer, original in self._originals.items():
            set_checkpoint_function(layer, original)
        self._originals = {}

    def __enter__(self) -> ActivationOffload:
        return self.register()

    def __exit__(self, *exc: object) -> None:
        self.unregister()

    def reset_stats(self) -> None:
        self.stats = OffloadStats()

    @property
    def num_layers(self) -> int:
        """How many layers are wrapped now."""
        return len(self._originals)

    def _wrap(self, checkpoint_fn: Callable) -> Callable:
        def offloading_checkpoint(function: Callable, *args: Any, **kwargs: Any) -> Any:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                return checkpoint_fn(function, *args, **kwargs)

        offloading_checkpoint.ulysses_offload = self  # type: ignore[attr-defined]
        return offloading_checkpoint

    def _pack(self, t: torch.Tensor) -> torch.Tensor | _Offloaded:
        num_bytes = t.numel() * t.element_size()
        if num_bytes < self.min_bytes or isinstance(t, nn.Parameter):
            return t
        pin = self.pin_memory if self.pin_memory is not None else (t.is_cuda and self.device.type == "cpu")
        copy = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, device=self.device, pin_memory=pin)
        copy.copy_(t, non_blocking=pin)
        self.stats.num_tensors += 1
        self.stats.num_bytes += num_bytes
        return _Offloaded(copy, t.device)

    def _unpack(self, packed: torch.Tensor | _Offloaded) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        self.stats.num_restored += 1
        return packed.copy.to(packed.device, non_blocking=packed.copy.is_pinned())
