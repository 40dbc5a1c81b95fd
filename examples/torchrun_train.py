"""Minimal plain-PyTorch training loop with Ulysses SP, launched by torchrun.

    torchrun --nproc_per_node 2 examples/torchrun_train.py --sp-size 2     # SP over 2 processes
    torchrun --nproc_per_node 1 examples/torchrun_train.py --sp-size 1     # the same run, no SP

A tiny random Llama and a synthetic dataset are built in code (no downloads). Every rank of an SP
group reads the same batch; data-parallel replicas (world / sp_size) read different ones. Rank 0
prints one JSON line per optimizer step: step, loss (global token mean) and grad_norm.

Stop and resume (the resumed steps give the losses of a run that never stopped):

    torchrun --nproc_per_node 2 examples/torchrun_train.py --stop-after 2 --save-dir ckpt
    torchrun --nproc_per_node 2 examples/torchrun_train.py --resume-from ckpt

``ckpt/state.pt`` holds model, optimizer and step (rank 0 writes it: DDP keeps them equal on all
ranks); ``ckpt/rng_{rank}.pt`` the RNG states of every rank. Resuming skips the batches of the
steps already done. ``--save-at K`` saves the same state and trains on.
"""

import argparse
import datetime
import itertools
import json
import os
import random

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler
from transformers import LlamaConfig, LlamaForCausalLM

from ulysses_sp import SPMesh, UlyssesSP, close_world, dp_sampler_kwargs, global_num_items, reported_loss


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sp-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=255, help="global tokens per sequence")
    parser.add_argument("--global-batch", type=int, default=2, help="sequences per optimizer step, all replicas")
    parser.add_argument("--save-dir", default=None, help="where --save-at / --stop-after save the state")
    parser.add_argument("--save-at", type=int, default=None, help="save the state after this step and go on")
    parser.add_argument("--stop-after", type=int, default=None, help="save the state after this step and exit")
    parser.add_argument("--resume-from", default=None, help="a --save-dir to continue from")
    args = parser.parse_args()

    # "nccl" on GPUs; a collective waiting longer than the timeout raises instead of hanging the job
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    mesh = SPMesh.from_world(args.sp_size, timeout_s=120)
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
    done = load_state(args.resume_from, model, optimizer) if args.resume_from else 0

    for step, input_ids in enumerate(itertools.islice(loader, done, None), start=done + 1):
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
        if step in (args.save_at, args.stop_after):
            save_state(args.save_dir, model, optimizer, step)
        if step == args.stop_after:
            break
    close_world()  # barrier + destroy_process_group, without gloo's exit deadlock


def save_state(directory: str, model: DistributedDataParallel, optimizer: torch.optim.Optimizer, step: int) -> None:
    """Model + optimizer + step from rank 0 (equal on all ranks under DDP), RNG from every rank."""
    os.makedirs(directory, exist_ok=True)
    if dist.get_rank() == 0:
        torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "step": step},
                   os.path.join(directory, "state.pt"))
    rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
    torch.save(rng, os.path.join(directory, f"rng_{dist.get_rank()}.pt"))
    dist.barrier()  # the checkpoint is complete on every rank before anyone goes on or exits


def load_state(directory: str, model: DistributedDataParallel, optimizer: torch.optim.Optimizer) -> int:
    """Restore what :func:`save_state` wrote; returns the number of steps already done."""
    state = torch.load(os.path.join(directory, "state.pt"), weights_only=False)
    model.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    rng = torch.load(os.path.join(directory, f"rng_{dist.get_rank()}.pt"), weights_only=False)
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    return state["step"]


if __name__ == "__main__":
    main()
