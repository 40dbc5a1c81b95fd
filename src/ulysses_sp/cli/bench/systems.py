"""The systems the benchmark compares, each as one training step on the same model and batch.

    single           one process, plain Transformers (full sequence, SDPA, no SP), all the cores
    ulysses          ours: UlyssesSP (one fused q|k|v all-to-all + one output all-to-all per layer)
    ulysses_chunked  ours: UlyssesSP with UlyssesSPConfig(sp_head_chunks=C): C chunks of heads, the
                     full-length attention tensors of one chunk at a time, forward and backward
    ring             ours: UlyssesSP with UlyssesSPConfig(sp_backend="ring") (RingAttention)
    ulysses_ring     ours: Ulysses x ring, UlyssesSPConfig(sp_ring_size=R): all-to-all inside groups of
                     P/R ranks, ring attention across the R segments
    deepspeed  DeepSpeed ALST: UlyssesSPAttentionHF.register_with_transformers, its data loader
               adapter and the HF Trainer's SP loss aggregation (transformers'
               ``deepspeed_sp_compute_loss``), as HF / Accelerate wire it

A step = forward + loss + backward + gradient averaging over the SP group (one flat all-reduce,
what DDP would do) + SGD update. Every system starts from the same weights (same seed) and sees
the same global batch, so the first step's loss must agree across systems.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ulysses_sp import CommCounter

SYSTEMS = ("single", "ulysses", "ulysses_chunked", "ring", "ulysses_ring", "deepspeed")


@dataclass(frozen=True)
class ModelSpec:
    """A Llama-style decoder built in code with random weights (no download)."""

    vocab_size: int = 2048
    hidden_size: int = 256
    intermediate_size: int = 512
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 32


def build_model(
    spec: ModelSpec, max_len: int, device: torch.device, dtype: torch.dtype, attn: str = "sdpa"
) -> torch.nn.Module:
    """The benchmark model, identical on every rank and in every system (seed 0); ``attn``: its kernel."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers, num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads, head_dim=spec.head_dim, max_position_embeddings=max_len,
        tie_word_embeddings=False, attn_implementation=attn, use_cache=False,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device=device, dtype=dtype).train()


def make_batch(spec: ModelSpec, batch_size: int, seq_len: int, device: torch.device) -> torch.Tensor:
    """``(B, S)`` random token ids, the same on every rank (seed 1)."""
    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, spec.vocab_size, (batch_size, seq_len), generator=gen).to(device)


def make_packed(ids_BS: torch.Tensor, documents: int) -> dict[str, torch.Tensor]:
    """The batch as ``documents`` equal documents per row: ``position_ids`` restart at each, and the
    first token of each document is no label (no prediction crosses a boundary, in every system)."""
    B, S = ids_BS.shape
    positions = torch.arange(S, device=ids_BS.device).remainder(S // documents).expand(B, S)
    return {"input_ids": ids_BS, "labels": ids_BS.masked_fill(positions == 0, -100), "position_ids": positions}


def _average_grads(model: torch.nn.Module, group) -> None:
    """DDP-style gradient averaging over ``group`` in ONE all-reduce of a flat buffer."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= dist.get_world_size(group)
    off = 0
    for g in grads:
        g.copy_(flat[off : off + g.numel()].view_as(g))
        off += g.numel()


@dataclass
class Step:
    """One system ready to train: ``run(counter)`` does one step and returns the global loss;
    ``close()`` undoes what its setup registered with transformers (attention registry entries)."""

    run: Callable[[CommCounter], float]
    num_layers: int
    close: Callable[[], None] = lambda: None


def _finish(model, optimizer, loss, counter: CommCounter, group) -> None:
    with counter.in_phase("backward"):
        loss.backward()
    with counter.in_phase("sync"):
        if group is not None:
            _average_grads(model, group)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def single_step(model, ids_BS: torch.Tensor, own_kernel_key: bool = False, documents: int = 1,
                counter: CommCounter | None = None) -> Step:
    """No sequence parallelism: the full sequence in one process.

    ``own_kernel_key``: run the model's attention function under a key of its own, so that a
    DeepSpeed system set up later in the same process (it replaces the kernel's entry in
    transformers' registry) does not reach it. ``counter``: time the attention with
    ``counter.scoped`` (under a key of its own too).
    """
    close = _no_close
    if own_kernel_key or counter is not None:
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        from ulysses_sp import current_attn_implementation, unregister_attention_function

        attn = current_attn_implementation(model)
        key = f"ulysses_sp_bench_single_{attn}"
        function = ALL_ATTENTION_FUNCTIONS[attn]
        AttentionInterface.register(key, counter.scoped(function) if counter is not None else function)
        # the kernel's own masks too: transformers builds NO mask for a key its mask registry lacks (a
        # packed row would then attend across its documents)
        AttentionMaskInterface.register(key, ALL_MASK_ATTENTION_FUNCTIONS[attn])
        model.set_attn_implementation(key)

        def close() -> None:
            model.set_attn_implementation(attn)
            unregister_attention_function(key)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    batch = make_packed(ids_BS, documents) if documents > 1 else {"input_ids": ids_BS, "labels": ids_BS}

    def run(counter: CommCounter) -> float:
        with counter.in_phase("forward"):
            loss = model(**batch).loss
        _finish(model, optimizer, loss, counter, None)
        return float(loss.detach())

    return Step(run, model.config.num_hidden_layers, close)


def _no_close() -> None:
    return None


def ours_step(model, ids_BS: torch.Tensor, mesh, counter: CommCounter, backend: str, head_chunks: int = 1,
              ring_size: int | None = None, documents: int = 1) -> Step:
    """``UlyssesSP`` with
    ``UlyssesSPConfig(sp_backend=backend, sp_head_chunks=head_chunks, sp_ring_size=ring_size)``."""
    from ulysses_sp import UlyssesSP, UlyssesSPConfig, global_num_items, reported_loss

    config = UlyssesSPConfig(sp_size=mesh.sp_size, sp_backend=backend, sp_head_chunks=head_chunks,
                             sp_ring_size=ring_size)
    sp = UlyssesSP(model, mesh, config)
    sp.wrap_attention(counter.scoped).register()
    shard = sp.shard(make_packed(ids_BS, documents) if documents > 1 else {"input_ids": ids_BS})
    group = mesh.sp_group if mesh.sp_size > 1 else None
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)

    def run(counter: CommCounter) -> float:
        with counter.in_phase("forward"):
            num_items = global_num_items(shard["shift_labels"], group=group)
            loss = sp.forward_loss(model, shard, num_items)
        _finish(model, optimizer, loss, counter, group)
        return float(reported_loss(loss, mesh.sp_size, group))

    return Step(run, model.config.num_hidden_layers, sp.unregister)


def deepspeed_step(model, ids_BS: torch.Tensor, mesh, counter: CommCounter, documents: int = 1) -> Step:
    """DeepSpeed's UlyssesSPAttentionHF wired as HF Accelerate / Trainer do (ALST)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if ids_BS.device.type == "cpu" else "cuda")
    import deepspeed
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    deepspeed.init_distributed(dist_backend=dist.get_backend(), verbose=False)
    B, S = ids_BS.shape
    from ulysses_sp import current_attn_implementation

    attn = current_attn_implementation(model)
    original = ALL_ATTENTION_FUNCTIONS[attn]  # DeepSpeed and the counter replace it; close() puts it back
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation=attn, sequence_parallel_size=mesh.sp_size,
        micro_batch_size=B, seq_length=S, seq_length_is_variable=False,
    )
    ALL_ATTENTION_FUNCTIONS[attn] = counter.scoped(ALL_ATTENTION_FUNCTIONS[attn])
    packed = make_packed(ids_BS, documents)
    rows = [{k: t[b].cpu() for k, t in packed.items()} for b in range(B)]
    loader = torch.utils.data.DataLoader(rows, batch_size=B)
    group = mpu.get_sequence_parallel_group()
    adapter = UlyssesSPDataLoaderAdapter(loader, mpu.get_sequence_parallel_rank(), group, mesh.sp_size, ids_BS.device)
    inputs = {k: v.to(ids_BS.device) for k, v in next(iter(adapter)).items()}
    inputs["labels"] = inputs["shift_labels"]  # as transformers' deepspeed_sp_compute_loss does
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)

    def run(counter: CommCounter) -> float:
        with counter.in_phase("forward"):
            loss = model(**inputs).loss
            # transformers.integrations.deepspeed.deepspeed_sp_compute_loss: weighted aggregation
            losses = torch.stack(torch.distributed.nn.functional.all_gather(loss, group=group))
            good = (inputs["shift_labels"] != -100).view(-1).sum()
            goods = torch.stack(torch.distributed.nn.functional.all_gather(good, group=group))
            safe = torch.where(goods > 0, losses, torch.zeros_like(losses))
            loss = (safe * goods).sum() / goods.sum().clamp(min=1)
        _finish(model, optimizer, loss, counter, group)
        return float(loss.detach())

    def close() -> None:
        ALL_ATTENTION_FUNCTIONS[attn] = original

    return Step(run, model.config.num_hidden_layers, close)
