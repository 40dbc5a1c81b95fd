"""``scripts/gpu_check.py --dry-run``: the GPU readiness script runs its steps on CPU.

The script is what a GPU machine runs (GPU tests, bf16 bench, CUDA memory ablation); this test
runs the same code paths with tiny shapes on CPU so a renamed flag, a moved test file or a changed
output format breaks here instead of on the rare machine with a GPU.
"""

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.py"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_check_dry_run_runs_every_step_and_writes_one_json(tmp_path):
    """Bug caught: a step whose command no longer runs (bench flags, test path, ablation script), a
    JSON without the per-step results, GPU tests that run (instead of skipping) without CUDA, a
    bench whose chunked system disagrees with one process on the loss, and a head-block memory step
    that measures no mode."""
    out = tmp_path / "gpu_check.json"
    assert _load().main(["--dry-run", "--out", str(out), "--budget-s", "240"]) == 0
    results = json.loads(out.read_text())
    assert results["ok"] and results["dry_run"]
    assert set(results["steps"]) == {"gpu_tests", "cuda_check", "bench", "memory_ablation", "head_chunks",
                                     "head_blocks", "packed_varlen"}
    assert {r["head_chunks"] for r in results["steps"]["head_chunks"]["records"]} == {1, 4}
    blocks = results["steps"]["head_blocks"]["records"]
    assert [r["mode"] for r in blocks] == ["unchunked", "calls C=2", "calls C=4", "blocks C=2", "blocks C=4"]
    assert all(0 < r["full_max"] <= r["tracked"] for r in blocks), blocks  # the tracker saw the exchanges
    tests = results["steps"]["gpu_tests"]
    assert tests["counts"]["skipped"] >= 1 and tests["counts"]["failed"] == tests["counts"]["error"] == 0
    checks = results["steps"]["cuda_check"]["cases"]
    assert len(checks) == 2 and all(c["result"] == "RESULT: MATCH" for c in checks.values()), checks
    records = results["steps"]["bench"]["records"]
    runs = {r["system"]: r for r in records if "mode" not in r}
    assert set(runs) == {"single", "ulysses", "ulysses_chunked"}
    # fp32, same weights and batch; only summation order differs: 1e-5 relative
    assert runs["ulysses_chunked"]["loss"] == pytest.approx(runs["single"]["loss"], rel=1e-5)
    assert {r["head_chunks"] for r in records if r.get("mode") == "attention_memory"} == {1, 2}
    rows = results["steps"]["memory_ablation"]["rows"]
    assert rows and rows[0]["rung"] == "plain" and int(rows[0]["longest S"]) > 0
    packed = results["steps"]["packed_varlen"]["rows"]
    assert [r["documents"] for r in packed] == [1, 4, 64] and all(r["sdpa"]["status"] == "ok" for r in packed)
    assert all(r["torch_varlen"]["status"].startswith("skipped") for r in packed)  # no CUDA in a dry run


def test_gpu_check_refuses_to_run_without_cuda_unless_dry_run(tmp_path):
    """Bug caught: the script silently measuring CPU numbers and labelling them as a GPU check."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA present: the real check would run")
    assert _load().main(["--out", str(tmp_path / "x.json")]) == 2
    assert not (tmp_path / "x.json").exists()
