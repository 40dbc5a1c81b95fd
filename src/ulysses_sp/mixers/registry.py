"""Which token-mixing layers outside attention run sequence-parallel, and switching them on and off.

A supported mixer module gets our forward as an instance attribute while SP is registered (its
class, parameters, hooks and ``state_dict`` stay as they are) and gets its previous forward back on
unregister (:func:`ulysses_sp.swaps.instance_forward`, as ``UlyssesSP.forward_loss`` swaps
``lm_head``'s forward): an instance forward set before, such as Accelerate's hook wrapper, survives.
Any other module that mixes tokens outside attention (a depthwise causal ``conv1d``, an SSM
``A_log``, a linear-attention class) is refused at setup: under SP it would see only its shard.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from ulysses_sp.comm.mesh import SPMesh
from ulysses_sp.mixers import gated_delta, mamba2
from ulysses_sp.mixers.sequence import MixerContext
from ulysses_sp.swaps import InstanceForward, instance_forward

_FORWARDS: dict[str, tuple[Callable, Callable]] = {
    **{name: (gated_delta.gated_delta_forward, gated_delta.head_plan) for name in gated_delta.GATED_DELTA_CLASSES},
    **{name: (mamba2.mamba2_forward, mamba2.head_plan) for name in mamba2.MAMBA2_CLASSES},
}
_TOKENWISE_LAYER_TYPES = {"mlp", "moe"}  # layer_types entries of hybrids that hold no token mixer
_MIXER_LAYER_TYPES = {"linear_attention", "mamba"}  # the layer_types entries our mixers implement
_MIXER_NAME_HINTS = ("Mamba", "DeltaNet", "LinearAttention", "Recurrent", "RWKV", "Lightning", "Mixer", "SSM")


def supported_mixers() -> list[str]:
    """Class names of the token-mixing layers with a sequence-parallel forward."""
    return sorted(_FORWARDS)


def _mixes_tokens(module: torch.nn.Module) -> bool:
    """A module that mixes tokens outside attention: SSM parameters, a depthwise conv, or such a class name."""
    if any(name == "A_log" for name, _ in module.named_parameters(recurse=False)):
        return True
    conv = getattr(module, "conv1d", None)
    if isinstance(conv, torch.nn.Conv1d) and conv.groups == conv.in_channels > 1:
        return True
    name = type(module).__name__
    tokenwise = name.endswith(("MLP", "Experts", "Norm", "NormGated"))
    return any(hint in name for hint in _MIXER_NAME_HINTS) and not tokenwise


def _text_decoder(model: torch.nn.Module) -> torch.nn.Module:
    """The text decoder (``get_decoder()``): a VLM's vision / audio tower is not sharded by SP."""
    try:
        decoder = model.get_decoder()
    except (AttributeError, NotImplementedError, ValueError):
        return model
    return decoder if isinstance(decoder, torch.nn.Module) else model


def unsupported_mixer_reasons(model: torch.nn.Module, sp_size: int, layer_types: set[str]) -> list[str]:
    """Why the model's non-attention token mixing cannot run under SP of ``sp_size`` (empty: it can).

    ``layer_types``: the config's ``layer_types`` entries that are not attention layers.
    """
    reasons, supported, unsupported = [], [], set()
    for module in _text_decoder(model).modules():
        name = type(module).__name__
        if name in _FORWARDS:
            supported.append(module)
        elif _mixes_tokens(module) and not any(isinstance(m, torch.nn.Module) and type(m).__name__ in _FORWARDS
                                               for m in module.children()):
            unsupported.add(name)
    kinds = set(layer_types) - _TOKENWISE_LAYER_TYPES
    leftover = kinds - _MIXER_LAYER_TYPES if supported else kinds
    if unsupported or leftover:
        what = sorted(unsupported) or sorted(leftover)
        reasons.append(
            f"token-mixing layers {what} (linear / recurrent / hybrid layers) mix tokens outside attention and would "
            f"see only their shard; sequence-parallel forwards exist for {', '.join(supported_mixers())}"
        )
    for name in sorted({type(m).__name__ for m in supported}):
        module = next(m for m in supported if type(m).__name__ == name)
        plan = _FORWARDS[name][1]
        try:
            plan(module, sp_size)
        except ValueError as err:
            reasons.append(str(err).rstrip("."))
    return reasons


class SPMixers:
    """The sequence-parallel forwards of ``model``'s supported mixers, installed until :meth:`remove`.

    Args:
        model: the (unwrapped) ``PreTrainedModel``.
        mesh: the SP mesh; the mixers exchange over ``mesh.sp_group``.
    """

    def __init__(self, model: torch.nn.Module, mesh: SPMesh) -> None:
        group = mesh.sp_group if mesh.sp_size > 1 else None
        self.context = MixerContext(group, mesh.sp_rank if mesh.sp_size > 1 else 0, mesh.sp_size)
        self.modules = [m for m in model.modules() if type(m).__name__ in _FORWARDS]
        self._swaps: list[InstanceForward] = []  # one per installed module, in install order

    def install(self) -> SPMixers:
        """Each supported mixer's ``forward`` becomes the SP one (instance attribute; idempotent)."""
        if not self._swaps:
            for module in self.modules:
                forward = _FORWARDS[type(module).__name__][0]
                self._swaps.append(instance_forward(module, functools.partial(forward, module, self.context)))
        return self

    def remove(self) -> None:
        """The mixers' forwards from before :meth:`install` again (reverse order; idempotent)."""
        while self._swaps:
            self._swaps.pop().remove()


def install_sp_mixers(model: torch.nn.Module, mesh: SPMesh) -> SPMixers:
    """Install the SP forwards of ``model``'s mixers; call ``.remove()`` on the result to undo it."""
    return SPMixers(model, mesh).install()
