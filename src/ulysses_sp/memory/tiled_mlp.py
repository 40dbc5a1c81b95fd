"""Tiled MLP (ALST-style): the MLP runs over sequence tiles and is recomputed tile by tile in backward.

Shapes: ``B`` batch, ``s`` local sequence, ``t`` tile tokens, ``D`` hidden, ``I`` intermediate.

An MLP ``x_BsD -> y_BsD`` keeps ``(B, s, I)`` activations alive for backward (gate, up, act, their
product). Here only ``x_BsD`` is saved; ``(B, t, I)`` tensors exist for one tile at a time:

    forward (no grad):   x_BsD --split s into tiles--> fn(x_BtD) ... --cat--> y_BsD   save x_BsD
    backward, per tile:  recompute fn(x_BtD) with grad -> autograd.grad(y_BtD, [x_BtD, *params], dy_BtD)
                         dx tiles --cat--> dx_BsD;  param grads summed over tiles, returned ONCE

Returning the summed parameter grads from ``backward`` (instead of accumulating into ``.grad``
by hand) lets autograd's ``AccumulateGrad`` do the accumulation, so DDP / FSDP grad hooks fire
once per parameter per step. The tile count is computed locally from the local length; there are
no collectives inside, so ranks with different lengths cannot deadlock.

DeepSpeed ZeRO-3 partitions parameters in place: a parameter carries ``ds_id`` and is empty
outside its module's forward / backward. Passed as autograd inputs while empty, they would fix
their gradient's shape at ``[0]``; so :func:`grad_params` hands them over as ONE non-tensor
:class:`ZeroParams` argument instead, and each tile's backward runs ``autograd.backward``: the
recompute calls the MLP's submodules, ZeRO-3's own hooks gather their weights (forward and
backward), and the tiles' gradients accumulate in ``.grad`` with ``ds_grad_is_ready = False``
until the last tile, so ZeRO-3 reduces each parameter once (the flag DeepSpeed's own tiled MLP
sets). DeepSpeed is never imported here; ``ds_id`` is the only thing read.

Contract for ``mlp_forward_fn``: token-wise (output position i depends only on input position i),
returns one tensor, deterministic (no dropout: the recompute must reproduce the forward).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import nn

_SEQ_DIM = -2  # x is (..., s, D)


def _tile_size(seq_len: int, num_tiles: int) -> int:
    return max(1, math.ceil(seq_len / max(1, num_tiles)))


class TiledTokensFunction(torch.autograd.Function):
    """``apply(fn, x, tile, dim, *params) -> tuple of outputs``, ``fn`` run on tiles of ``x`` along ``dim``.

    ``fn(x_tile)`` returns a tuple of tensors whose size along ``dim`` is the tile's; the outputs
    are concatenated along ``dim``. ``params``: the tensors of ``fn`` that should receive
    gradients (those requiring grad); parameters left out (frozen ones) get none. Backward
    recomputes each tile with grad and skips outputs that received no gradient.
    """

    @staticmethod
    def forward(ctx, fn: Callable, x: torch.Tensor, tile: int, dim: int, *params: torch.Tensor):
        return _tiled_forward(ctx, fn, x, tile, dim, params)

    @staticmethod
    def backward(ctx, *grads_out: torch.Tensor | None):
        dx, param_grads = _tiled_backward(ctx, grads_out, first_param_input=4)
        return (None, dx, None, None, *param_grads)


class ZeroParams(tuple):
    """ZeRO-3 parameters given to a tiled function as one non-tensor argument (module docstring)."""


def grad_params(module: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list]:
    """``(x, params)`` to hand a tiled function for ``module``'s trainable parameters.

    Plain parameters are passed as they are. ZeRO-3 ones (``ds_id``) become one
    :class:`ZeroParams`; as they are then no autograd inputs, an ``x`` without grad becomes a
    leaf that requires it, so the function still gets a backward.
    """
    params = [p for p in module.parameters() if p.requires_grad]
    if not any(hasattr(p, "ds_id") for p in params):
        return x, params
    return (x if x.requires_grad else x.detach().requires_grad_()), [ZeroParams(params)]


def _tiled_forward(ctx, fn: Callable, x: torch.Tensor, tile: int, dim: int, params: Sequence[torch.Tensor]):
    """Run ``fn`` on tiles of ``x`` without grad; save only ``x`` and ``params`` for backward."""
    ctx.fn, ctx.tile, ctx.dim = fn, tile, dim
    ctx.set_materialize_grads(False)
    device_type = x.device.type
    ctx.autocast = (device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
    ctx.zero_params = next((p for p in params if isinstance(p, ZeroParams)), ())
    ctx.save_for_backward(x, *(p for p in params if isinstance(p, torch.Tensor)))
    with torch.no_grad():
        # contiguous: a sequence tile of a (B > 1, s, D) batch is strided, and MLPs that flatten with
        # .view (GPT-2's Conv1D) would fail on it
        tiles = [fn(x_tile.contiguous()) for x_tile in x.split(tile, dim=dim)]
    return tuple(torch.cat(parts, dim=dim) for parts in zip(*tiles))


def _tiled_backward(ctx, grads_out: Sequence[torch.Tensor | None], first_param_input: int):
    """Recompute each tile with grad; ``(dx or None, [grad or None per param input])``.

    ``first_param_input``: index of the first ``*params`` input in ``ctx.needs_input_grad``.
    """
    x, *params = ctx.saved_tensors
    need_dx = ctx.needs_input_grad[1]
    needs = ctx.needs_input_grad[first_param_input:]
    wanted = [p for p, need in zip(params, needs) if need]
    param_grads: list[torch.Tensor | None] = [None] * len(wanted)
    dx = torch.empty_like(x, memory_format=torch.contiguous_format) if need_dx else None  # tiles written in place
    device_type, autocast_on, autocast_dtype = ctx.autocast
    tiles = x.split(ctx.tile, dim=ctx.dim)
    for i, x_tile in enumerate(tiles):
        start, length = i * ctx.tile, x_tile.shape[ctx.dim]
        x_t = x_tile.detach().contiguous().requires_grad_(need_dx)
        with torch.enable_grad(), torch.autocast(device_type, enabled=autocast_on, dtype=autocast_dtype):
            outs = ctx.fn(x_t)
        pairs = [(o, g.narrow(ctx.dim, start, length)) for o, g in zip(outs, grads_out)
                 if g is not None and o.requires_grad]
        inputs = ([x_t] if need_dx else []) + wanted
        if pairs and ctx.zero_params:
            grads = _zero3_tile_backward(pairs, x_t if need_dx else None, ctx.zero_params, last=i == len(tiles) - 1)
        elif pairs:
            outputs, grads_in = [o for o, _ in pairs], [g for _, g in pairs]
            grads = list(torch.autograd.grad(outputs, inputs, grads_in, allow_unused=True))
        else:
            grads = [None] * len(inputs)
        if need_dx:
            d = grads.pop(0)
            target = dx.narrow(ctx.dim, start, length)
            target.zero_() if d is None else target.copy_(d)
        for j, g in enumerate(grads):
            if g is not None:
                param_grads[j] = g if param_grads[j] is None else param_grads[j] + g
        del outs, pairs, grads  # free this tile's recomputed graph before the next tile
    it = iter(param_grads)
    return dx, [next(it) if need else None for need in needs]


def _zero3_tile_backward(pairs, x_t: torch.Tensor | None, params: Sequence[torch.Tensor], last: bool) -> list:
    """One tile's backward with ZeRO-3 parameters: ``[dx]`` (``[]`` without ``x_t``; module docstring).

    Parameter gradients go to ``.grad`` through ZeRO-3's hooks; ``ds_grad_is_ready`` is False
    before the last tile so they are reduced once, after the sum over all tiles.
    """
    for p in params:
        p.ds_grad_is_ready = last
    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    return [x_t.grad] if x_t is not None else []


class TiledMLPFunction(torch.autograd.Function):
    """``TiledMLPFunction.apply(mlp_forward_fn, x_BsD, num_tiles, *params) -> y_BsD``.

    A single-output MLP over ``num_tiles`` sequence tiles: the case of :class:`TiledTokensFunction`
    with one output along ``s`` (same forward and backward engine). ``params``: the tensors of
    ``mlp_forward_fn`` that should receive gradients (those requiring grad); parameters left out
    (frozen ones) get none.
    """

    @staticmethod
    def forward(ctx, mlp_forward_fn: Callable, x_BsD: torch.Tensor, num_tiles: int, *params: torch.Tensor):
        tile = _tile_size(x_BsD.shape[_SEQ_DIM], num_tiles)

        def one_output(x_BtD: torch.Tensor) -> tuple[torch.Tensor]:
            return (_call(mlp_forward_fn, x_BtD),)

        (y_BsD,) = _tiled_forward(ctx, one_output, x_BsD, tile, _SEQ_DIM, params)
        return y_BsD

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor | None):
        dx, param_grads = _tiled_backward(ctx, (grad_y,), first_param_input=3)
        return (None, dx, None, *param_grads)


def _call(fn: Callable, x: torch.Tensor) -> torch.Tensor:
    y = fn(x)
    if not isinstance(y, torch.Tensor):
        raise TypeError(
            f"tiled MLP: the wrapped MLP returned {type(y).__name__}, not one tensor; only token-wise "
            "MLPs returning a single tensor can be tiled (MoE blocks: use TiledMoE)."
        )
    return y


class TiledMLP(nn.Module):
    """Wraps ``mlp`` so it runs in tiles of at most ``tile_tokens`` tokens (see module docstring).

    ``state_dict`` / ``load_state_dict`` keys are those of the unwrapped model (``...mlp.up_proj``,
    not ``...mlp.mlp.up_proj``), so checkpoints stay interchangeable with and without tiling.
    """

    def __init__(self, mlp: nn.Module, tile_tokens: int):
        super().__init__()
        if tile_tokens < 1:
            raise ValueError(f"tile_tokens must be >= 1, got {tile_tokens}; use e.g. 1024 (tokens per tile).")
        self.mlp = mlp
        self.tile_tokens = tile_tokens
        self.register_state_dict_post_hook(_strip_wrapper_keys)
        self.register_load_state_dict_pre_hook(_add_wrapper_keys)

    def forward(self, x_BsD: torch.Tensor) -> torch.Tensor:
        num_tiles = math.ceil(x_BsD.shape[_SEQ_DIM] / self.tile_tokens)  # local: no collective
        x_BsD, params = grad_params(self.mlp, x_BsD)
        return TiledMLPFunction.apply(self.mlp, x_BsD, num_tiles, *params)

    def extra_repr(self) -> str:
        return f"tile_tokens={self.tile_tokens}"


def _strip_wrapper_keys(module, state_dict, prefix, local_metadata) -> None:
    inner = prefix + "mlp."
    for key in [k for k in state_dict if k.startswith(inner)]:
        state_dict[prefix + key[len(inner):]] = state_dict.pop(key)


def _add_wrapper_keys(module, state_dict, prefix, *args) -> None:
    inner = prefix + "mlp."
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
        state_dict[inner + key[len(prefix):]] = state_dict.pop(key)
