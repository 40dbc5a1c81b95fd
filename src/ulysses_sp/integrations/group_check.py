"""What every rank of an SP group must agree on before it shards a batch (compared in one all-gather)."""

from __future__ import annotations

import zlib

import torch
from transformers import PreTrainedModel

from ulysses_sp.config import UlyssesSPConfig


def group_signature(
    base: PreTrainedModel, config: UlyssesSPConfig, kernel: str, ring_size: int, first: bool
) -> tuple[dict[str, list[int]], str]:
    """What every rank of the SP group must agree on, as integers, and the fix if they do not.

    Compared with the batch in ``UlyssesSP.shard``'s all-gather (no extra collective):
    config, kernel and model shape (different head chunks, backends or ring sizes would issue
    different collectives: a hang or mixed-up data), and a checksum of the weights where
    parameters are whole tensors on every rank (not FSDP2 DTensors or ZeRO-3 partitions). At the
    ``first`` batch every parameter is sampled (a random init without a common seed, and no DDP /
    DeepSpeed broadcast, would run another model on each shard); afterwards up to 32 trainable
    ones (weights that drift apart mean the gradients are not averaged over the SP group).
    """
    c, text = config, base.config.get_text_config()
    params = list(base.parameters())
    whole = all(type(p) is torch.nn.Parameter or type(p) is torch.Tensor for p in params) and not any(
        p.is_meta or p.numel() == 0 or hasattr(p, "ds_id") for p in params)
    checksum = 0
    if whole:  # a strided sample of each tensor; the same weights give the same bits on every rank
        chosen = params if first else [p for p in params if p.requires_grad]
        if len(chosen) > 32:
            chosen = [chosen[i * len(chosen) // 32] for i in range(32)]
        with torch.no_grad():
            samples = [p.detach().reshape(-1)[:: max(1, p.numel() // 64)][:64].double() for p in chosen]
            total = torch.cat(samples).sum() if samples else torch.zeros((), dtype=torch.float64)
        checksum = int(total.reshape(1).cpu().view(torch.int64).item())
    values = {
        "UlyssesSPConfig (sp_backend, sp_head_chunks, sp_head_chunk_mib as bytes, sp_head_blocks, sp_ring_size, "
        "tiled_mlp_tokens, tiled_loss_tokens)":
            [zlib.crc32(c.sp_backend.encode()), c.sp_head_chunks, c.head_chunk_bytes or 0, int(c.sp_head_blocks),
             ring_size, c.tiled_mlp_tokens or 0, c.tiled_loss_tokens or 0],
        "attention kernel": [zlib.crc32(kernel.encode())],
        "model shape (parameters, layers, heads, kv heads)":
            [sum(p.numel() for p in params), int(getattr(text, "num_hidden_layers", 0) or 0),
             int(getattr(text, "num_attention_heads", 0) or 0), int(getattr(text, "num_key_value_heads", 0) or 0)],
        "weights (a checksum of every parameter)" if first else "trained weights (a checksum)": [checksum],
    }
    hint = ("Every rank must build the same model and UlyssesSPConfig: load the same checkpoint or seed a random "
            "init identically (torch.manual_seed(s) before building the model on every rank), and pass the same "
            "options." if first else
            "They agreed at the first batch, so the gradients are not averaged over the SP group: wrap the model "
            "in DDP / FSDP2 / DeepSpeed over the world, or all-reduce every gradient over mesh.sp_group (and the "
            "DP group) before optimizer.step().")
    return values, hint
