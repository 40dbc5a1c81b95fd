"""Ulysses SP in a custom Accelerate loop: Accelerate's config names, errors before training, and
examples/accelerate_train.py launched with ``accelerate launch`` against a one-process reference."""

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch

from dist_helper import run_launcher, spawn
from ulysses_sp import free_port
from ulysses_sp.config import UlyssesSPConfig
from ulysses_sp.integrations.accelerate import config_from_accelerate

ROOT = Path(__file__).resolve().parents[1]


# ---- Accelerate's names -> UlyssesSPConfig ----------------------------------------------------

def test_config_from_accelerate_names_in_every_spelling(monkeypatch):
    """Bug caught: a mapping that drops or misreads one of Accelerate's sp_* names in one of the places
    users write them (plain mapping, config-file section, whole config file, launcher env vars)."""
    expected = UlyssesSPConfig(sp_size=2, sp_attn_implementation="eager", sp_seq_length_is_variable=False,
                               tiled_loss_tokens=128)
    plain = {"sp_size": 2, "sp_backend": "ulysses", "sp_attn_implementation": "eager",
             "sp_seq_length_is_variable": False, "sp_seq_length": 64}
    section = {f"parallelism_config_{k}": v for k, v in plain.items()}
    whole_file = {"distributed_type": "MULTI_GPU", "num_processes": 2, "parallelism_config": section}
    for source in (plain, section, whole_file):
        assert config_from_accelerate(source, tiled_loss_tokens=128) == expected
    for key in [k for k in os.environ if k.startswith("PARALLELISM_CONFIG_")]:
        monkeypatch.delenv(key)
    env = {"SP_SIZE": "2", "SP_BACKEND": "ulysses", "SP_SEQ_LENGTH_IS_VARIABLE": "False",
           "SP_ATTN_IMPLEMENTATION": "eager", "SP_SEQ_LENGTH": "None", "DP_REPLICATE_SIZE": "1", "TP_SIZE": "1",
           "CP_SIZE": "1", "CP_BACKEND": "torch", "DP_SHARD_SIZE": "1"}
    for key, value in env.items():
        monkeypatch.setenv("PARALLELISM_CONFIG_" + key, value)
    assert config_from_accelerate(tiled_loss_tokens=128) == expected


def test_config_from_accelerate_parallelism_config_object():
    """Bug caught: reading Accelerate's ParallelismConfig wrongly: sp_size 1 (its defaults, incl. the
    forced sp_backend='deepspeed') is no SP; sp_size 2 there is Accelerate's own ALST and refused."""
    from accelerate.parallelism_config import ParallelismConfig

    assert config_from_accelerate(ParallelismConfig()) == UlyssesSPConfig(sp_size=1)
    with pytest.raises(ValueError, match="ulysses-sp is the backend"):
        config_from_accelerate(ParallelismConfig(sp_size=2))


@pytest.mark.parametrize("values, match", [
    ({"sp_size": 2, "sp_backend": "deepspeed"}, "ulysses-sp is the backend: write sp_backend: ulysses"),
    ({"parallelism_config_sp_size": 2, "parallelism_config_sp_backend": "deepspeed"}, "sp_backend: ulysses"),
    ({"sp_size": 2, "sp_backend": "megatron"}, "sp_backend 'megatron' is not available"),
    ({"sp_size": 2, "tp_size": 2}, "tp_size=2 is not supported"),
    ({"sp_size": 2, "cp_size": 2}, "cp_size=2 is not supported"),
    ({"sp_size": 2, "dp_shard_size": 2}, "dp_shard_size=2 is not supported"),
    ({"sp_size": 2, "sp_attn_implementation": "kernels-community/flash-attn2"}, "cannot run under Ulysses SP"),
    ({"sp_size": 2, "sp_allow_recurrent_layers": True}, "recurrent"),
    ({"sp_size": 2, "sp_disable_in_eval": True}, "keeps SP on in eval"),
    ({"sp_size": 0}, "sp_size must be a positive integer"),
    ({"sp_sise": 2}, "unknown Accelerate parallelism option"),
])
def test_config_from_accelerate_rejects_what_it_cannot_honour(values, match):
    """Bug caught: silently accepting a setting ulysses-sp would not honour (a second SP backend,
    tensor/context parallelism, hub kernels, SP off in eval, a typo)."""
    with pytest.raises(ValueError, match=match):
        config_from_accelerate(values)


# ---- errors before training (2 gloo processes) ---------------------------------------------------

def _errors_worker(rank, world_size):
    import torch
    from accelerate import Accelerator
    from torch.utils.data import DataLoader, WeightedRandomSampler
    from transformers import LlamaConfig, LlamaForCausalLM

    from tiny_models import tiny_model
    from ulysses_sp.integrations.accelerate import UlyssesAccelerate

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    assert accelerator.num_processes == 2
    with pytest.raises(ValueError, match="sp_size=3 does not divide the world size 2"):
        UlyssesAccelerate(accelerator, UlyssesSPConfig(sp_size=3))  # before any collective: no hang

    sp = UlyssesAccelerate(accelerator, UlyssesSPConfig(sp_size=2))
    one_head = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                            num_attention_heads=1, num_key_value_heads=1))
    with pytest.raises(ValueError, match="all-to-all over 2 ranks > num_attention_heads 1"):
        UlyssesAccelerate(accelerator, UlyssesSPConfig(sp_size=2, sp_ring_size=1)).prepare(one_head)
    model = tiny_model("llama")
    data = [{"input_ids": torch.arange(1, 13)} for _ in range(6)]  # 3 batches of 2: not a multiple of 2
    with pytest.raises(ValueError, match="not a multiple of gradient_accumulation_steps=2"):
        sp.prepare(model, DataLoader(data, batch_size=2))
    with pytest.raises(ValueError, match="WeightedRandomSampler would be dropped"):
        sp.prepare(model, DataLoader(data[:4], batch_size=2, sampler=WeightedRandomSampler([1.0] * 4, 4)))
    model, loader = sp.prepare(model, DataLoader(data[:4], batch_size=2))
    assert len(loader) == 2  # dp=1: every rank reads all batches (not split over the 2 SP ranks)

    packed = {"input_ids": torch.arange(1, 13)[None], "cu_seq_lens_q": torch.tensor([0, 5, 12])}
    with pytest.raises(ValueError, match="packed .* but has no position_ids"):
        sp.shard(packed)
    uneven = {"input_ids": torch.arange(1, 11 + 2 * rank)[None]}  # eval batch: S=10 on rank 0, 12 on rank 1
    with pytest.raises(ValueError, match="must see the same batch"):
        sp.shard(uneven)


def test_errors_before_training():
    """Bug caught: a setup that hangs or trains wrongly instead of failing first with the fix named:
    sp_size not dividing the world, a model with fewer heads than sp_size, an optimizer step
    spanning two epochs, a sampler that the dp-only split would silently replace, a packed batch
    without position_ids, an eval batch whose length differs across the SP group. (An Accelerator
    with Accelerate's own sp_size > 1 is refused too, but Accelerate accepts such a
    ParallelismConfig only on GPUs, so that check is not exercised here.)"""
    spawn(_errors_worker, 2, timeout_s=120.0)


# ---- the example, launched as users launch it -----------------------------------------------------

def run_example(tmp: Path, name: str, nproc: int, *args: str) -> list[dict]:
    log = tmp / f"{name}.jsonl"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "examples" / "accelerate_config.yaml"), "--num_processes", str(nproc),
           # a free port, not Accelerate's default 29500 that any other launch on the host may hold
           "--main_process_port", str(free_port()),
           str(ROOT / "examples" / "accelerate_train.py"), "--log-file", str(log), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    out = run_launcher(cmd, 300, env=env, cwd=tmp)
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in log.read_text().splitlines()]


def reference_run(steps: int = 4, steps_per_epoch: int = 2, grad_accum: int = 2, global_batch: int = 2,
                  seq_len: int = 63) -> list[dict]:
    """The example's model and data trained in THIS process without ulysses-sp or Accelerate: each
    optimizer step is one forward of its micro-batches concatenated, Transformers' own loss (the
    token mean over the step), AdamW, clipping. Step i of epoch e uses the sequences the example's
    dp-split loader gives that step: ``randperm(n, seed=0 + e)[i * A * G:(i + 1) * A * G]``."""
    spec = importlib.util.spec_from_file_location("accelerate_train", ROOT / "examples" / "accelerate_train.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    with torch.random.fork_rng():
        model = example.build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    per_step = global_batch * grad_accum
    data = example.build_dataset(per_step * steps_per_epoch, seq_len)
    log = []
    for step in range(1, steps + 1):
        epoch, i = divmod(step - 1, steps_per_epoch)
        order = torch.randperm(len(data), generator=torch.Generator().manual_seed(epoch)).tolist()
        rows = [data[j] for j in order[i * per_step:(i + 1) * per_step]]
        batch = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
        loss = model(**batch, labels=batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)).loss
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        log.append({"step": step, "loss": loss.item(), "grad_norm": grad_norm.item()})
    return log


@pytest.fixture(scope="module")
def sp2_run(tmp_path_factory):
    """2 processes, sp_size 2, gradient accumulation 2, 4 steps over 2 shuffled epochs, tiled loss
    (24-token tiles: not dividing the 32-token shards); the state after step 2 is saved (training
    goes on) for the resume test."""
    tmp = tmp_path_factory.mktemp("accelerate")
    log = run_example(tmp, "sp2", 2, "--sp-size", "2", "--tiled-loss-tokens", "24", "--save-at", "2",
                      "--save-dir", str(tmp / "ckpt"))
    return tmp, log


def test_accelerate_sp2_matches_one_process_reference_step_by_step(sp2_run):
    """Bug caught: an Accelerate SP loop whose trajectory drifts from one process on the global batch:
    a loss not normalised by the whole step's token count (micro-batches hold different numbers of
    tokens), Accelerate's division by gradient_accumulation_steps left uncorrected, SP ranks
    reading different data or Accelerate splitting batches over SP ranks, lost shard-boundary
    targets, a tiled loss whose lm_head gradient misses DDP's reduction."""
    tmp, sp = sp2_run
    reference = reference_run()
    assert [r["step"] for r in sp] == [1, 2, 3, 4] == [r["step"] for r in reference]
    for a, b in zip(sp, reference):
        # fp32; only the summation order differs (sharded and tiled CE sums, all-reduces, padded
        # batch vs shards): observed <= 2e-7 relative over 4 AdamW steps. 1e-5 leaves margin, while
        # normalising each micro-batch by its own token count moves grad_norm by >= 3.5e-3 and the
        # loss by >= 1.2e-4 relative on this data (checked in one process)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)


def test_accelerate_resume_matches_uninterrupted_run(sp2_run):
    """Bug caught: a resume that restarts the data (same batches again), the shuffling of the wrong
    epoch, or loses the optimizer's moments: steps 3 and 4 after load_state must equal the run
    that never stopped."""
    tmp, sp = sp2_run
    resumed = run_example(tmp, "resumed", 2, "--sp-size", "2", "--tiled-loss-tokens", "24",
                          "--resume-from", str(tmp / "ckpt"))
    assert [r["step"] for r in resumed] == [3, 4]
    for a, b in zip(resumed, sp[2:]):
        # same processes, same layout, same state: identical up to nondeterministic gloo
        # all-reduce order (none observed); 1e-6 relative
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-6)
