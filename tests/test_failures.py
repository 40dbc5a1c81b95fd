"""Failure behaviour (docs/failures.md): faults and bad input end in a clear error, a bounded time, no lost work.

Process faults run the real command (``python -m ulysses_sp.cli.main train``) in a subprocess and act
on its workers (pids by rank from the run's ``workers.json``): SIGSTOP (a stalled rank),
SIGKILL (a dead rank), SIGINT to the launcher (Ctrl-C). Every case asserts the exit code, the time it
took and the message.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from test_train_cli import TASK, _tiny_hf_model_dir
from ulysses_sp.cli.main import main

LONG = [*TASK, "--max-steps", "100000", "--logging-steps", "1"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return _tiny_hf_model_dir(tmp_path_factory.mktemp("tiny_hf_failures"))


# -- helpers: the command in a subprocess, its workers by rank ------------------------------------
def _start(argv: list[str]) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "ulysses_sp.cli.main", "train", *argv], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _worker_pid(launcher: subprocess.Popen, out: Path, rank: int) -> int:
    """The pid of ``rank`` from the run's ``workers.json``, checked to be a process of this launcher."""
    table = json.loads((out.with_name(out.name + ".incomplete") / "workers.json").read_text())
    pid = table[str(rank)]["pid"]
    assert pid in _descendants(launcher.pid)
    return pid


def _wait_training(launcher: subprocess.Popen, out: Path, timeout_s: float = 120) -> None:
    """Until the run has logged a step (the workers are in their training loop)."""
    metrics = out.with_name(out.name + ".incomplete") / "metrics.jsonl"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if metrics.exists() and metrics.read_text().strip():
            return
        if launcher.poll() is not None:
            raise AssertionError(f"the run ended early: {launcher.communicate()[1][-2000:]}")
        time.sleep(0.5)
    raise AssertionError("the run logged no step in time")


def _finish(launcher: subprocess.Popen, timeout_s: float) -> tuple[int, str, float]:
    t0 = time.monotonic()
    try:
        _, err = launcher.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(launcher.pid, signal.SIGKILL)
        _, err = launcher.communicate()
        raise AssertionError(f"no exit within {timeout_s} s: a hang; stderr:\n{(err or '')[-3000:]}") from None
    return launcher.returncode, err, time.monotonic() - t0


def _cleanup(launcher: subprocess.Popen) -> None:
    if launcher.poll() is None:
        for pid in _descendants(launcher.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.communicate()


# -- process faults --------------------------------------------------------------------------------
def test_concurrent_run_refused_then_killed_rank_named(tmp_path):
    """Bug caught: a second run into the same --output-dir deleting the first one's staging directory
    (one crashed, the other wrote interleaved metrics), and a killed rank reported as a bare
    'worker failed'. The second run exits 2 at once naming the first; SIGKILL of rank 1 ends the
    first run with exit 1 within seconds, naming rank 1 and the signal; the lock is released."""
    out = tmp_path / "run"
    first = _start([*LONG, "--output-dir", str(out)])
    try:
        _wait_training(first, out)
        t0 = time.monotonic()
        second = subprocess.run([sys.executable, "-m", "ulysses_sp.cli.main", "train", *LONG, "--output-dir",
                                 str(out)], capture_output=True, text=True, timeout=120)
        assert second.returncode == 2, second.stderr[-2000:]
        assert "being written by another run" in second.stderr and f"pid {first.pid}" in second.stderr
        assert time.monotonic() - t0 < 60  # refused before any worker starts
        assert (out.with_name("run.incomplete") / "metrics.jsonl").exists()  # the first run's work is intact
        victim = _worker_pid(first, out, 1)
        os.kill(victim, signal.SIGKILL)
        code, err, seconds = _finish(first, 60)
        # the launcher reports the rank that ended first: usually rank 1 (SIGKILL), sometimes rank 0, whose
        # collective with the dead rank failed at once; either way exit 1, a named rank, within seconds
        assert code == 1 and "worker failed" in err, err[-2000:]
        assert "rank 1: killed by SIGKILL" in err or "\n  rank 0: " in err, err[-2000:]
        assert seconds < 30, seconds  # the launcher notices a dead worker at once (5 s shutdown grace)
        assert not out.exists() and not out.with_name("run.lock").exists()
    finally:
        _cleanup(first)


@pytest.mark.parametrize("stalled", [1, 0])
def test_stalled_rank_times_out_naming_the_rank(tmp_path, stalled):
    """Bug caught: --ddp-timeout ignored (the world and the SP groups waited 30 minutes for a stopped
    rank), a gloo collective with a peer stopped mid-transfer waiting past its timeout (1 run in 5),
    and the diagnosis lost when the launcher reported the SIGKILLed rank first. With --ddp-timeout 8,
    SIGSTOP of rank 1 (or of rank 0, which saves the checkpoints) ends the run with exit 1 within the
    timeout plus a few seconds, and the error names the timeout and the stalled rank."""
    out = tmp_path / "stall"
    run = _start([*LONG, "--ddp-timeout", "8", "--output-dir", str(out)])
    try:
        _wait_training(run, out)
        victim = _worker_pid(run, out, stalled)
        os.kill(victim, signal.SIGSTOP)
        code, err, seconds = _finish(run, 90)
        assert code == 1, err[-2000:]
        assert "8 s timeout (--ddp-timeout)" in err and f"rank {stalled} stopped responding" in err, err[-3000:]
        assert "stopped with SIGKILL" in err  # a stopped process ignores SIGTERM: the launcher would wait 30 s
        # 8 s timeout + 1 s watch interval (observed 9-12 s in all on a quiet machine), + slack for load
        assert seconds < 8 + 3 + 15, seconds
    finally:
        _cleanup(run)


def test_ctrl_c_says_interrupted(tmp_path):
    """Bug caught: SIGINT reported as 'a worker failed'. Ctrl-C exits 130 and says it was interrupted
    and where the checkpoints are."""
    out = tmp_path / "intr"
    run = _start([*LONG, "--output-dir", str(out)])
    try:
        _wait_training(run, out)
        os.kill(run.pid, signal.SIGINT)
        code, err, seconds = _finish(run, 60)
        assert code == 130 and "interrupted" in err and "resume with --resume-from-checkpoint" in err, err[-2000:]
        assert "worker failed" not in err
        assert seconds < 40
    finally:
        _cleanup(run)


# -- output directory -----------------------------------------------------------------------------
def test_stale_lock_of_a_dead_run_is_taken_over(tmp_path):
    """Bug caught: a lock left by a killed launcher blocking every later run, and a live one ignored."""
    from ulysses_sp.cli.train import lock

    out = tmp_path / "o"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock.lock_path(out).write_text(json.dumps({"pid": dead.pid, "host": os.uname().nodename, "started": 0}))
    assert lock.acquire(out) == lock.lock_path(out)  # stale: taken over
    lock.lock_path(out).write_text(json.dumps({"pid": os.getppid(), "host": os.uname().nodename, "started": 0}))
    with pytest.raises(lock.OutputLockedError, match="being written by another run"):
        lock.acquire(out)
    lock.lock_path(out).write_text(json.dumps({"pid": 1, "host": "another-host", "started": 0}))
    with pytest.raises(lock.OutputLockedError, match="delete"):
        lock.acquire(out)


def test_checkpoints_of_a_stopped_run_are_not_deleted(tmp_path, capsys):
    """Bug caught: rerunning without --resume-from-checkpoint silently deleting the stopped run's
    checkpoints. Refused (exit 2) with the resume command; --overwrite-output-dir discards them."""
    out = tmp_path / "run"
    ckpt = tmp_path / "run.incomplete" / "checkpoint-5"
    ckpt.mkdir(parents=True)
    assert main(["train", *TASK, "--max-steps", "1", "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"--resume-from-checkpoint {ckpt}" in err and "--overwrite-output-dir" in err
    assert ckpt.exists()
    assert main(["train", *TASK, "--max-steps", "1", "--resume-from-checkpoint", str(tmp_path / "missing"),
                 "--output-dir", str(out)]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_resume_keeps_metrics_once_and_the_total_time(tmp_path):
    """Bug caught: metrics.jsonl repeating the steps between the checkpoint and the kill after a resume,
    and train_seconds counting only the resumed part."""
    from ulysses_sp.cli.train.worker import _prepare_staging

    staging = tmp_path / "run.incomplete"
    ckpt = staging / "checkpoint-5"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 5}))
    records = [{"step": s, "loss": 1.0 / s, "elapsed_seconds": 2.0 * s} for s in range(1, 9)]
    (staging / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    offset = _prepare_staging(staging, str(ckpt))
    kept = [json.loads(line) for line in (staging / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in kept] == [1, 2, 3, 4, 5]
    assert offset == 16.0  # the stopped run trained until its last log (step 8), not only to step 5
    assert ckpt.exists()


# -- bad data, checked before launch --------------------------------------------------------------
def _chat(i: int) -> str:
    return json.dumps({"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]})


DATA_CASES = {
    "empty.jsonl": ("", "has no rows"),
    "broken.jsonl": ("\n".join([_chat(0), _chat(1), '{"messages": [', _chat(3)]) + "\n",
                     "broken.jsonl:3 is not valid JSON"),
    "binary.jsonl": (b"\x00\x01\x02PK\x03\x04" * 10, "not UTF-8 text (a binary file?)"),
    "empty_text.jsonl": (json.dumps({"text": "fine"}) + "\n" + json.dumps({"text": ""}) + "\n",
                         "empty_text.jsonl:2 has an empty 'text'"),
    "columns.jsonl": (json.dumps({"body": "x"}) + "\n", "columns.jsonl:1: rows have columns ['body']"),
    "array_row.jsonl": ("[1, 2]\n", "is a JSON list, not an object"),
    "bad_messages.jsonl": (json.dumps({"messages": ["hi"]}) + "\n", "must be a list of"),
    "latin1.txt": ("caf\u00e9\n".encode("latin-1"), "is not UTF-8 text"),
}


@pytest.mark.parametrize("name", sorted(DATA_CASES))
def test_bad_data_file_refused_before_launch(name, hf_dir, tmp_path, capsys):
    """Bug caught: only the first row was checked before launch, so an empty file ended in a bare
    StopIteration and a broken / binary / empty row in a datasets traceback after the workers started.
    Each case: exit 2, one message naming the file (and line) and the fix, nothing written."""
    content, message = DATA_CASES[name]
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    out = tmp_path / "never"
    t0 = time.monotonic()
    assert main(["train", "--model", str(hf_dir), "--dataset", str(path), "--seq-len", "32",
                 "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err
    assert not out.exists()
    assert not out.with_name("never.incomplete").exists() and not out.with_name("never.lock").exists()
    assert time.monotonic() - t0 < 60


def test_files_of_different_kinds_refused(hf_dir, tmp_path, capsys):
    """Bug caught: a glob mixing chat and text rows failing inside datasets after launch."""
    chat, text = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    chat.write_text(_chat(0) + "\n")
    text.write_text(json.dumps({"text": "plain"}) + "\n")
    assert main(["train", "--model", str(hf_dir), "--dataset", str(chat), str(text), "--seq-len", "32",
                 "--output-dir", str(tmp_path / "o")]) == 2
    assert "has 'messages' rows but" in capsys.readouterr().err


# -- command-line holes ---------------------------------------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["--learning-rat", "1e-3"], "unknown option(s): --learning-rat"),
    (["--sp-size", "0"], "sp_size must be a positive integer"),
    (["--sp-backend", "megatron"], "sp_backend 'megatron' is not available"),
    (["--sp-backend", "ring", "--sp-size", "8", "--num-heads", "4", "--dp-size", "1", "--nproc-per-node", "3"],
     "make them equal"),
])
def test_cli_holes_refused_before_launch(argv, message, tmp_path, capsys):
    """Bug caught: argparse prefix matching silently setting another option, and bad values failing in
    the workers."""
    assert main(["train", *TASK, *argv, "--output-dir", str(tmp_path / "o")]) == 2
    assert message in capsys.readouterr().err


def test_report_to_without_its_package_refused(tmp_path, capsys):
    """Bug caught: --report-to tensorboard without the package failing 30 s in with a long traceback."""
    import importlib.util

    if importlib.util.find_spec("tensorboard") or importlib.util.find_spec("tensorboardX"):
        pytest.skip("tensorboard is installed here")
    assert main(["train", *TASK, "--report-to", "tensorboard", "--output-dir", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "--report-to tensorboard" in err and "install" in err


def test_non_causal_model_refused_by_train_and_check(tmp_path, capsys):
    """Bug caught: a BERT encoder (bidirectional attention) trained with a causal mask and exit 0."""
    from transformers import BertConfig, BertForMaskedLM

    path = tmp_path / "bert"
    BertForMaskedLM(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                               intermediate_size=32, max_position_embeddings=64)).save_pretrained(path)
    assert main(["train", "--model", str(path), "--random-init", "--seq-len", "32", "--sp-size", "1",
                 "--output-dir", str(tmp_path / "o")]) == 2
    assert "bidirectional" in capsys.readouterr().err
    assert main(["check", str(path), "--sp-size", "1", "--random-init"]) == 2
    assert "bidirectional" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--sp-size", "0"], ["--seq-len", "0"], ["--seq-len", "30", "--sp-size", "4"]])
def test_demo_bad_sizes_exit_2(argv, capsys):
    """Bug caught: ulysses-sp demo --sp-size 0 ending in ZeroDivisionError."""
    assert main(["demo", *argv]) == 2
    assert "error:" in capsys.readouterr().err


def test_accelerate_parallelism_and_a_missing_world_are_refused_by_one_check():
    """Bug caught: the Trainer and the Accelerate adapters each refusing Accelerate's own parallelism
    (and making the one-process world) with a copy of their own that drifts: every size that starts
    Accelerate's parallelism is refused, with the fix, and a world of 2 without a launcher too."""
    import torch.distributed as dist
    from accelerate.parallelism_config import ParallelismConfig

    from ulysses_sp.integrations.setup_checks import ensure_process_group, refuse_accelerate_parallelism

    for sizes in (dict(sp_size=2, sp_backend="deepspeed"), dict(tp_size=2), dict(cp_size=2), dict(dp_shard_size=2)):
        used = {k: v for k, v in sizes.items() if k != "sp_backend"}
        with pytest.raises(ValueError, match=f"the Accelerator's ParallelismConfig sets {used}.*remove "
                                             "parallelism_config from the accelerate config"):
            refuse_accelerate_parallelism(ParallelismConfig(**sizes), "the Accelerator's ParallelismConfig",
                                          "the accelerate config", "UlyssesAccelerate(...)")
    refuse_accelerate_parallelism(ParallelismConfig(), "x", "y", "z")  # all sizes 1: nothing to refuse
    refuse_accelerate_parallelism(None, "x", "y", "z")
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="not initialised for a world of 2; launch with torchrun"):
        ensure_process_group(2)


def test_trainer_refuses_leftover_parallelism_config(tmp_path):
    """Bug caught: TrainingArguments(parallelism_config=sp_size 2) starting Accelerate's DeepSpeed SP
    beside ours and crashing there; refused before the Trainer is built, naming the fix."""
    from accelerate.parallelism_config import ParallelismConfig
    from transformers import TrainingArguments

    from tiny_models import tiny_model
    from ulysses_sp import UlyssesSPConfig, UlyssesTrainer

    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    args.parallelism_config = ParallelismConfig(sp_size=2, sp_backend="deepspeed")
    with pytest.raises(ValueError, match="remove parallelism_config"):
        UlyssesTrainer(model=tiny_model("llama"), args=args, sp_config=UlyssesSPConfig(sp_size=2))


def test_accelerate_one_process_says_how_to_launch():
    """Bug caught: 'accelerate launch --num_processes 2' without a config ending in 'does not divide
    world size 1' with no hint that only one process was started."""
    from accelerate import Accelerator

    from ulysses_sp import UlyssesAccelerate, UlyssesSPConfig

    with pytest.raises(ValueError, match="needs 2 processes, but the Accelerator runs 1.*accelerate launch"):
        UlyssesAccelerate(Accelerator(cpu=True), UlyssesSPConfig(sp_size=2))


def test_mesh_groups_get_the_timeout():
    """Bug caught: SP / DP groups created with torch's 30-minute default whatever timeout was asked for."""
    from dist_helper import spawn

    spawn(_mesh_timeout_worker, 2, timeout_s=60)


def _mesh_timeout_worker(rank, world):
    import torch.distributed as dist

    from ulysses_sp import SPMesh

    mesh = SPMesh.from_world(2, timeout_s=2)
    assert mesh.timeout_s == 2
    if rank == 1:
        time.sleep(6)  # never joins rank 0's all-reduce in time
        return
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="(?i)timed out"):
        dist.all_reduce(torch.ones(1), group=mesh.sp_group)
    assert time.monotonic() - t0 < 5
    with pytest.raises(ValueError, match="timeout_s"):
        SPMesh.from_world(1, timeout_s=math.nan)


@pytest.mark.parametrize("argv, message", [
    (["--budget-gib", "0"], "--budget-gib must be a positive number"),
    (["--budget-gib", "nan"], "--budget-gib must be a positive number"),
    (["--sp-size", "64", "--sp-ring-size", "1"], "all-to-all over 64 ranks > num_attention_heads 32"),
    (["--seq-len", "0"], "--seq-len must be >= 1"),
])
def test_plan_refuses_what_train_refuses(argv, message, capsys):
    """Bug caught: ulysses-sp plan answering for a budget of 0 or NaN, or for sp 64 on a 32-head model."""
    base = {"--model": "llama-3-8b", "--seq-len": "131072", "--budget-gib": "80", "--sp-size": "8"}
    base.update(dict(zip(argv[::2], argv[1::2])))
    assert main(["plan", *[x for kv in base.items() for x in kv]]) == 2
    assert message in capsys.readouterr().err


def test_plan_refuses_a_non_causal_model(tmp_path, capsys):
    """Bug caught: the planner predicting memory for an encoder that train and check refuse."""
    from transformers import BertConfig

    BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
               intermediate_size=32).save_pretrained(tmp_path)
    assert main(["plan", "--model", str(tmp_path), "--seq-len", "1024", "--budget-gib", "8"]) == 2
    assert "bidirectional" in capsys.readouterr().err


def test_different_batches_in_one_sp_group_raise():
    """Bug caught: UlyssesSP.shard training on different batches per rank of one SP group with no error
    (each rank would attend to another sequence's keys). On by default; check_same=False skips it.
    Also different weights (unseeded random init, no DDP broadcast: each shard runs another model)
    and different head chunks (different collectives: a hang) are refused at the first shard."""
    from dist_helper import spawn

    spawn(_different_batches_worker, 2, timeout_s=120)


def _different_batches_worker(rank, world):
    from tiny_models import tiny_model
    from ulysses_sp import SPMesh, UlyssesSP, UlyssesSPConfig

    mesh = SPMesh.from_world(2)
    sp = UlyssesSP(tiny_model("llama"), mesh)
    batch = {"input_ids": torch.arange(16)[None] + rank}  # rank 1 holds another sequence
    with pytest.raises(ValueError, match="must see the same batch"):
        sp.shard(batch)
    assert sp.shard(batch, check_same=False)["input_ids"].shape == (1, 8)  # the documented switch
    labels = torch.arange(16)[None].masked_fill(torch.arange(16) < 4 + rank, -100)  # a per-rank prompt mask
    with pytest.raises(ValueError, match=r"input_ids agree but \['labels'\] differ"):
        sp.shard({"input_ids": torch.arange(16)[None], "labels": labels})
    # the first checked shard also compares config, model shape and weights over the SP group
    same = {"input_ids": torch.arange(16)[None]}
    differ = UlyssesSP(tiny_model("llama", seed=rank), mesh)  # a random init without a common seed
    with pytest.raises(ValueError, match=r"differ in: weights .*torch.manual_seed"):
        differ.shard(same)
    model = tiny_model("llama", seed=rank)
    sp = UlyssesSP(model, mesh)
    torch.nn.parallel.DistributedDataParallel(model)  # broadcasts rank 0's weights when it wraps: then fine
    assert sp.shard(same)["input_ids"].shape == (1, 8)
    with torch.no_grad():  # a step whose gradients were not averaged over the group: the weights drift apart
        model.model.layers[1].mlp.up_proj.weight.add_(0.01 * rank)
    with pytest.raises(ValueError, match=r"differ in: trained weights .*gradients are not averaged over the SP group"):
        sp.shard(same)
    chunks = UlyssesSP(tiny_model("llama"), mesh, UlyssesSPConfig(sp_size=2, sp_head_chunks=1 + rank))
    with pytest.raises(ValueError, match=r"differ in: UlyssesSPConfig \(sp_backend, sp_head_chunks"):
        chunks.shard(same)  # would issue different collectives per rank


def test_disable_tqdm_is_honoured(tmp_path):
    """Bug caught: --disable-tqdm true ignored (our bar still drawn) and false drawing two bars (ours and
    the Trainer's). true: no bar; false (the default): every progress line is ours ('train:')."""
    for flag, out in (("true", tmp_path / "quiet"), ("false", tmp_path / "bar")):
        done = subprocess.run([sys.executable, "-m", "ulysses_sp.cli.main", "train", *TASK, "--max-steps", "3",
                               "--disable-tqdm", flag, "--output-dir", str(out)], capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        bars = [p for p in done.stderr.replace("\r", "\n").splitlines() if "it/s]" in p or "s/it]" in p]
        if flag == "true":
            assert bars == [], bars
        else:
            assert bars and all(p.lstrip().startswith("train:") for p in bars), bars
