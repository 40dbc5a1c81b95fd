"""One way to give a module another ``forward`` for a while: an instance attribute, the previous one restored.

    handle = instance_forward(module, fn)   module(...) now runs fn (its class, parameters, hooks and
    ...                                     state_dict stay as they are)
    handle.remove()                         the forward that was there before is back: an instance
                                            forward someone else had set (Accelerate's hooks, a
                                            wrapper's), else the class forward
    with instance_forward(module, fn): ...  the same, scoped

Every forward swap in the package (the tiled lm_head loss, the SP forwards of token mixers) goes
through it, so each restores the same way. Swaps nest: remove them in reverse order (last in, first out).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class InstanceForward:
    """The handle of one forward swap (see the module docstring); ``remove()`` is idempotent."""

    def __init__(self, module: torch.nn.Module, forward: Callable[..., Any]) -> None:
        self.module = module
        self.forward = forward
        self._had_own = "forward" in module.__dict__  # an instance forward was there before ours
        self._previous = module.__dict__.get("forward")
        self._active = True
        module.forward = forward

    def remove(self) -> None:
        """Put back the forward that was there before :func:`instance_forward` (idempotent)."""
        if not self._active:
            return
        self._active = False
        if self._had_own:
            self.module.forward = self._previous
        else:
            self.module.__dict__.pop("forward", None)

    def __enter__(self) -> InstanceForward:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def instance_forward(module: torch.nn.Module, forward: Callable[..., Any]) -> InstanceForward:
    """Make ``forward`` ``module``'s forward until the returned handle's ``remove()`` (or ``with`` exit)."""
    return InstanceForward(module, forward)
