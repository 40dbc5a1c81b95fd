"""The RNG state a recompute replays, so random ops (dropout) draw what the forward drew.

    state = RngState.capture(device)      before the forward of a piece that is recomputed later
    with state.replayed():                 the recompute: the CPU (and this CUDA device's) generator set
        ...                                to the captured state, the caller's state restored on exit
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


class RngState:
    """The CPU generator's state and, on a CUDA device, that device's."""

    def __init__(self, device: torch.device, cpu: torch.Tensor, cuda: torch.Tensor | None) -> None:
        self.device, self.cpu, self.cuda = device, cpu, cuda

    @classmethod
    def capture(cls, device: torch.device) -> RngState:
        """The state now, for a piece of work on ``device``."""
        cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        return cls(device, torch.get_rng_state(), cuda)

    @contextmanager
    def replayed(self) -> Iterator[None]:
        """Run the body with the captured state; the state before the body is back afterwards."""
        devices = [self.device] if self.cuda is not None else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(self.cpu)
            if self.cuda is not None:
                torch.cuda.set_rng_state(self.cuda, self.device)
            yield
