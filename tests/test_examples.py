"""The runnable examples, launched as users launch them."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dist_helper import run_launcher

ROOT = Path(__file__).resolve().parents[1]


def run_torchrun(nproc: int, *args: str) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           str(ROOT / "examples" / "torchrun_train.py"), *args]
    try:
        out = run_launcher(cmd, 300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    except subprocess.TimeoutExpired as err:  # show where it stood (stdout: the steps done)
        raise AssertionError(f"torchrun hung; stdout: {err.stdout!r:.2000}; stderr: {err.stderr!r:.3000}") from None
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def torchrun_sp2(tmp_path_factory):
    """The SP=2 run of 3 steps; it also saves its state after step 1 (and trains on) for the resume test."""
    ckpt = tmp_path_factory.mktemp("torchrun") / "ckpt"
    return ckpt, run_torchrun(2, "--sp-size", "2", "--steps", "3", "--save-at", "1", "--save-dir", str(ckpt))


def test_torchrun_example_sp2_matches_one_process_step_by_step(torchrun_sp2):
    """Bug caught: an SP training loop whose optimizer trajectory drifts from one process (wrong loss
    scale, lost targets at shard boundaries, SP ranks reading different data)."""
    _, sp = torchrun_sp2
    single = run_torchrun(1, "--sp-size", "1", "--steps", "3")
    assert [r["step"] for r in sp] == [1, 2, 3] == [r["step"] for r in single]
    for a, b in zip(sp, single):
        # fp32, summation order only; AdamW's normalised updates keep trajectories within ~1e-6
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)


def test_torchrun_example_resume_matches_uninterrupted_run(torchrun_sp2):
    """Bug caught: a resume that replays the first batches, drops the optimizer's moments or the step
    count: after loading the state saved at step 1, steps 2 and 3 must equal the run that went on."""
    ckpt, sp = torchrun_sp2
    resumed = run_torchrun(2, "--sp-size", "2", "--steps", "3", "--resume-from", str(ckpt))
    assert [r["step"] for r in resumed] == [2, 3]
    for a, b in zip(resumed, sp[1:]):
        # same 2 processes, same state and batches: bitwise equal in practice (observed 0);
        # 1e-6 relative only allows for a different gloo reduction order
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-6)


def test_a_timed_out_launch_leaves_no_rank_behind():
    """Bug caught: a launch that times out (a hung torchrun / accelerate launch in these tests) killing
    only the launcher, its ranks left waiting on a dead peer and taking the cores of every later test."""
    child = "import time; time.sleep(120)"
    # the rank does not hold the launcher's pipes, so only killing it ends it (not the pipes closing)
    parent = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', %r], "
              "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); print(p.pid, flush=True); time.sleep(120)"
              % child)
    with pytest.raises(subprocess.TimeoutExpired) as caught:
        run_launcher([sys.executable, "-c", parent], 3)
    rank = int(caught.value.output.split()[0])
    status = Path(f"/proc/{rank}/status")
    # killed with its group: gone, or a zombie until the container's init reaps it
    assert not status.exists() or "State:\tZ" in status.read_text()
