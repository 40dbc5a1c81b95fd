"""Which causal-LM families of the installed transformers train exactly under Ulysses SP?

    .venv/bin/python scripts/model_families.py                  # every family, print the table
    .venv/bin/python scripts/model_families.py --write          # ... and update the JSON record + docs/models.md
    .venv/bin/python scripts/model_families.py --families llama gemma2 --write   # rerun some, merge into the record

For every ``model_type`` of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``:

    1. config  the family's config class defaults, shrunk in code (hidden 64, 2-4 layers covering every
               layer kind, 4 query / 2 kv heads, vocab 128, 4 experts ...); no downloads
    2. refuse? ``check_model_support`` on the model built on the meta device (ValueError: "refused");
               a model refused only for logit softcapping under sdpa is retried with ``eager``
    3. plain   one forward + backward of the real tiny model in plain transformers (a failure there is
               the tiny config's or transformers' problem: "not checked")
    4. check   ``ulysses_sp.cli.check.engine.run_check`` (the engine of ``ulysses-sp check``) at sp_size 2
               on gloo CPU processes, for each scenario: loss and every gradient vs one plain process
    5. status  exact (every scenario matches) / refused: reason / not checked: why / DEFECT: what differed

Each family runs in a long-lived worker process (imports and the launcher's fork server paid once per
worker, shared by all its families); a family that takes longer than ``--time-limit`` seconds kills
its worker (and the SP ranks under it) and is a DEFECT. The record (``benchmarks/results/
model_families.json``) is the source of the table between the ``model-families`` markers of
``docs/models.md``; ``render_table(record)`` is the only way that table is written.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "models.md"
RECORD = ROOT / "benchmarks" / "results" / "model_families.json"
START, END = "<!-- model-families:start -->", "<!-- model-families:end -->"
SP_SIZE = int(os.environ.get("MODEL_FAMILIES_SP_SIZE", "2"))  # --sp-size (the workers read it from the environment)
SCENARIOS: dict[str, dict[str, Any]] = {  # name -> CheckOptions fields (besides model, sp_size, random_init)
    "plain": {"seq_len": 24},
    "padded+packed": {"seq_len": 23, "padding": True, "packed": True},  # S % P != 0, 2 rows, <= 3 docs each
}
MEMORY_FEATURES = {"tiled_loss_tokens": 5, "tiled_mlp_tokens": 3, "sp_head_chunks": 2, "gradient_checkpointing": True,
                   "offload_activations": True, "recompute_norms": True}  # --memory-features: what the SP run
                                                                            # adds (CheckOptions fields)
if os.environ.get("MODEL_FAMILIES_DTYPE", "float32") != "float32":  # --dtype: both runs in that dtype
    SCENARIOS = {name: {**fields, "dtype": os.environ["MODEL_FAMILIES_DTYPE"]} for name, fields in SCENARIOS.items()}
if os.environ.get("MODEL_FAMILIES_MEMORY") == "1":
    SCENARIOS = {name: {**fields, **MEMORY_FEATURES} for name, fields in SCENARIOS.items()}
MAX_PARAMS = 20_000_000  # a tiny config is ~0.1-2M parameters; more means the shrinking missed a size field

# 1. tiny configs ---------------------------------------------------------------------------------
_SIZES = {  # attribute -> tiny value, set wherever a (sub-)config has the attribute with a number in it
    **dict.fromkeys(["vocab_size", "vocab_size_per_layer_input", "decoder_vocab_size", "text_vocab_size"], 128),
    **dict.fromkeys(["hidden_size", "n_embd", "d_model", "embed_dim", "emb_dim", "embedding_dim", "embedding_size",
                     "word_embed_proj_dim", "input_embedding_size", "output_embedding_size", "attention_hidden_size",
                     "lru_width", "backbone_hidden_size"], 64),
    **dict.fromkeys(["num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers", "encoder_layers",
                     "num_decoder_layers", "num_encoder_layers"], 2),
    **dict.fromkeys(["num_attention_heads", "n_head", "n_heads", "num_heads", "decoder_attention_heads",
                     "encoder_attention_heads", "attention_heads", "num_decoder_attention_heads",
                     "num_encoder_attention_heads", "swa_num_attention_heads", "linear_num_value_heads",
                     "linear_num_heads", "mamba_n_heads", "mamba_num_heads", "n_mamba_heads", "index_n_heads",
                     "index_num_heads"], 4),
    **dict.fromkeys(["num_key_value_heads", "num_kv_heads", "num_query_groups", "swa_num_key_value_heads",
                     "linear_num_key_heads", "mamba_n_groups", "mamba_ngroups", "n_groups"], 2),
    **dict.fromkeys(["head_dim", "attention_head_dim", "kv_channels", "d_head", "dim_head", "attention_head_size",
                     "swa_head_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_head_dim",
                     "mamba_d_head", "mamba_head_dim", "mamba_headdim", "index_head_dim", "v_head_dim",
                     "qk_head_dim"], 16),
    **dict.fromkeys(["intermediate_size", "ffn_dim", "decoder_ffn_dim", "encoder_ffn_dim", "ffn_hidden_size", "n_inner",
                     "dim_ff", "dff", "feed_forward_size", "d_inner", "first_dense_intermediate_size",
                     "dense_intermediate_size", "mlp_only_intermediate_size", "intermediate_size_mlp", "d_ff"], 96),
    **dict.fromkeys(["moe_intermediate_size", "shared_expert_intermediate_size", "shared_intermediate_size",
                     "expert_ffn_hidden_size", "moe_shared_expert_intermediate_size",
                     "shared_experts_intermediate_size"],
                    32),
    **dict.fromkeys(["num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"], 4),
    **dict.fromkeys(["num_experts_per_tok", "moe_topk", "num_experts_per_token", "moe_k"], 2),
    **dict.fromkeys(["n_shared_experts", "num_shared_experts", "moe_num_shared_experts", "n_group", "topk_group",
                     "num_expert_group"], 1),
    **dict.fromkeys(["state_size", "ssm_state_size", "mamba_d_state", "mamba_d_ssm", "index_topk"], 16),
    **dict.fromkeys(["max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "max_target_positions",
                     "max_source_positions"], 256),
    "kv_lora_rank": 16, "q_lora_rank": 24, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "o_lora_rank": 16,
    "hidden_size_per_layer_input": 16, "num_layers_per_stack": 2, "laurel_rank": 8,
    "initializer_range": 0.2,  # larger weights: attention patterns far from uniform, so a wrong mask moves the loss
}
_AT_MOST = {"first_k_dense_replace": 1, "num_dense_layers": 1, "num_kv_shared_layers": 0, "num_nextn_predict_layers": 0,
            "sliding_window": 7, "attention_chunk_size": 8, "local_attention_window_len": 8, "attention_window_size": 8,
            "sliding_window_size": 7, "window_size": 8}
_LAYER_KEYS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers")
_KIND_KEYS = ("layer_types", "layers_block_type", "block_types", "hybrid_override_pattern", "attn_type_list")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _layer_indices(d: dict[str, Any], num_layers: int) -> list[int]:
    """2-4 layer indices that cover every distinct layer kind of the default config (first of each)."""
    kinds = next((d[k] for k in _KIND_KEYS if isinstance(d.get(k), (list, str)) and len(d[k]) == num_layers), None)
    if kinds is None:
        return list(range(min(2, num_layers)))
    firsts = sorted({kind: i for i, kind in reversed(list(enumerate(kinds)))}.values())[:4]
    rest = [i for i in range(num_layers) if i not in firsts]
    return sorted(firsts + rest[: max(0, 2 - len(firsts))])


def shrink(d: dict[str, Any]) -> dict[str, Any]:
    """A tiny copy of a config dict (``to_dict()``); nested configs (``text_config`` ...) shrink too."""
    out = dict(d)
    num_layers = next((d[k] for k in _LAYER_KEYS if _is_number(d.get(k))), None)
    if num_layers and num_layers > 2:  # per-layer lists and patterns keep the chosen layers
        keep = _layer_indices(d, num_layers)
        for key, value in d.items():
            if isinstance(value, (list, str)) and len(value) == num_layers and key not in ("model_type",):
                picked = [value[i] for i in keep]
                out[key] = "".join(picked) if isinstance(value, str) else picked
            elif isinstance(value, dict) and value and all(str(k).isdigit() for k in value):  # {layer index: ...}
                out[key] = {type(k)(new): value[k] for k in value for new, old in enumerate(keep) if int(k) == old}
        for key in _LAYER_KEYS:
            if _is_number(d.get(key)):
                out[key] = len(keep)
    for key, value in d.items():
        if isinstance(value, dict) and "model_type" in value:
            out[key] = shrink(value)
        elif key in ("head_dim", "num_key_value_heads") and value is None and _is_number(d.get("num_attention_heads")):
            out[key] = _SIZES[key]  # some families (Ministral, Nemotron) do not derive these from the head count
        elif key == "initializer_range" and _is_number(value):
            out[key] = _SIZES[key]
        elif key in _SIZES and _is_number(value) and not (key in _LAYER_KEYS and num_layers and num_layers > 2):
            out[key] = min(value, _SIZES[key])  # min: a 0 (no experts, no q LoRA) stays 0
        elif key in _AT_MOST and _is_number(value):
            out[key] = min(value, _AT_MOST[key])
        elif (key.endswith("_token_id") or key.endswith("_token_index")) and _is_number(value) and value >= 128:
            out[key] = 3
        elif key.endswith("_token_id") and isinstance(value, list):
            out[key] = [v if v < 128 else 3 for v in value]
    _consistent_heads(out)
    heads, kv_heads = d.get("num_attention_heads"), d.get("num_key_value_heads")
    if _is_number(heads) and kv_heads == heads:  # a multi-head (not GQA) family stays multi-head
        out["num_key_value_heads"] = out["num_attention_heads"]
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if _is_number(out.get(key)) and out[key] >= 128:
            out[key] = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}[key]
    if d.get("is_decoder") is False and not d.get("is_encoder_decoder"):
        out["is_decoder"] = True  # what a *ForCausalLM of a BERT-style family needs (transformers says so)
    return {k: v for k, v in out.items() if v is not None}  # None: the class derives it from the tiny sizes


def _consistent_heads(out: dict[str, Any]) -> None:
    """Sizes other sizes must agree with: rotary dims within the head, SSM heads x head dim = expand x hidden."""
    if _is_number(out.get("qk_rope_head_dim")) and _is_number(out.get("head_dim")):
        out["head_dim"] = out["qk_rope_head_dim"]  # MLA configs: head_dim is the rotary part
    if _is_number(out.get("rotary_dim")):
        out["rotary_dim"] = min(out["rotary_dim"], 8)
    hidden = next((out[k] for k in ("hidden_size", "d_model") if _is_number(out.get(k))), None)
    for expand, heads, dim in (("mamba_expand", "mamba_n_heads", "mamba_d_head"), ("expand", "num_heads", "head_dim"),
                               ("mamba_expand", "mamba_num_heads", "mamba_head_dim"),
                               ("mamba_expand", "n_mamba_heads", "mamba_headdim"), ("expand", "mamba_num_heads",
                                                                                   "mamba_head_dim")):
        if hidden and all(_is_number(out.get(k)) for k in (expand, heads, dim)):
            out[dim] = int(out[expand] * hidden) // out[heads]
    if all(_is_number(out.get(k)) for k in ("mamba_d_ssm", "mamba_n_heads", "mamba_d_head")):
        out["mamba_d_ssm"] = out["mamba_n_heads"] * out["mamba_d_head"]


def tiny_config(family: str):
    """The family's config class with shrunk defaults (``PretrainedConfig``); raises if it cannot be built."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[family]
    small = shrink(config_class().to_dict())
    small.pop("transformers_version", None)
    return config_class.from_dict(small)


def layer_kinds(config) -> str:
    """Attention kinds / layer types of a (tiny) config, for the table."""
    text = config.get_text_config()
    d = text.to_dict()
    kinds = next((d[k] for k in _KIND_KEYS if isinstance(d.get(k), (list, str)) and d.get(k)), None)
    heads = any(_is_number(d.get(k)) for k in ("num_attention_heads", "n_head", "n_heads", "num_heads",
                                                "decoder_attention_heads", "attention_heads"))
    default = "attention (no layer_types)" if heads else "no attention heads in the config"
    parts = [", ".join(dict.fromkeys(str(k) for k in kinds))] if kinds else [default]
    if d.get("sliding_window") and not kinds:
        parts.append(f"sliding window {d['sliding_window']}")
    if any(_is_number(d.get(k)) and d[k] > 0 for k in ("num_experts", "num_local_experts", "n_routed_experts",
                                                       "moe_num_experts")):
        parts.append("MoE")
    if d.get("kv_lora_rank"):
        parts.append("MLA")
    if d.get("attn_logit_softcapping"):
        parts.append("logit softcapping")
    return "; ".join(parts)


_MIXER = re.compile(r"(Mixer|DeltaNet|RecurrentBlock|Rglru|LinearAttention|LightningAttention|ShortConv|"
                    r"ShortConvolution|"
                    r"Block)$")  # ...Block: xLSTM / Mamba / RWKV blocks (the text decoder's blocks only)


def token_mixers(model) -> str:
    """Class names of the text decoder's non-attention token mixers (Mamba, gated delta net ...), if any."""
    try:
        decoder = model.get_decoder()
    except (AttributeError, NotImplementedError, ValueError):
        decoder = model
    decoder = decoder if hasattr(decoder, "modules") else model
    names = sorted({type(m).__name__ for m in decoder.modules()
                    if _MIXER.search(type(m).__name__) and not re.search("moe|expert|mlp", type(m).__name__, re.I)})
    return f"mixers: {', '.join(names)}" if names else ""


# 2.-5. one family, in this process ---------------------------------------------------------------
def _first_line(err: BaseException) -> str:
    lines = [line for line in str(err).strip().splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[-1] if lines else ''}"[:400]


def _rank_error(err: BaseException) -> str:
    """The innermost error of a failed SP rank (its traceback's last line) or of this process."""
    text = str(err).strip().splitlines()
    last = [line for line in text if line and not line.startswith(" ")]
    return (last[-1] if last else _first_line(err))[:400]


def check_family(family: str, scenarios: dict[str, dict[str, Any]] = SCENARIOS) -> dict[str, Any]:
    """Steps 1-5 for one family; a dict with ``status`` in exact / refused / not checked / DEFECT."""
    import torch
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from ulysses_sp import UlyssesSPConfig, check_model_support
    from ulysses_sp.cli.check.engine import CheckInputError, CheckOptions, run_check

    t0 = time.perf_counter()
    entry: dict[str, Any] = {"family": family, "model_class": MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(family, "?"),
                             "layer_kinds": "", "kernel": "", "num_params": 0, "scenarios": {}}

    def done(status: str, reason: str = "") -> dict[str, Any]:
        entry.update(status=status, reason=reason, seconds=round(time.perf_counter() - t0, 1))
        return entry

    try:
        config = tiny_config(family)
        entry["layer_kinds"] = layer_kinds(config)
        with torch.device("meta"):
            meta = transformers.AutoModelForCausalLM.from_config(config)
    except Exception as err:  # noqa: BLE001 - any failure to build the tiny model is reported, not raised
        return done("not checked", f"tiny config / model could not be built: {_first_line(err)}")
    entry["model_class"] = type(meta).__name__
    entry["layer_kinds"] = "; ".join(filter(None, [entry["layer_kinds"], token_mixers(meta)]))
    entry["num_params"] = sum(p.numel() for p in meta.parameters())
    sp_config = UlyssesSPConfig(sp_size=SP_SIZE)
    try:
        entry["kernel"] = check_model_support(meta, sp_config)
        attn = None
    except ValueError as err:
        reason = str(err).split("cannot be made sequence-parallel: ", 1)[-1]
        meta_eager = None
        if "SDPA cannot apply" in reason:  # the family is fine with another kernel: check that one
            with torch.device("meta"):
                meta_eager = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
        try:
            if meta_eager is None:
                raise err
            entry["kernel"] = check_model_support(meta_eager, sp_config)
            attn = "eager"
        except ValueError as err2:
            return done("refused", str(err2).split("cannot be made sequence-parallel: ", 1)[-1])
    del meta
    if entry["num_params"] > MAX_PARAMS:
        return done("not checked", f"the shrunk config still has {entry['num_params'] / 1e6:.0f}M parameters")
    with tempfile.TemporaryDirectory(prefix=f"model_families_{family}_") as tmp:
        try:
            config.save_pretrained(tmp)
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(
                transformers.AutoConfig.from_pretrained(tmp), attn_implementation=attn, dtype=torch.float32)
            ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(0))
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
            del model
        except Exception as err:  # noqa: BLE001
            return done("not checked", f"plain transformers fails on the tiny model: {_first_line(err)}")
        failures, skipped = [], []
        for name, fields in scenarios.items():
            opts = CheckOptions(model=str(Path(tmp) / "config.json"), sp_size=SP_SIZE, random_init=True,
                                attn_implementation=attn, **fields)
            try:
                c = run_check(opts).comparison
            except CheckInputError as err:  # e.g. plain transformers gives NaN on this batch: nothing to compare
                entry["scenarios"][name] = {"skipped": str(err)}
                skipped.append(f"{name} not compared: {err}")
                continue
            except Exception as err:  # noqa: BLE001 - an error under SP is a finding, with its message
                entry["scenarios"][name] = {"error": _rank_error(err), "traceback": traceback.format_exc()[-4000:]}
                failures.append(f"{name}: {_rank_error(err)}")
                continue
            entry["scenarios"][name] = {"loss_rel": c.loss_rel, "grad_rel": c.grad_rel, "worst_grad": c.grad_rel_name,
                                        "ok": c.ok}
            if not c.ok:
                t = c.tolerance
                failures.append(f"{name}: loss rel diff {c.loss_rel:.1e}, grad rel diff {c.grad_rel:.1e} "
                                f"(worst {c.grad_rel_name}; tolerance {t.loss_rel:.0e} / {t.grad_rel:.0e})")
    if failures:
        return done("DEFECT", "; ".join(failures + skipped))
    if len(skipped) == len(scenarios):
        return done("not checked", "; ".join(skipped))
    return done("exact", "; ".join(skipped))


# worker process ----------------------------------------------------------------------------------
PRELOAD = ["torch", "torch.distributed", "transformers", "transformers.modeling_utils", "ulysses_sp",
           "ulysses_sp.comm.launch", "ulysses_sp.cli.check.engine"]


def _worker_main(result_fd: int) -> None:
    """Read family names from stdin, write one JSON result line per family to ``result_fd``."""
    import multiprocessing.forkserver

    import torch.multiprocessing as mp
    import transformers

    transformers.logging.set_verbosity_error()
    mp.get_context("forkserver").set_forkserver_preload(PRELOAD)
    multiprocessing.forkserver.ensure_running()  # now, with PRELOAD: every SP rank of every family forks from it
    with os.fdopen(result_fd, "w", buffering=1) as out:
        out.write(json.dumps({"ready": True}) + "\n")
        for line in sys.stdin:
            family = line.strip()
            if family:
                print(f"=== {family}", flush=True)
                out.write(json.dumps(check_family(family)) + "\n")


class _Worker:
    """A worker subprocess in its own session (so a timeout kills it and every SP rank under it)."""

    def __init__(self, log_path: Path) -> None:
        read_fd, write_fd = os.pipe()
        self.log_path = log_path
        self.log = open(log_path, "ab")  # noqa: SIM115 - closed in kill()
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--_worker", str(write_fd)], stdin=subprocess.PIPE,
            stdout=self.log, stderr=subprocess.STDOUT, pass_fds=(write_fd,), start_new_session=True, cwd=ROOT,
        )
        os.close(write_fd)
        self.results = os.fdopen(read_fd, "rb", buffering=0)
        self.buffer = b""

    def read(self, timeout_s: float) -> dict[str, Any] | None:
        """The next JSON line, or None on timeout / worker exit."""
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.results], [], [], left)[0]:
                return None
            chunk = os.read(self.results.fileno(), 65536)
            if not chunk:
                return None
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)

    def send(self, family: str) -> None:
        self.proc.stdin.write((family + "\n").encode())
        self.proc.stdin.flush()

    def log_tail(self, num_lines: int = 8) -> str:
        self.log.flush()
        lines = [ln for ln in self.log_path.read_text(errors="replace").splitlines() if ln.strip()]
        return " | ".join(lines[-num_lines:])[-800:]

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the session this worker leads: it and its SP ranks
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.results.close()
        self.log.close()


def check_families(families: list[str], time_limit_s: float = 600.0, jobs: int = 1, log_dir: Path | None = None,
                   progress: bool = True) -> list[dict[str, Any]]:
    """:func:`check_family` for each family in ``jobs`` worker processes, each family within ``time_limit_s``."""
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="model_families_logs_"))
    todo: queue.Queue[str] = queue.Queue()
    for family in families:
        todo.put(family)
    results: dict[str, dict[str, Any]] = {}
    t_start = time.perf_counter()

    def slot(index: int) -> None:
        worker = None
        while True:
            try:
                family = todo.get_nowait()
            except queue.Empty:
                break
            if worker is None:
                worker = _Worker(log_dir / f"worker{index}.log")
                if worker.read(600.0) is None:
                    results[family] = {"family": family, "status": "not checked",
                                       "reason": f"worker did not start: {worker.log_tail()}"}
                    worker.kill()
                    worker = None
                    continue
            worker.send(family)
            result = worker.read(time_limit_s)
            if result is None:
                why = "no result within the time limit" if worker.proc.poll() is None else "the worker process died"
                result = {"family": family, "status": "DEFECT", "reason": f"{why} ({time_limit_s:.0f} s): "
                          f"{worker.log_tail()}"}
                worker.kill()
                worker = None
            results[family] = result
            if progress:
                elapsed = time.perf_counter() - t_start
                print(f"[{len(results)}/{len(families)} {elapsed:5.0f} s] {family}: {result['status']} "
                      f"{result.get('reason', '')[:160]}", flush=True)
        if worker is not None:
            worker.proc.stdin.close()
            worker.kill()

    threads = [threading.Thread(target=slot, args=(i,)) for i in range(max(1, jobs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [results[f] for f in families]


# record and table --------------------------------------------------------------------------------
def all_families() -> list[str]:
    """Every ``model_type`` with a causal-LM class in the installed transformers."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render_table(record: dict[str, Any]) -> str:
    """The Markdown between the markers of docs/models.md, from the record alone."""
    entries = record["families"]
    counts = {s: sum(e["status"] == s for e in entries) for s in ("exact", "refused", "not checked", "DEFECT")}
    scen = "; ".join(f"{name}: {', '.join(f'{k}={v}' for k, v in fields.items())}"
                     for name, fields in record["scenarios"].items())
    lines = [
        f"Generated by `{record['command']}` with transformers {record['transformers']}, torch {record['torch']} "
        f"({len(entries)} families, {record['seconds']:.0f} s). Counts: "
        + ", ".join(f"{v} {k}" for k, v in counts.items()) + ".",
        "",
        f"exact = loss and every gradient match one plain process (fp32, `ulysses-sp check` tolerances) at "
        f"sp_size {record['sp_size']} on gloo CPU processes in every scenario ({scen}).",
        "",
        "| family | model class | attention kinds / layer types | status | reason |",
        "|---|---|---|---|---|",
    ]
    for e in entries:
        reason = e.get("reason", "")
        if e["status"] == "exact":
            reason = f"kernel {e.get('kernel', '')}, {e.get('num_params', 0) / 1e6:.2f}M parameters"
        lines.append(f"| {_cell(e['family'])} | {_cell(e.get('model_class', ''))} | {_cell(e.get('layer_kinds', ''))} "
                     f"| {e['status']} | {_cell(reason)} |")
    return "\n".join(lines)


def write_docs(table: str, docs: Path = DOCS) -> None:
    """Replace what is between the markers of ``docs`` (which must hold both) with ``table``."""
    text = docs.read_text()
    if START not in text or END not in text:
        raise ValueError(f"{docs} has no {START} ... {END} markers; add them where the table belongs.")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    docs.write_text(f"{head}{START}\n{table}\n{END}{tail}")


def docs_table(docs: Path = DOCS) -> str:
    """What is between the markers of ``docs`` now."""
    return docs.read_text().split(START, 1)[1].split(END, 1)[0].strip("\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="+", help="model_types to check (default: all); merged into the record")
    parser.add_argument("--write", action="store_true", help="update the JSON record and docs/models.md")
    parser.add_argument("--jobs", type=int, default=1, help="families checked at once (each runs P=2 ranks)")
    parser.add_argument("--time-limit", type=float, default=300.0, help="seconds per family before it is a DEFECT")
    parser.add_argument("--record", type=Path, default=RECORD, help=f"JSON record (default {RECORD.relative_to(ROOT)})")
    parser.add_argument("--sp-size", type=int, default=2,
                        help="ranks per check (default 2; e.g. 8 > the tiny configs' 4 heads checks Ulysses x ring); "
                        "the docs table is written for 2 only")
    parser.add_argument("--memory-features", action="store_true",
                        help="the SP runs add the tiled loss (5 tokens), tiled MLPs (3 tokens), 2 head chunks and "
                        "offloaded activation checkpointing (both runs in train mode, dropout 0); not for --write")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="both runs in this dtype, with the check's tolerances for it; not for --write")
    parser.add_argument("--_worker", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args._worker is not None:  # its sp_size comes from the environment (set below by the parent)
        _worker_main(args._worker)
        return 0
    if args.write and (args.sp_size != 2 or args.memory_features or args.dtype != "float32"):
        parser.error("--write records the sp_size 2 fp32 table without memory features; run the others without --write")
    os.environ["MODEL_FAMILIES_DTYPE"] = args.dtype  # the workers started below inherit it
    if args.memory_features:
        os.environ["MODEL_FAMILIES_MEMORY"] = "1"  # the workers started below inherit it
    os.environ["MODEL_FAMILIES_SP_SIZE"] = str(args.sp_size)  # the workers started below inherit it
    globals()["SP_SIZE"] = args.sp_size
    import torch
    import transformers

    families = args.families or all_families()
    unknown = sorted(set(families) - set(all_families()))
    if unknown:
        parser.error(f"not causal-LM model_types of transformers {transformers.__version__}: {unknown}")
    t0 = time.perf_counter()
    entries = check_families(families, args.time_limit, args.jobs)
    seconds = time.perf_counter() - t0
    record = {"families": []}
    if args.families and args.record.exists():
        record = json.loads(args.record.read_text())
        seconds += record.get("seconds", 0.0) - sum(e.get("seconds", 0.0) for e in record["families"]
                                                   if e["family"] in families)
    merged = {e["family"]: e for e in record["families"]} | {e["family"]: e for e in entries}
    record.update(
        command="nice .venv/bin/python scripts/model_families.py --write"
        + (f" --jobs {args.jobs}" if args.jobs > 1 else ""),
        transformers=transformers.__version__, torch=torch.__version__, sp_size=SP_SIZE, scenarios=SCENARIOS,
        seconds=round(seconds, 1), families=[merged[f] for f in sorted(merged)],
    )
    table = render_table(record)
    print(table)
    if args.write:
        args.record.parent.mkdir(parents=True, exist_ok=True)
        args.record.write_text(json.dumps(record, indent=1) + "\n")
        write_docs(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
