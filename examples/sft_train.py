"""TRL ``SFTTrainer`` with Ulysses SP on a tiny random Llama and a word-level tokenizer built in code.

    torchrun --standalone --nproc_per_node 2 examples/sft_train.py --sp-size 2 --packing   # SP, BFD packing
    torchrun --standalone --nproc_per_node 1 examples/sft_train.py --sp-size 1 --packing   # same run, no SP
    torchrun --standalone --nproc_per_node 1 examples/sft_train.py --plain --packing       # plain SFTTrainer
    torchrun --standalone --nproc_per_node 2 examples/sft_train.py --sp-size 2 --padding-free --assistant-only

Synthetic prompt + completion rows are pre-tokenized with a ``completion_mask`` (completion-only
loss: prompt tokens get label -100). ``--max-length`` is the GLOBAL sequence length (each SP rank
holds max_length / sp_size tokens). ``--packing`` packs with TRL's BFD strategy, which is
padding-free (position_ids restart per document). ``--padding-free`` (without ``--packing``)
concatenates each batch's rows into one row (``SFTConfig(padding_free=True)``; TRL then requires
``max_length=None``, the rows are short enough). ``--assistant-only`` trains on conversational
``{"messages": [...]}`` rows (user, assistant, user, assistant) with ``assistant_only_loss=True``:
the tokenizer's chat template marks assistant turns with ``{% generation %}``, so user tokens get
label -100. Rank 0 writes every log (loss, grad_norm, entropy, mean_token_accuracy, num_tokens,
eval_loss, ...) as JSON lines to ``--log-file``.
"""

import argparse
import os
import sys

import torch
from datasets import Dataset
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import (LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM, PreTrainedModel,
                          PreTrainedTokenizerFast)
from trl import SFTConfig, SFTTrainer

from ulysses_sp import UlyssesSFTTrainer, UlyssesSPConfig

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from trainer_train import JsonLogger  # noqa: E402

VOCAB = 128
# plain words, no role tokens: input_ids are the turns' words in order, each assistant turn ends in <eos>;
# the {% generation %} span gives the fast tokenizer's assistant_masks (from char offsets)
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }} <eos>"
    "{% endgeneration %}{% else %}{{ m['content'] }}{% endif %} {% endfor %}"
)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "<eos>": 1, **{f"t{i}": i for i in range(2, VOCAB)}}
    tok = Tokenizer(WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def tiny_model(moe: bool = False) -> PreTrainedModel:
    """A tiny random Llama, or with ``moe`` a Mixtral (4 experts, top 2) trained with its router
    load-balancing loss (``output_router_logits=True``, ``router_aux_loss_coef=0.5``)."""
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  pad_token_id=0, eos_token_id=1)
    if moe:
        return MixtralForCausalLM(MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2,
                                                output_router_logits=True, router_aux_loss_coef=0.5))
    return LlamaForCausalLM(LlamaConfig(**common))


def tiny_dataset(num_rows: int, seed: int) -> Dataset:
    """Pre-tokenized rows: a 3..12-token prompt then a 2..14-token completion ending in <eos>."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(num_rows):
        n_prompt, n_completion = (int(torch.randint(lo, hi, (1,), generator=gen)) for lo, hi in ((3, 13), (2, 15)))
        ids = torch.randint(2, VOCAB, (n_prompt + n_completion - 1,), generator=gen).tolist() + [1]
        rows.append({"input_ids": ids, "completion_mask": [0] * n_prompt + [1] * n_completion})
    return Dataset.from_list(rows)


def tiny_chat_dataset(num_rows: int, seed: int) -> Dataset:
    """Conversational rows ``{"messages": [user, assistant, user, assistant]}`` of 2..7 random words each."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(num_rows):
        turns = []
        for role in ("user", "assistant", "user", "assistant"):
            n = int(torch.randint(2, 8, (1,), generator=gen))
            words = " ".join(f"t{i}" for i in torch.randint(2, VOCAB, (n,), generator=gen).tolist())
            turns.append({"role": role, "content": words})
        rows.append({"messages": turns})
    return Dataset.from_list(rows)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sp-size", type=int, default=2)
    p.add_argument("--plain", action="store_true", help="trl.SFTTrainer without SP (reference)")
    p.add_argument("--packing", action="store_true", help="BFD packing (padding-free batches)")
    p.add_argument("--padding-free", action="store_true", help="padding_free=True without packing")
    p.add_argument("--assistant-only", action="store_true", help="conversational rows, assistant_only_loss=True")
    p.add_argument("--max-length", type=int, default=40, help="GLOBAL tokens per row (before SP sharding)")
    p.add_argument("--max-steps", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=2, help="rows per step per DP replica (SP group)")
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--rows", type=int, default=40)
    p.add_argument("--eval", action="store_true", help="evaluate on 8 rows after training")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--moe", action="store_true", help="a tiny Mixtral trained with its router aux loss")
    p.add_argument("--output-dir", default="/tmp/ulysses_sft_example")
    p.add_argument("--log-file", default=None)
    a = p.parse_args(argv)
    if a.padding_free and a.packing:
        p.error("--padding-free is the mode without packing (BFD --packing is padding-free already); pass one")
    return a


def main(argv=None) -> SFTTrainer:
    """Train (and evaluate with ``--eval``); returns the trainer."""
    a = parse_args(argv)
    cpu = not torch.cuda.is_available()
    args = SFTConfig(
        output_dir=a.output_dir, max_steps=a.max_steps, per_device_train_batch_size=a.batch_size,
        per_device_eval_batch_size=a.batch_size, gradient_accumulation_steps=a.grad_accum, learning_rate=1e-3,
        logging_steps=1, report_to="none", seed=0, use_cpu=cpu,
        ddp_backend="gloo" if cpu and "LOCAL_RANK" in os.environ else None,  # gloo under torchrun on CPU
        save_strategy="no", include_num_input_tokens_seen="all", dataloader_drop_last=True,
        max_length=None if a.padding_free else a.max_length, packing=a.packing, padding_free=a.padding_free,
        completion_only_loss=True, assistant_only_loss=a.assistant_only, shuffle_dataset=False,
        dataset_num_proc=None, bf16=a.bf16,  # SFTConfig defaults to bf16 where supported; fp32 unless --bf16
    )
    tok, data = tiny_tokenizer(), tiny_dataset
    if a.assistant_only:
        tok.chat_template, data = CHAT_TEMPLATE, tiny_chat_dataset
    kwargs = dict(model=tiny_model(a.moe), args=args, processing_class=tok,
                  train_dataset=data(a.rows, seed=1), eval_dataset=data(8, seed=2) if a.eval else None,
                  callbacks=[JsonLogger(a.log_file)])
    if a.plain:
        trainer = SFTTrainer(**kwargs)
    else:
        trainer = UlyssesSFTTrainer(**kwargs, sp_config=UlyssesSPConfig(sp_size=a.sp_size))  # the SP line
    trainer.train()
    if a.eval:
        trainer.evaluate()  # logged through JsonLogger.on_log
    return trainer


if __name__ == "__main__":
    main()
