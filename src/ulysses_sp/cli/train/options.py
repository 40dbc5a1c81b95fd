"""Command-line options of ``ulysses-sp train``: four dataclasses parsed by ``HfArgumentParser``.

    ModelDataArguments   what to train on (model, dataset or the embedded copy task, lengths)
    SPArguments          sequence parallelism and memory features (-> ``UlyssesSPConfig``)
    LaunchArguments      processes and nodes (passed to torch's elastic launcher, as torchrun)
    TrainingArguments    every ``transformers.TrainingArguments`` option (``--learning-rate`` ...)

Every option takes dashes or underscores (``--sp-size`` = ``--sp_size``), as ``trl sft`` does.
``--config FILE`` (YAML or JSON: a mapping of option names to values) reads options from a file;
options on the command line override it (:func:`expand_config`).
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import dataclass, field
from typing import Any

from ulysses_sp import UlyssesSPConfig

DEFAULT_OUTPUT_DIR = "runs/ulysses-sp-train"

# TrainingArguments defaults of this command; the Trainer's own for everything else
TRAINING_DEFAULTS: dict[str, Any] = dict(
    output_dir=None, logging_steps=10, report_to="none", seed=0, dataloader_drop_last=True,
    remove_unused_columns=False, disable_tqdm=False, use_cpu=False, include_num_input_tokens_seen=True,
    ddp_find_unused_parameters=False,
)
# ... and for the embedded copy task (no --dataset): it learns in ~150 steps with these
TASK_TRAINING_DEFAULTS: dict[str, Any] = dict(
    max_steps=200, per_device_train_batch_size=8, learning_rate=3e-3, warmup_steps=20,
    lr_scheduler_type="constant_with_warmup", weight_decay=0.0, max_grad_norm=1.0, save_strategy="no",
)


def _load_mapping(path: str) -> dict[str, Any]:
    """The mapping in a YAML / JSON config file (ValueError naming the file otherwise)."""
    import json
    from pathlib import Path

    import yaml

    file = Path(path).expanduser()
    if not file.is_file():
        raise ValueError(f"--config {path} does not exist; give a YAML or JSON file of options.")
    text = file.read_text()
    try:
        values = json.loads(text) if file.suffix.lower() == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ValueError(f"--config {path} is not valid {'JSON' if file.suffix.lower() == '.json' else 'YAML'}: "
                         f"{first}") from err
    if not isinstance(values, dict):
        raise ValueError(f"--config {path} must hold a mapping of option names to values, got "
                         f"{type(values).__name__}.")
    return values


def _known_options() -> set[str]:
    from transformers import TrainingArguments

    classes = (ModelDataArguments, SPArguments, LaunchArguments, TrainingArguments)
    return {f.name for dc in classes for f in dataclasses.fields(dc)}


def config_argv(path: str) -> list[str]:
    """The options of a config file as command-line tokens (``--name value ...``)."""
    values = _load_mapping(path)
    known = _known_options()
    unknown = sorted(k for k in values if str(k).replace("-", "_") not in known)
    if unknown:
        hints = []
        for key in unknown:
            close = difflib.get_close_matches(str(key).replace("-", "_"), sorted(known), n=1)
            hints.append(f"{key}" + (f" (did you mean {close[0]}?)" if close else ""))
        raise ValueError(f"--config {path}: unknown option(s) {', '.join(hints)}; see `ulysses-sp train --help`.")
    tokens: list[str] = []
    for key, value in values.items():
        flag = "--" + str(key).replace("_", "-")
        if value is None:
            continue
        if isinstance(value, dict):
            raise ValueError(f"--config {path}: option {key!r} has a nested mapping; give its value directly.")
        if isinstance(value, bool):
            tokens += [flag, "true" if value else "false"]
        elif isinstance(value, (list, tuple)):
            tokens += [flag, *[str(v) for v in value]]
        else:
            tokens += [flag, str(value)]
    return tokens


def expand_config(argv: list[str]) -> list[str]:
    """``argv`` with every ``--config FILE`` replaced by the file's options, placed FIRST so that options
    given on the command line (later, so they win) override the file."""
    files, rest, i = [], [], 0
    while i < len(argv):
        item = argv[i]
        if item in ("--config", "--config-file", "--config_file"):
            if i + 1 >= len(argv):
                raise ValueError("--config needs a file: --config run.yaml")
            files.append(argv[i + 1])
            i += 2
            continue
        if item.split("=")[0] in ("--config", "--config-file", "--config_file"):
            files.append(item.split("=", 1)[1])
        else:
            rest.append(item)
        i += 1
    return [token for path in files for token in config_argv(path)] + rest


def training_defaults(argv: list[str]) -> dict[str, Any]:
    """TrainingArguments defaults for ``argv``: the task's unless ``--dataset`` is given."""
    real_data = any(a.split("=")[0] == "--dataset" for a in argv)
    return TRAINING_DEFAULTS if real_data else {**TRAINING_DEFAULTS, **TASK_TRAINING_DEFAULTS}


@dataclass
class ModelDataArguments:
    """The model and the data; both default to the embedded ones (no download)."""

    model: str | None = field(default=None, metadata={"help": "local model directory or Hub name; default: a "
                                                      "small random Llama for the embedded copy task"})
    random_init: bool = field(default=False, metadata={"help": "build --model from its config with random weights"})
    dtype: str = field(default="float32", metadata={"help": "weights dtype (mixed precision: --bf16 / --fp16)",
                                                   "choices": ["float32", "bfloat16", "float16", "auto"]})
    attn_implementation: str = field(default="sdpa", metadata={"help": "kernel run on the full sequence (sdpa, "
                                                               "eager, flash_attention_2, flex_attention)"})
    dataset: list[str] | None = field(default=None, metadata={"help": "text / .jsonl / .json / .parquet / .csv "
                                      "files, a save_to_disk directory or a datasets name; default: the copy task"})
    dataset_config: str | None = field(default=None, metadata={"help": "datasets configuration name"})
    dataset_split: str = field(default="train", metadata={"help": "split to train on"})
    dataset_text_field: str = field(default="text", metadata={"help": "column of plain-text rows"})
    packing: bool = field(default=True, metadata={"help": "pack documents into rows of --seq-len (false: one "
                                                  "document per row, cut at --seq-len)"})
    packing_strategy: str = field(default="bfd_split", metadata={
        "help": "bfd_split: documents longer than --seq-len are split into --seq-len chunks, every token kept; bfd: "
                "such documents are truncated; wrapped: the token stream is cut into rows ignoring documents",
        "choices": ["bfd_split", "bfd", "wrapped"]})
    text_sample_by: str = field(default="document", metadata={
        "help": ".txt / .md files: one document per file, paragraph or line", "choices": ["document", "paragraph",
                                                                                         "line"]})
    completion_only_loss: bool = field(default=True, metadata={"help": "prompt/completion data: loss on the "
                                                               "completion only"})
    assistant_only_loss: bool = field(default=False, metadata={
        "help": "chat data: loss on the assistant turns only (the chat template marks them with {%% generation %%})"})
    eval_dataset: list[str] | None = field(default=None, metadata={"help": "held-out data (same formats as "
                                                                   "--dataset), evaluated under SP"})
    eval_split: float | None = field(default=None, metadata={"help": "hold out this fraction of --dataset's "
                                                             "documents for evaluation (0 < f < 1)"})
    lora_r: int = field(default=0, metadata={"help": "LoRA rank (PEFT); 0 = train all weights"})
    lora_alpha: float = field(default=16.0, metadata={"help": "LoRA alpha"})
    lora_dropout: float = field(default=0.0, metadata={"help": "LoRA dropout"})
    lora_target_modules: list[str] = field(default_factory=lambda: ["all-linear"], metadata={
        "help": "module names LoRA adapts (e.g. q_proj v_proj); all-linear = every linear layer but the head"})
    seq_len: int = field(default=512, metadata={"help": "global tokens per row, split over --sp-size ranks"})
    task: str = field(default="copy", metadata={"help": "embedded task without --dataset: copy (a long-range copy) "
                                                "or passkey (a key at a random depth of filler text, asked for at "
                                                "the end; the model's tokenizer, or a built-in character one)",
                                                "choices": ["copy", "passkey"]})
    task_vocab_size: int = field(default=64, metadata={"help": "copy task: token ids (3 are special)"})
    task_train_rows: int = field(default=4096, metadata={"help": "copy task: training rows"})
    task_eval_rows: int = field(default=32, metadata={"help": "copy task: held-out rows for the accuracy"})
    passkey_digits: int = field(default=4, metadata={"help": "passkey task / eval: digits of the key"})
    passkey_filler: str | None = field(default=None, metadata={"help": "passkey task: filler text (.txt, or .jsonl "
                                                               "rows with 'text'); default: built-in sentences"})
    eval_passkey_lengths: list[int] | None = field(default=None, metadata={
        "help": "passkey eval under SP at these lengths (before training, at every evaluation, at the end): "
                "accuracy by length and depth in metrics.jsonl and a heat map in metrics.png"})
    eval_passkey_depths: list[float] = field(default_factory=lambda: [0.1, 0.5, 0.9], metadata={
        "help": "passkey eval: depths of the key (fractions of the filler before it)"})
    eval_passkey_samples: int = field(default=8, metadata={"help": "passkey eval: rows per length and depth"})
    eval_passkey_filler: str | None = field(default=None, metadata={"help": "passkey eval: filler text (default: "
                                                                    "--passkey-filler, else built-in)"})
    hidden_size: int = field(default=64, metadata={"help": "embedded model: hidden size"})
    num_layers: int = field(default=2, metadata={"help": "embedded model: decoder layers"})
    num_heads: int = field(default=4, metadata={
        "help": "embedded model: attention heads (fewer than --sp-size: Ulysses x ring)"})
    overwrite_output_dir: bool = field(default=False, metadata={"help": "replace a non-empty --output-dir"})
    rope_scaling: str | None = field(default=None, metadata={
        "help": "extend the model past its pretrained length: transformers' rope_type, written into the saved "
                "config.json (docs/train.md, Long context)", "choices": ["linear", "dynamic", "yarn", "llama3"]})
    rope_factor: float | None = field(default=None, metadata={"help": "RoPE scaling factor: new length / original "
                                                               "length"})
    rope_original_max_position_embeddings: int | None = field(default=None, metadata={
        "help": "the length the model was pretrained at (default: its max_position_embeddings)"})
    rope_theta: float | None = field(default=None, metadata={"help": "RoPE base (default: the model's)"})
    rope_low_freq_factor: float = field(default=1.0, metadata={"help": "--rope-scaling llama3: low_freq_factor"})
    rope_high_freq_factor: float = field(default=4.0, metadata={"help": "--rope-scaling llama3: high_freq_factor"})
    max_position_embeddings: int | None = field(default=None, metadata={
        "help": "the length the model declares (default: rope factor x original length, or the model's)"})

    @property
    def uses_task(self) -> bool:
        """True when training on the embedded copy task."""
        return not self.dataset


SP_DEFAULTS: dict[str, Any] = {"sp_size": 2}  # this command's defaults where they differ from UlyssesSPConfig's


def _sp_arguments() -> type:
    """``SPArguments``: every ``UlyssesSPConfig`` field (declared once, in the config) plus ``--dp-size``."""
    hints = typing.get_type_hints(UlyssesSPConfig)
    specs: list[tuple[str, Any, Any]] = [
        (f.name, hints[f.name], field(default=SP_DEFAULTS.get(f.name, f.default), metadata=dict(f.metadata)))
        for f in dataclasses.fields(UlyssesSPConfig)
    ]
    specs.append(("dp_size", int, field(default=1, metadata={"help": "data-parallel replicas; world = sp_size * "
                                                                     "dp_size"})))

    def to_config(self) -> UlyssesSPConfig:
        """The shared ``UlyssesSPConfig`` (validates the values)."""
        return UlyssesSPConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(UlyssesSPConfig)})

    return dataclasses.make_dataclass("SPArguments", specs, namespace={
        "to_config": to_config, "__doc__": "Sequence parallelism (``UlyssesSPConfig``) and the data-parallel size.",
        "__module__": __name__})


SPArguments = _sp_arguments()


@dataclass
class LaunchArguments:
    """Passed to torch's elastic launcher exactly as ``torchrun`` options of the same names."""

    nproc_per_node: int | None = field(default=None, metadata={"help": "processes on this node; default "
                                                               "sp_size * dp_size / nnodes"})
    nnodes: int = field(default=1, metadata={"help": "nodes taking part"})
    node_rank: int = field(default=0, metadata={"help": "this node's rank (static rendezvous)"})
    rdzv_endpoint: str | None = field(default=None, metadata={"help": "host:port of the rendezvous"})
    rdzv_backend: str = field(default="c10d", metadata={"help": "rendezvous backend (c10d, static, etcd)"})
    rdzv_id: str = field(default="ulysses-sp-train", metadata={"help": "job id shared by all nodes"})
    master_addr: str | None = field(default=None, metadata={"help": "static rendezvous: rank-0 host"})
    master_port: int | None = field(default=None, metadata={"help": "static rendezvous: rank-0 port"})
    max_restarts: int = field(default=0, metadata={"help": "restarts of failed workers"})


def build_parser(defaults: dict[str, Any] | None = None):
    """The ``HfArgumentParser`` of the command (default: the copy task's TrainingArguments defaults)."""
    from transformers import HfArgumentParser, TrainingArguments

    parser = HfArgumentParser((ModelDataArguments, SPArguments, LaunchArguments, TrainingArguments),
                              prog="ulysses-sp train", description="Train a causal LM with Ulysses SP. Options may "
                              "also come from --config FILE (YAML or JSON); command-line options override the file.",
                              allow_abbrev=False)  # --learning-rat must not silently mean --learning-rate
    parser.set_defaults(**(training_defaults([]) if defaults is None else defaults))
    return parser


def parse(argv: list[str], use_cuda: bool | None = None):
    """``(ModelDataArguments, SPArguments, LaunchArguments, TrainingArguments)`` from ``argv``.

    ``use_cuda`` (in a worker): default ``use_cpu`` and ``ddp_backend`` (gloo / nccl) to match.

    Raises:
        ValueError: unknown options (with the closest known names).
    """
    argv = expand_config(argv)
    defaults = dict(training_defaults(argv))
    if use_cuda is not None:
        defaults.update(use_cpu=not use_cuda, ddp_backend="nccl" if use_cuda else "gloo")
    else:  # before launch: a machine without CUDA trains on CPU (so --bf16 validates there, as in the workers)
        import torch

        defaults.update(use_cpu=not torch.cuda.is_available())
    parser = build_parser(defaults)
    *parsed, remaining = parser.parse_args_into_dataclasses(argv, return_remaining_strings=True)
    if remaining:
        known = ["--" + f.name.replace("_", "-") for dc in parser.dataclass_types for f in dataclasses.fields(dc)]
        hints = []
        for item in remaining:
            if item.startswith("--"):
                close = difflib.get_close_matches(item.split("=")[0], known, n=2)
                hints.append(f"{item}" + (f" (did you mean {' or '.join(close)}?)" if close else ""))
            else:
                hints.append(item)
        raise ValueError(f"unknown option(s): {', '.join(hints)}; see `ulysses-sp train --help`.")
    return tuple(parsed)
