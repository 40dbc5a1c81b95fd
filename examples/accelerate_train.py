"""A custom Accelerate training loop with Ulysses SP (CPU or GPU, no downloads).

    accelerate launch --config_file examples/accelerate_config.yaml --num_processes 2 \\
        examples/accelerate_train.py --sp-size 2                          # SP over 2 processes
    accelerate launch --config_file examples/accelerate_config.yaml --num_processes 1 \\
        examples/accelerate_train.py --sp-size 1                          # the same run, no SP
    ... --stop-after 2 --save-dir ckpt   then   ... --resume-from ckpt   # stop and resume
                                        (--save-at 2 saves the same state and trains on)

A tiny random Llama (hidden 64, 4 heads, 2 kv heads) trains on synthetic right-padded sequences
of random lengths (so micro-batches hold different numbers of tokens) with AdamW, gradient
clipping and gradient accumulation. Rank 0 writes one JSON line per optimizer step (step, loss =
global token mean of the step, grad_norm before clipping) to ``--log-file``.
``tests/test_accelerate.py`` checks these against one process training the same model WITHOUT
ulysses-sp on each step's micro-batches concatenated (Transformers' own loss).
"""

import argparse
import json

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader
from transformers import LlamaConfig, LlamaForCausalLM

from ulysses_sp import UlyssesAccelerate, UlyssesSPConfig


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--sp-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=4, help="optimizer steps in total")
    p.add_argument("--steps-per-epoch", type=int, default=2, help="dataset size, in optimizer steps")
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--global-batch", type=int, default=2, help="sequences per micro-step, all replicas")
    p.add_argument("--seq-len", type=int, default=63)
    p.add_argument("--tiled-loss-tokens", type=int, default=None)
    p.add_argument("--log-file", default=None)
    p.add_argument("--save-dir", default=None, help="where --save-at / --stop-after save the state")
    p.add_argument("--save-at", type=int, default=None, help="save the state after this step and go on")
    p.add_argument("--stop-after", type=int, default=None, help="save the state after this step and exit")
    p.add_argument("--resume-from", default=None, help="a --save-dir to continue from")
    return p.parse_args()


def build_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0)
    return LlamaForCausalLM(config)


def build_dataset(num: int, seq_len: int) -> list[dict[str, torch.Tensor]]:
    """``num`` right-padded sequences of random lengths in ``[seq_len // 3, seq_len]``."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 256, (num, seq_len), generator=gen)
    lengths = torch.randint(seq_len // 3, seq_len + 1, (num,), generator=gen)
    mask = (torch.arange(seq_len)[None] < lengths[:, None]).long()
    return [{"input_ids": i * m, "attention_mask": m} for i, m in zip(ids, mask)]


def main() -> None:
    args = parse_args()
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), gradient_accumulation_steps=args.grad_accum)
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = build_dataset(args.global_batch * args.grad_accum * args.steps_per_epoch, args.seq_len)

    sp = UlyssesAccelerate(accelerator, UlyssesSPConfig(sp_size=args.sp_size, tiled_loss_tokens=args.tiled_loss_tokens))
    if args.global_batch % sp.mesh.dp_size:
        raise ValueError(f"--global-batch {args.global_batch} must be a multiple of the {sp.mesh.dp_size} replicas.")
    loader = DataLoader(data, batch_size=args.global_batch // sp.mesh.dp_size, shuffle=True)
    model, optimizer, loader = sp.prepare(model, optimizer, loader)       # UlyssesSP + DDP + dp-only split
    if args.resume_from:
        accelerator.load_state(args.resume_from)  # model, optimizer, RNG, loader position (= step)
    step = (loader.epoch * len(loader) + loader.position) // args.grad_accum
    log = open(args.log_file, "w") if args.log_file and accelerator.is_main_process else None
    while step < args.steps:
        step_loss = 0.0
        for batch in loader:
            with accelerator.accumulate(model):
                loss = sp.loss_for(model, batch)
                accelerator.backward(loss)
                step_loss += sp.reported_loss(loss).item()
                if accelerator.sync_gradients:
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                step += 1
                write(log, step, step_loss, grad_norm)
                step_loss = 0.0
                if step in (args.save_at, args.stop_after):
                    accelerator.save_state(args.save_dir)  # model, optimizer, RNG of every rank, loader
                if step == args.stop_after:
                    args.steps = step  # stop here (the state is saved)
                if step == args.steps:
                    break
    accelerator.wait_for_everyone()
    accelerator.end_training()  # shuts the process groups down together


def write(log, step: int, loss: float, grad_norm: torch.Tensor) -> None:
    if log is not None:
        log.write(json.dumps({"step": step, "loss": loss, "grad_norm": float(grad_norm)}) + "\n")
        log.flush()


if __name__ == "__main__":
    main()
