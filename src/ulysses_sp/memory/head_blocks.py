"""Head blocks (UPipe-style): the whole attention block, projections included, one chunk of heads at a time.

Shapes: ``B`` batch, ``s`` local sequence, ``D`` hidden, ``G`` head blocks.

An attention block ``x_BsD -> y_BsD`` (q/k/v projections, per-head norms and RoPE, attention,
``o_proj``) is a sum over heads: ``y = sum_g block_g(x)`` where ``block_g`` uses the projection rows
and ``o_proj`` columns of block ``g``'s heads (``o_proj``'s bias in block 0). Here only ``x`` is
saved, and the sharded attention output of each block (what ``o_proj`` saves anyway)::

    forward (no grad):   for g: y += block_g(x)       attention calls leave their output, kept kernel
                                                      graphs and RNG state in block g's ChunkStash
    backward, per g:     recompute block_g(x) with grad, the RNG state of its forward replayed:
                         the projections run again, the attention calls REPLAY the stash (no kernel
                         forward, no collective), then autograd.grad(y_g, params, dy); the
                         projections (``linear_into``) add x's gradient straight into ONE dx buffer
                         (no (B,s,D) gradient per projection and block); param grads summed over
                         blocks, returned ONCE

So q/k/v of all heads exist neither sharded nor at full length, forward or backward: only block
g's. Returning the summed parameter grads from ``backward`` lets autograd's ``AccumulateGrad`` fire
DDP / FSDP hooks once per parameter per step (as in ``memory.tiled_mlp``). Under activation
checkpointing the stashed outputs are saved through ``save_for_backward``, so the checkpoint's
hooks see them (and drop them) like any saved tensor.

Contract for ``block``: ``block(g, x, call) -> y_g`` (:class:`BlockCall`); its attention runs inside
``UlyssesAttention.stashing(call.stash)``, its projections of ``x`` through ``linear_into(...,
call.x_grad)``; the same calls in the same order every time for one ``g``. A use of ``x`` outside
``linear_into`` still gets its gradient (through autograd, added to the buffer).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ulysses_sp.comm.head_chunked import ChunkStash
from ulysses_sp.comm.rng import RngState
from ulysses_sp.comm.saved_graph import free_storage


class GradBuffer:
    """A gradient summed in place over blocks, allocated (zeros, x's shape) at its first contribution: the
    first block's attention backward runs before it exists."""

    def __init__(self, like: torch.Tensor) -> None:
        self.like, self.tensor = like, None

    def get(self) -> torch.Tensor:
        """The buffer (allocated now if this is the first contribution)."""
        if self.tensor is None:
            self.tensor = torch.zeros_like(self.like, memory_format=torch.contiguous_format)
        return self.tensor


@dataclasses.dataclass
class BlockCall:
    """What one run of a head block gets besides ``x``.

    Attributes:
        stash: where its attention calls keep (forward) or find (backward) their results; None
            without grad (nothing to keep).
        x_grad: in backward, where ``linear_into`` adds x's ``(B, s, D)`` gradient; None in forward.
    """

    stash: ChunkStash | None
    x_grad: GradBuffer | None = None


Block = Callable[[int, torch.Tensor, BlockCall], torch.Tensor]
"""``block(g, x_BsD, call) -> y_BsD``: head block ``g`` of the attention block (module docstring)."""


def _weight_grads(ctx, dy2: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> tuple:
    """A linear's ``(d weight, d bias)`` (None where not needed) from ``dy (T, out)`` and its input ``x``."""
    dw = (dy2.t() @ x.reshape(-1, x.shape[-1]).to(dy2.dtype)).to(weight.dtype) if ctx.needs_input_grad[1] else None
    db = dy2.sum(0).to(weight.dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
    return dw, db


def _sum_blocks(block: Block, x_BsD: torch.Tensor, calls: list[BlockCall]) -> torch.Tensor:
    """``sum_g block(g, x, calls[g])``, accumulated in place (one block's output extra at a time)."""
    y_BsD = None
    for g, call in enumerate(calls):
        y_g = block(g, x_BsD, call)
        y_BsD = y_g if y_BsD is None else y_BsD.add_(y_g)
        del y_g
    return y_BsD


class _LinearInto(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, into):
        ctx.save_for_backward(x, weight)
        ctx.into, ctx.has_bias = into, bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        into = ctx.into.get() if isinstance(ctx.into, GradBuffer) else ctx.into
        dy2 = dy.reshape(-1, dy.shape[-1])
        into.view(-1, into.shape[-1]).addmm_(dy2.to(into.dtype), weight.to(into.dtype))
        return None, *_weight_grads(ctx, dy2, x, weight), None


class _LinearGraphOnly(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, dtype):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return x.new_zeros((), dtype=dtype).expand(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = (dy2 @ weight.to(dy.dtype)).to(x.dtype).view(x.shape) if ctx.needs_input_grad[0] else None
        return dx, *_weight_grads(ctx, dy2, x, weight), None


def linear_graph_only(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      dtype: torch.dtype) -> torch.Tensor:
    """``F.linear``'s graph without its values: the output reads as zeros (one stride-0 element of
    ``dtype``), the backward is F.linear's. For the last op of a recomputed block whose output values
    nobody reads (saves the ``(B, s, D)`` output and its matmul)."""
    return _LinearGraphOnly.apply(x, weight, bias, dtype)


def linear_into(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                into: torch.Tensor | GradBuffer | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; with ``into`` (x's shape, contiguous, or a :class:`GradBuffer`), x's
    gradient is added into it in place in backward instead of flowing back through autograd (x itself
    then gets none from here)."""
    if into is None or not torch.is_grad_enabled():
        return F.linear(x, weight, bias)
    return _LinearInto.apply(x, weight, bias, into)


class _HeadBlocks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, block: Block, num_blocks: int, x_BsD: torch.Tensor, *params: torch.Tensor):
        ctx.block, ctx.stashes = block, [ChunkStash() for _ in range(num_blocks)]
        device_type = x_BsD.device.type
        ctx.autocast = (device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
        ctx.rng = []

        def capturing(g: int, x: torch.Tensor, call: BlockCall) -> torch.Tensor:
            ctx.rng.append(RngState.capture(x.device))  # the state block g's recompute replays
            return block(g, x, call)

        y_BsD = _sum_blocks(capturing, x_BsD, [BlockCall(stash) for stash in ctx.stashes])
        outs = [out for stash in ctx.stashes for out in stash.outputs()]
        ctx.num_outs = [len(stash.runs) for stash in ctx.stashes]
        ctx.save_for_backward(x_BsD, *params, *outs)
        ctx.num_params = len(params)
        return y_BsD

    @staticmethod
    def backward(ctx, dy_BsD: torch.Tensor):
        x_BsD, *rest = ctx.saved_tensors
        params, outs = rest[:ctx.num_params], rest[ctx.num_params:]
        need_dx, needs = ctx.needs_input_grad[2], ctx.needs_input_grad[3:]
        wanted = [p for p, need in zip(params, needs) if need]
        dx = GradBuffer(x_BsD) if need_dx else None
        param_grads: list[torch.Tensor | None] = [None] * len(wanted)
        device_type, autocast_on, autocast_dtype = ctx.autocast
        for g, stash in enumerate(ctx.stashes):
            block_outs = outs[sum(ctx.num_outs[:g]):sum(ctx.num_outs[:g + 1])]
            stash.replay(block_outs)
            x_leaf = x_BsD.detach().requires_grad_(need_dx)
            with torch.enable_grad(), torch.autocast(device_type, enabled=autocast_on, dtype=autocast_dtype), \
                    ctx.rng[g].replayed():
                y_g = ctx.block(g, x_leaf, BlockCall(stash, dx))
            inputs = ([x_leaf] if need_dx else []) + wanted
            grads = list(torch.autograd.grad(y_g, inputs, dy_BsD, allow_unused=True)) if y_g.requires_grad \
                else [None] * len(inputs)
            del y_g, stash.runs[:]  # this block's graph and held results go before the next block's
            free_storage(*block_outs)  # read by nothing else: a second backward recomputes the attention
            if need_dx:
                d = grads.pop(0)  # x's gradient from uses outside linear_into (none for a plain block)
                if d is not None:
                    dx.get().add_(d)
            param_grads = [a if b is None else b if a is None else a + b for a, b in zip(param_grads, grads)]
        it = iter(param_grads)
        return (None, None, dx.get() if need_dx else None, *(next(it) if need else None for need in needs))


def head_blocks(block: Block, num_blocks: int, x_BsD: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
    """``sum_g block(g, x_BsD, stash_g)`` over ``num_blocks`` head blocks, recomputed block by block in backward.

    Args:
        block: one head block of the attention block (contract in the module docstring).
        num_blocks: ``G``, the head blocks (>= 1).
        x_BsD: the attention block's input (``(B, s, D)``: the normed hidden states of this rank).
        params: the tensors ``block`` reads that should receive gradients (those requiring grad).

    Returns:
        ``y (B, s, D)``. Without grad (eval) the blocks just run one after the other.
    """
    if not torch.is_grad_enabled() or not (x_BsD.requires_grad or any(p.requires_grad for p in params)):
        return _sum_blocks(block, x_BsD, [BlockCall(None)] * num_blocks)
    return _HeadBlocks.apply(block, num_blocks, x_BsD, *params)
