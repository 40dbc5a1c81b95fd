"""Head blocks on a transformers model: each text attention module runs one chunk of heads at a time,
its projections included (the engine is ``memory.head_blocks``), where its structure allows it.

Shapes: ``B`` batch, ``s`` local shard, ``D`` hidden, ``N`` / ``K`` query / kv heads, ``H`` / ``Hv``
q-k / v head dims, ``G`` head blocks, ``P`` the all-to-all degree.

    blocks = HeadBlocks(base, attention, head_chunks, head_chunk_bytes)
    blocks.install()          # {module name: why it keeps the attention-call chunking}
    blocks.remove()           # every module's forward back

Block ``g`` is a run of whole kv groups (kv heads ``[a, b)``) and their query heads. While it runs,
the module's own forward is called with ``q_proj`` / ``k_proj`` / ``v_proj`` computing only the
block's rows and ``o_proj`` only its columns (its bias in block 0): instance forwards restored after
the call, so the model's code runs unchanged on fewer heads, and the attention call inside is one
head chunk of ``UlyssesAttention`` (``stashing``). A module qualifies when its heads are separable:

  - its forward is transformers' own (the family sweep checks those: a q row layout per head, a
    gated q projection of ``2H`` a head included, nothing after ``o_proj`` that is not linear in it)
  - ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` are plain ``nn.Linear`` whose sizes match the
    config's ``N`` / ``K`` heads
  - every other child with parameters is a per-head norm (a weight of ``H`` elements)
  - no parameter of its own (GPT-OSS sinks) and no ZeRO-3 parameter
  - no head-count attribute (``num_heads``, ``hidden_size`` ...) its forward could reshape with
  - it belongs to the text model (its config is the text config; towers keep their own kernel)

Anything else keeps the attention-call chunking (``comm.head_chunked``), which is exact for all.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ulysses_sp.attention import UlyssesAttention
from ulysses_sp.comm.cost import chunk_live_bytes, head_block_ranges
from ulysses_sp.comm.layout import HeadPlan
from ulysses_sp.integrations import vlm
from ulysses_sp.memory.head_blocks import BlockCall, GradBuffer, head_blocks, linear_graph_only, linear_into
from ulysses_sp.swaps import InstanceForward, instance_forward

_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
_HEAD_NORMS = ("q_norm", "k_norm")
# sizes a forward may reshape with (``view(b, s, self.num_heads, d)``): a module holding one runs unsliced
_SIZE_ATTRIBUTES = ("num_heads", "num_attention_heads", "num_key_value_heads", "hidden_size", "embed_dim",
                    "all_head_size")


def block_refusal(module: nn.Module) -> str | None:
    """Why ``module`` (an attention module with the four projections) cannot run as head blocks, or None."""
    config = getattr(module, "config", None)
    N = getattr(config, "num_attention_heads", None)
    K = getattr(config, "num_key_value_heads", None) or N
    H = getattr(module, "head_dim", None)
    if not isinstance(N, int) or not isinstance(K, int) or not isinstance(H, int) or N % K:
        return "no num_attention_heads / num_key_value_heads / head_dim to split the projections by"
    q, k, v, o = (getattr(module, name) for name in _PROJECTIONS)
    if any(type(p) is not nn.Linear for p in (q, k, v, o)):
        return "a projection is not a plain nn.Linear (LoRA, quantized or fused)"
    if q.out_features % N or k.out_features != K * H or v.out_features % K or o.in_features != N * (
            v.out_features // K):
        return f"projection sizes do not split into {N} query / {K} kv heads of {H}"
    if not getattr(type(module).forward, "__module__", "").startswith("transformers.models."):
        # a forward we have not run: its q row layout (a gate interleaved per head or not), a residual or a
        # nonlinearity after o_proj would make the sum over blocks silently wrong; transformers' own forwards
        # are checked family by family (scripts/model_families.py --memory-features)
        return "its forward is not one of transformers' models (remote code?), whose head separability is unchecked"
    if getattr(module, "num_key_value_groups", N // K) != N // K:
        return "num_key_value_groups differs from the config's heads"
    sizes = [name for name in _SIZE_ATTRIBUTES if isinstance(getattr(module, name, None), int)]
    if sizes:
        return f"its forward may size tensors by {sizes[0]} (all heads), not by the projections' outputs"
    if next(module.parameters(recurse=False), None) is not None:
        return "parameters of its own (e.g. attention sinks)"
    for name, child in module.named_children():
        if name in _PROJECTIONS or next(child.parameters(), None) is None:
            continue
        if name not in _HEAD_NORMS or sum(p.numel() for p in child.parameters()) != H:
            return f"child {name!r} has parameters that are not a per-head norm"
    if any(hasattr(p, "ds_id") for p in module.parameters()):
        return "ZeRO-3 parameters"
    return None


class _Module:
    """One qualifying attention module: its head counts, its forward before ours, our swap."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.N, self.H = module.config.num_attention_heads, module.head_dim
        self.K = getattr(module.config, "num_key_value_heads", None) or self.N
        self.Hv = module.v_proj.out_features // self.K
        self.original = module.forward  # the forward before ours (an instance forward someone set, or the class's)
        self.swap: InstanceForward | None = None
        # o_proj's output, as the forward of the block in progress made it: the module returns it as it is
        # (its recompute in backward then needs only o_proj's graph, not its values; ``linear_graph_only``)
        self.o_out: torch.Tensor | None = None
        self.returns_o, self.o_dtype = False, torch.float32

    @contextlib.contextmanager
    def sliced(self, kv: tuple[int, int], first: bool, x: torch.Tensor, x_grad: GradBuffer | None) -> Iterator[None]:
        """The four projections restricted to the heads of kv range ``kv`` while inside; q/k/v called on
        ``x`` itself add its gradient into ``x_grad`` (backward) through ``linear_into``."""
        a, b = kv
        group, m = self.N // self.K, self.module
        rows = {"q_proj": (a * group, b * group, m.q_proj.out_features // self.N), "k_proj": (a, b, self.H),
                "v_proj": (a, b, self.Hv)}
        with contextlib.ExitStack() as stack:
            for name, (lo, hi, width) in rows.items():
                stack.enter_context(instance_forward(getattr(m, name), _rows(getattr(m, name), lo * width, hi * width,
                                                                              x, x_grad)))
            o_cols = self._columns(a * group * self.Hv, b * group * self.Hv, first, x_grad is not None)
            stack.enter_context(instance_forward(m.o_proj, o_cols))
            yield

    def _columns(self, lo: int, hi: int, with_bias: bool, backward: bool):
        linear = self.module.o_proj

        def forward(a: torch.Tensor) -> torch.Tensor:
            weight, bias = linear.weight[:, lo:hi], linear.bias if with_bias else None
            if backward and self.returns_o:
                return linear_graph_only(a, weight, bias, self.o_dtype)
            self.o_out = out = F.linear(a, weight, bias)
            self.o_dtype = out.dtype
            return out
        return forward


def _rows(linear: nn.Linear, lo: int, hi: int, source: torch.Tensor, x_grad: GradBuffer | None):
    def forward(x: torch.Tensor) -> torch.Tensor:
        into = x_grad if x is source else None  # anything else (a cast, another tensor): autograd's path
        return linear_into(x, linear.weight[lo:hi], None if linear.bias is None else linear.bias[lo:hi], into)
    return forward


def _needs_grad(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.requires_grad
    if isinstance(value, (tuple, list)):
        return any(_needs_grad(v) for v in value)
    if isinstance(value, dict):
        return any(_needs_grad(v) for v in value.values())
    return False


class HeadBlocks:
    """Head blocks on the text attention modules of ``base`` (module docstring).

    Args:
        base: the unwrapped ``PreTrainedModel``.
        attention: our ``UlyssesAttention`` (its all-to-all group; no ring).
        head_chunks: the blocks wanted (``UlyssesSPConfig.sp_head_chunks``), capped per module so
            each block gives every rank a query head.
        head_chunk_bytes: or as many blocks as keep one block's full-length tensors under this many
            bytes (``comm.cost.chunk_live_bytes``), whichever is more; None: off.
    """

    def __init__(self, base: nn.Module, attention: UlyssesAttention, head_chunks: int,
                 head_chunk_bytes: int | None) -> None:
        self.base, self.attention = base, attention
        self.head_chunks, self.head_chunk_bytes = head_chunks, head_chunk_bytes
        self.installed: list[_Module] = []

    def install(self) -> dict[str, str]:
        """Swap the forward of every qualifying module; ``{name: refusal}`` for the attention modules left alone."""
        root = vlm.language_model(self.base) or self.base
        text_config = self.base.config.get_text_config()
        refused = {}
        for name, module in root.named_modules():
            if not all(isinstance(getattr(module, p, None), nn.Module) for p in _PROJECTIONS):
                continue
            if getattr(module, "config", None) is not text_config:  # a vision / audio tower's: not under SP
                refused[name] = "not the text model's attention (its config is not the text config)"
                continue
            reason = block_refusal(module)
            if reason is not None:
                refused[name] = reason
                continue
            entry = _Module(module)
            entry.swap = instance_forward(module, self._forward(entry))
            self.installed.append(entry)
        return refused

    def remove(self) -> None:
        """Every swapped module's forward back (reverse order)."""
        while self.installed:
            self.installed.pop().swap.remove()

    def blocks(self, entry: _Module, x_BsD: torch.Tensor) -> tuple[tuple[int, int], ...]:
        """The blocks of one call (``comm.cost.head_block_ranges``): ``head_chunks`` of them, or more if the
        byte target needs them."""
        P, N, K = self.attention.a2a_size, entry.N, entry.K
        ranges = head_block_ranges(N, K, P, self.head_chunks)
        if self.head_chunk_bytes is not None:
            B, s = x_BsD.shape[0], x_BsD.shape[1]

            def live(blocks: tuple[tuple[int, int], ...]) -> int:
                return max(chunk_live_bytes(HeadPlan((b - a) * (N // K), b - a, P), 1, B, s * P, entry.H, entry.Hv,
                                            x_BsD.element_size()) for a, b in blocks)
            for G in range(len(ranges), K + 1):
                candidate = head_block_ranges(N, K, P, G)
                if live(candidate) <= self.head_chunk_bytes or len(candidate) < G:
                    return candidate  # fits, or the most blocks there are
                ranges = candidate
        return ranges

    def _forward(self, entry: _Module):
        def forward(*args: Any, **kwargs: Any) -> Any:
            x_BsD = args[0] if args else kwargs.pop("hidden_states")
            rest = args[1:]
            ranges = self.blocks(entry, x_BsD) if x_BsD.dim() == 3 and self.attention.a2a_size > 1 else ((0, 0),)
            params = [p for p in entry.module.parameters() if p.requires_grad]
            # inputs besides x with grad, or ZeRO-3 partitioned weights (wrapped after registration): the plain
            # forward (attention-call chunks) is exact
            if len(ranges) < 2 or _needs_grad((rest, kwargs)) or any(hasattr(p, "ds_id") for p in params):
                return entry.original(x_BsD, *rest, **kwargs)
            extra: list = []

            def block(g: int, x: torch.Tensor, call: BlockCall) -> torch.Tensor:
                with entry.sliced(ranges[g], g == 0, x, call.x_grad), self.attention.stashing(call.stash):
                    out = entry.original(x, *rest, **kwargs)
                if call.x_grad is None:  # forward: did the module return o_proj's output untouched?
                    entry.returns_o = out[0] is entry.o_out
                entry.o_out = None
                extra[:] = out[1:]
                return out[0]

            y_BsD = head_blocks(block, len(ranges), x_BsD, params)
            return (y_BsD, *extra)
        return forward
