"""Real text that every Python environment has, and a small model for it, without any download.

    python examples/readme_corpus.py /tmp/readmes
        /tmp/readmes/readmes.jsonl   one {"text": ...} row per installed package: its README (the long
                                     description in the package's dist-info METADATA)
        /tmp/readmes/model/          a byte-level BPE tokenizer trained on that text + a small random Llama

    ulysses-sp train --model /tmp/readmes/model --dataset /tmp/readmes/readmes.jsonl --seq-len 1024 ...

(docs/train.md runs exactly this.) A stand-in for "your model on your data" on a machine without
network: the tokenizer is trained here, the weights are random.
"""

from __future__ import annotations

import argparse
import json
import sys
from importlib import metadata
from pathlib import Path


def readmes() -> list[str]:
    """The README of every installed distribution (METADATA's body), longest first, de-duplicated."""
    seen, texts = set(), []
    for dist in metadata.distributions():
        body = dist.metadata.get_payload() if dist.metadata is not None else None
        name = dist.metadata["Name"] if dist.metadata is not None else None
        if body and body.strip() and name not in seen:
            seen.add(name)
            texts.append(body.strip())
    return sorted(texts, key=len, reverse=True)


def make_model(texts: list[str], out: Path, vocab_size: int, hidden: int, layers: int, heads: int, max_len: int):
    """Train a byte-level BPE tokenizer on ``texts`` and save it with a random Llama of that vocabulary."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<s>", "</s>"]
    backend.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=4 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                         max_position_embeddings=max_len, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="directory for readmes.jsonl and model/")
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--max-len", type=int, default=32768, help="max_position_embeddings of the model")
    args = parser.parse_args(argv)
    texts = readmes()
    if not texts:
        print("no installed package has a README in its metadata", file=sys.stderr)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    with (args.out / "readmes.jsonl").open("w") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")
    make_model(texts, args.out / "model", args.vocab_size, args.hidden_size, args.num_layers, args.num_heads,
               args.max_len)
    print(f"{len(texts)} READMEs ({sum(map(len, texts))} characters) -> {args.out / 'readmes.jsonl'}; "
          f"tokenizer + random Llama -> {args.out / 'model'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
