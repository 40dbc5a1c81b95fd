"""Minimal plain-PyTorch training loop with Ulysses SP, launched by torchrun.

    torchrun --nproc_per_node 2 examples/torchrun_train.py --sp-size 2     # SP over 2 processes
    torchrun --nproc_per_node 1 examples/torchrun_train.py --sp-size 1     # the same run, no SP

A tiny random Llama and a synthetic dataset are built in code (no downloads). Every rank of an SP
group reads the same batch; data-parallel replicas (world / sp_size) read different ones. Rank 0
prints one JSON line per optimizer step: step, loss (global token mean) and grad_norm.
"""

import argparse
import json

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler
from transformers import LlamaConfig, LlamaForCausalLM

from ulysses_sp import SPMesh
from ulysses_sp.data import dp_sampler_kwargs
from ulysses_sp.integrations.transformers import UlyssesSP
from ulysses_sp.loss import global_num_items, reported_loss


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sp-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=255, help="global tokens per sequence")
    parser.add_argument("--global-batch", type=int, default=2, help="sequences per optimizer step, all replicas")
    args = parser.parse_args()

    dist.init_process_group("gloo")  # "nccl" on GPUs
    mesh = SPMesh.from_world(args.sp_size)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024)
    model = LlamaForCausalLM(config)
    sp = UlyssesSP(model, mesh).register()          # 1. attention becomes Ulysses attention
    model = DistributedDataParallel(model)          # 2. gradients averaged over all dp*sp ranks
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    data = torch.randint(0, config.vocab_size, (args.global_batch * args.steps, args.seq_len),
                         generator=torch.Generator().manual_seed(1))
    per_replica = args.global_batch // mesh.dp_size
    sampler = DistributedSampler(data, shuffle=False, **dp_sampler_kwargs(mesh))  # 3. split by dp rank
    loader = DataLoader(data, batch_size=per_replica, sampler=sampler)

    for step, input_ids in enumerate(loader, start=1):
        shard = sp.shard({"input_ids": input_ids})   # 4. pad, shift labels, take my slice
        logits = model(**sp.model_inputs(shard)).logits
        loss = sp.loss(logits, shard, global_num_items(shard["shift_labels"]))
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        logged = reported_loss(loss.detach(), dist.get_world_size())
        if dist.get_rank() == 0:
            print(json.dumps({"step": step, "loss": logged.item(), "grad_norm": grad_norm.item()}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
