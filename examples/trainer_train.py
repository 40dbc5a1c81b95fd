"""Transformers ``Trainer`` with Ulysses SP: the two lines a script adds, on a tiny random Llama.

    torchrun --standalone --nproc_per_node 2 examples/trainer_train.py --sp-size 2   # SP over 2 ranks
    torchrun --standalone --nproc_per_node 1 examples/trainer_train.py --sp-size 1   # same run, no SP
    torchrun --standalone --nproc_per_node 1 examples/trainer_train.py --plain       # plain Trainer

The model and the variable-length synthetic dataset are built in code (no downloads). Rank 0 writes
every Trainer log (step, loss, grad_norm, eval_loss, num_input_tokens_seen, ...) and a final
summary (global_step, max_steps, epochs) as JSON lines to ``--log-file`` (default: stdout).
"""

import argparse
import json
import os
import sys

import torch
from datasets import Dataset
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

from ulysses_sp import UlyssesSPConfig, UlyssesTrainer, close_world


class JsonLogger(TrainerCallback):
    """Rank 0 writes each Trainer log as one JSON line (plus a summary at the end)."""

    def __init__(self, path: str | None) -> None:
        self.out = open(path, "a") if path else sys.stdout

    def _write(self, state, record: dict) -> None:
        if state.is_world_process_zero:
            self.out.write(json.dumps(record) + "\n")
            self.out.flush()

    def on_log(self, args, state, control, logs=None, **kwargs):
        self._write(state, {"step": state.global_step, **(logs or {})})

    def on_train_end(self, args, state, control, **kwargs):
        self._write(state, {"summary": True, "global_step": state.global_step, "max_steps": state.max_steps,
                            "num_train_epochs": state.num_train_epochs, "epoch": state.epoch,
                            "num_input_tokens_seen": state.num_input_tokens_seen})


def tiny_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0)
    return LlamaForCausalLM(config)


def tiny_dataset(num_rows: int, min_len: int, max_len: int, seed: int) -> Dataset:
    """Rows of random tokens of varying length (the collator pads them)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (num_rows,), generator=gen).tolist()
    return Dataset.from_dict({"input_ids": [torch.randint(1, 128, (n,), generator=gen).tolist() for n in lengths]})


def collate(rows: list[dict]) -> dict[str, torch.Tensor]:
    """Right-pad with token 0; labels are the tokens, -100 on padding."""
    S = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), S, dtype=torch.long)
    mask = torch.zeros(len(rows), S, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r["input_ids"])] = torch.tensor(r["input_ids"])
        mask[i, : len(r["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sp-size", type=int, default=2)
    p.add_argument("--plain", action="store_true", help="transformers.Trainer without SP (reference)")
    p.add_argument("--max-steps", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=2, help="sequences per step per DP replica (SP group)")
    p.add_argument("--eval-batch-size", type=int, default=None, help="default: --batch-size")
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--rows", type=int, default=24)
    p.add_argument("--min-len", type=int, default=9)
    p.add_argument("--max-len", type=int, default=33)
    p.add_argument("--tiled-loss-tokens", type=int, default=None)
    p.add_argument("--tiled-mlp-tokens", type=int, default=None)
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--offload-activations", action="store_true", help="checkpointed layer inputs to CPU")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--deepspeed", default=None, help="DeepSpeed config JSON")
    p.add_argument("--eval", action="store_true", help="evaluate on 6 rows after training")
    p.add_argument("--save-steps", type=int, default=0, help="checkpoint every N steps (0: never)")
    p.add_argument("--resume-from", default=None, help="checkpoint directory to resume from")
    p.add_argument("--output-dir", default="/tmp/ulysses_trainer_example")
    p.add_argument("--log-file", default=None)
    return p.parse_args(argv)


def main(argv=None) -> None:
    a = parse_args(argv)
    cpu = not torch.cuda.is_available()
    args = TrainingArguments(
        output_dir=a.output_dir, max_steps=a.max_steps, per_device_train_batch_size=a.batch_size,
        per_device_eval_batch_size=a.eval_batch_size or a.batch_size, gradient_accumulation_steps=a.grad_accum,
        learning_rate=1e-3,
        logging_steps=1, report_to="none", seed=0, use_cpu=cpu,
        ddp_backend="gloo" if cpu and "LOCAL_RANK" in os.environ else None,  # gloo under torchrun on CPU
        save_strategy="steps" if a.save_steps else "no", save_steps=a.save_steps or 500, bf16=a.bf16,
        gradient_checkpointing=a.gradient_checkpointing, deepspeed=a.deepspeed, include_num_input_tokens_seen="all",
        dataloader_drop_last=True,
    )
    kwargs = dict(model=tiny_model(), args=args, train_dataset=tiny_dataset(a.rows, a.min_len, a.max_len, seed=1),
                  eval_dataset=tiny_dataset(6, a.min_len, a.max_len, seed=2) if a.eval else None,
                  data_collator=collate, callbacks=[JsonLogger(a.log_file)])
    if a.plain:
        trainer = Trainer(**kwargs)
    else:
        sp_config = UlyssesSPConfig(sp_size=a.sp_size, tiled_loss_tokens=a.tiled_loss_tokens,
                                    tiled_mlp_tokens=a.tiled_mlp_tokens, offload_activations=a.offload_activations)
        trainer = UlyssesTrainer(**kwargs, sp_config=sp_config)   # the only SP-specific line
    trainer.train(resume_from_checkpoint=a.resume_from)
    offload = getattr(trainer, "activation_offload", None)
    if offload is not None and a.log_file and trainer.is_world_process_zero():
        with open(a.log_file, "a") as f:  # evidence that the layer inputs left the device
            f.write(json.dumps({"offloaded_tensors": offload.stats.num_tensors,
                                "restored_tensors": offload.stats.num_restored}) + "\n")
    if a.eval:
        trainer.evaluate()  # logged through JsonLogger.on_log as eval_loss
    close_world()  # barrier + destroy the world and the SP / DP subgroups, without gloo's exit deadlock


if __name__ == "__main__":
    main()
