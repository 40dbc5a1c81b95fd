"""GPU readiness check: everything that needs a GPU, in one command, one JSON, under 8 minutes.

    .venv/bin/python scripts/gpu_check.py --out gpu_check.json        # on a machine with CUDA
    .venv/bin/python scripts/gpu_check.py --dry-run --out /tmp/x.json  # on CPU: the same steps, tiny

Steps (each a subprocess with its own timeout, so one stuck step cannot eat the others' time;
the JSON is rewritten after each step, so an interrupted run keeps what it measured):

    1. environment   torch / CUDA / GPU names, bf16 support, flash-attn and DeepSpeed installed?
    2. gpu_tests     the GPU-marked tests (``pytest -m gpu tests/test_gpu_kernels.py``: flash-attention
                     varlen and flex kernels against eager, no S x S tensor), counts and failures
                     from a JUnit report
    3. cuda_check    ``ulysses-sp check --device cuda`` on a small Llama config: SP loss and every
                     gradient against one process on the GPU (sdpa with packed documents and with
                     padding, compiled flex_attention, bf16, P=4 with K=2 < P); with fewer GPUs than P
                     the ranks share them over gloo, which checks the CUDA path, not NCCL
    4. bench         ``ulysses-sp bench`` in bf16 with flash_attention_2 where installed (else sdpa):
                     one process, Ulysses and head-chunked Ulysses (+ DeepSpeed with >= 2 GPUs) at
                     the P the visible GPUs allow, plus one attention layer's peak memory with and
                     without head chunks at P=2 (ranks share a GPU where there is one); the records
    5. memory_ablation
                     ``benchmarks/memory_ablation.py --device cuda``: the longest trainable sequence
                     per rung in CUDA memory (P=2 rungs share one GPU over gloo if needed); the rows

    6. head_chunks   ``ulysses-sp bench --mode memory``: one attention layer's peak (forward + backward)
                     in CUDA memory at S=32K and 64K, P=2 (the ranks share a GPU where there is one),
                     unchunked against ``sp_head_chunks=4`` (4 chunks of the 8 query heads a rank
                     holds; bf16, sdpa)
    7. head_blocks   ``benchmarks/head_block_memory.py --device cuda``: one attention MODULE's peak
                     (projections + attention + o_proj, forward + backward) in CUDA memory at S=32K and
                     64K, P=2, bf16: unchunked, attention-call chunks and head blocks at C = 2, 4
    8. packed_varlen
                     ``benchmarks/packed_varlen.py``: ``torch_varlen`` and ``sdpa`` against per-document
                     SDPA at S=32K with 1, 64 and 1024 documents (bf16, fwd + bwd): max differences and
                     times; on CPU / a torch without ``varlen_attn`` the varlen column says skipped

``--dry-run`` runs the same steps on CPU with tiny shapes (the GPU tests are then skipped), so the
test suite exercises this script and it cannot rot. Exit code 0 when every step passed.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH_MODEL = ["--layers", "4", "--hidden", "2048", "--intermediate", "5632", "--heads", "16", "--kv-heads", "8",
               "--head-dim", "128", "--vocab", "32000"]  # Llama-1B-like layers: GPU steps of tens of ms, not launch-bound
TINY_MODEL = ["--layers", "2", "--hidden", "32", "--intermediate", "48", "--heads", "4", "--kv-heads", "2",
              "--head-dim", "8", "--vocab", "64"]


def environment() -> dict:
    """What the results were measured on."""
    import torch

    info = {"python": platform.python_version(), "platform": platform.platform(), "torch": torch.__version__,
            "cuda_available": torch.cuda.is_available(), "cpu_count": os.cpu_count(),
            "load_average_1min": os.getloadavg()[0],
            "packages": {name: importlib.util.find_spec(name) is not None
                         for name in ("flash_attn", "flash_attn_interface", "deepspeed", "transformers")}}
    if torch.cuda.is_available():
        info.update(cuda=torch.version.cuda, gpu_count=torch.cuda.device_count(),
                    gpus=[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
                    bf16_supported=torch.cuda.is_bf16_supported())
    return info


def run_step(command: list[str], timeout_s: float) -> dict:
    """Run ``command`` from the repository root; status ``ok`` / ``failed`` / ``timeout`` and the output tail."""
    start = time.monotonic()
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=max(timeout_s, 1),
                              check=False)
        status, code, out = ("ok" if proc.returncode == 0 else "failed"), proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        status, code = "timeout", None
        out = (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
    return {"status": status, "returncode": code, "seconds": round(time.monotonic() - start, 1),
            "command": " ".join(command), "output_tail": out[-4000:]}


def gpu_tests(tmp: str, dry_run: bool, timeout_s: float) -> dict:
    """The GPU-marked tests; per-test outcome from pytest's JUnit XML."""
    report = os.path.join(tmp, "gpu_tests.xml")
    step = run_step([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                     "tests/test_gpu_kernels.py", f"--junitxml={report}"], timeout_s)
    if os.path.exists(report):
        cases = []
        for case in ET.parse(report).getroot().iter("testcase"):
            outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
            cases.append({"name": case.get("name"), "outcome": outcome, "seconds": float(case.get("time", 0))})
        step["cases"] = cases
        step["counts"] = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "error", "skipped")}
    if dry_run and step["status"] == "ok" and step.get("counts", {}).get("passed"):
        step["status"], step["note"] = "failed", "GPU tests ran on CPU: the gpu marker or skip condition is broken"
    return step


CHECK_MODEL = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
               "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
               "head_dim": 32, "vocab_size": 1024, "max_position_embeddings": 4096, "tie_word_embeddings": False}
SINKS_MODEL = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 256,
               "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
               "head_dim": 32, "vocab_size": 1024, "max_position_embeddings": 4096, "tie_word_embeddings": False,
               "sliding_window": 128, "num_local_experts": 4, "num_experts_per_tok": 2,
               "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}  # attention sinks, MoE


def cuda_check(tmp: str, dry_run: bool, timeout_s: float) -> dict:
    """``ulysses-sp check`` runs on the GPU: exit 0 (MATCH) for every case, the RESULT lines."""
    config, sinks_config = os.path.join(tmp, "check_llama.json"), os.path.join(tmp, "check_gpt_oss.json")
    for path, model in ((config, CHECK_MODEL), (sinks_config, SINKS_MODEL)):
        with open(path, "w") as f:
            json.dump(model, f)
    device, seq = ("cpu", "64") if dry_run else ("cuda", "1024")
    base = ["--random-init", "--device", device, "--seq-len", seq, "--model", config]
    cases = {"sdpa_packed_p2": ["--sp-size", "2", "--packed", "--attn-implementation", "sdpa"],
             "sdpa_padding_p2": ["--sp-size", "2", "--padding", "--attn-implementation", "sdpa"],
             "bf16_packed_p2": ["--sp-size", "2", "--packed", "--dtype", "bfloat16", "--attn-implementation", "sdpa"],
             "sdpa_packed_p4": ["--sp-size", "4", "--packed", "--attn-implementation", "sdpa"]}
    if dry_run:  # the script's own check: two cases keep it quick on CPU
        cases = dict(list(cases.items())[:2])
    else:  # flex_attention has no CPU backward
        cases["flex_packed_p2"] = ["--sp-size", "2", "--packed", "--attn-implementation", "flex_attention"]
        cases["gpt_oss_sinks_flex_p2"] = ["--model", sinks_config, "--sp-size", "2", "--packed",  # overrides --model
                                          "--attn-implementation", "flex_attention"]
    start, results = time.monotonic(), {}
    for name, flags in cases.items():
        left = timeout_s - (time.monotonic() - start)
        if left < 5:
            results[name] = {"status": "skipped: no time left"}
            continue
        r = run_step([sys.executable, "-m", "ulysses_sp.cli.main", "check", *base, *flags], left)
        r["result"] = next((line for line in r["output_tail"].splitlines() if line.startswith("RESULT")), None)
        results[name] = r
    ok = all(r["status"] == "ok" and r.get("result") == "RESULT: MATCH" for r in results.values())
    return {"status": "ok" if ok else "failed", "seconds": round(time.monotonic() - start, 1), "cases": results,
            "output_tail": "\n".join(f"{n}: {r['status']} {r.get('result')}" for n, r in results.items())}


def bench(tmp: str, dry_run: bool, gpus: int, timeout_s: float) -> dict:
    """``ulysses-sp bench`` in bf16 (flash_attention_2 where installed) with the attention-memory table."""
    out = os.path.join(tmp, "bench.json")
    if dry_run:
        flags = ["--device", "cpu", "--sp-sizes", "2", "--seq-lens", "64", *TINY_MODEL, "--repeats", "1"]
    else:
        kernel = "flash_attention_2" if importlib.util.find_spec("flash_attn") else "sdpa"
        # timing runs at P=2 need 2 GPUs (P=1 otherwise); attention memory runs at P=2 either way
        sp_sizes = ["2"] if gpus >= 2 else ["1", "2"]
        flags = ["--device", "cuda", "--dtype", "bfloat16", "--attn-implementation", kernel, *BENCH_MODEL,
                 "--sp-sizes", *sp_sizes, "--seq-lens", "8192", "32768", "--repeats", "3"]
    systems = ["single", "ulysses", "ulysses_chunked"] + (["deepspeed"] if gpus >= 2 else [])
    step = run_step([sys.executable, "-m", "ulysses_sp.cli.main", "bench", *flags, "--systems", *systems,
                     "--mode", "isolated", "--attention-memory", "--sp-head-chunks", "2", "--json", out,
                     "--budget-s", str(int(timeout_s * 0.9))], timeout_s)
    step["records"] = _read_json(out)
    return step


def memory_ablation(tmp: str, dry_run: bool, gpus: int, timeout_s: float) -> dict:
    """``benchmarks/memory_ablation.py`` in CUDA memory (the P=2 rungs with >= 2 GPUs); its table rows."""
    md = os.path.join(tmp, "ablation.md")
    if dry_run:
        flags = ["--device", "cpu", "--rungs", "plain", "--budget-mib", "40"]
    else:
        rungs = ["plain", "tiled_loss", "ulysses", "tiled_mlp", "offload"]  # P=2 rungs share one GPU if need be
        flags = ["--device", "cuda", "--rungs", *rungs, "--budget-mib", "512"]
    step = run_step([sys.executable, "benchmarks/memory_ablation.py", *flags, "--out", md], timeout_s)
    rows, header = [], None
    for line in _read_text(md).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| rung"):
            header = cells
        elif header and line.startswith("|") and not line.startswith("|---"):
            rows.append(dict(zip(header, cells)))
    step["rows"] = rows
    if step["status"] == "ok" and not rows:
        step["status"], step["note"] = "failed", "no table rows in the ablation's output"
    return step


def head_chunks(tmp: str, dry_run: bool, timeout_s: float) -> dict:
    """One attention layer's CUDA peak with and without head chunks (``ulysses-sp bench --mode memory``)."""
    out = os.path.join(tmp, "head_chunks.json")
    flags = (["--device", "cpu", "--seq-lens", "64", *TINY_MODEL] if dry_run else
             ["--device", "cuda", "--dtype", "bfloat16", *BENCH_MODEL, "--seq-lens", "32768", "65536"])
    step = run_step([sys.executable, "-m", "ulysses_sp.cli.main", "bench", *flags, "--sp-sizes", "2",
                     "--mode", "memory", "--sp-head-chunks", "4", "--json", out], timeout_s)
    step["records"] = [r for r in _read_json(out) if r.get("mode") == "attention_memory"]
    if step["status"] == "ok" and not step["records"]:
        step["status"], step["note"] = "failed", "no attention-memory records"
    return step


def head_blocks(tmp: str, dry_run: bool, timeout_s: float) -> dict:
    """One attention module's CUDA peak per head-chunk mode (``benchmarks/head_block_memory.py``)."""
    out = os.path.join(tmp, "head_blocks.json")
    flags = (["--device", "cpu", "--seq-lens", "256", "--heads", "4", "--head-dim", "8", "--kv-heads", "2"]
             if dry_run else ["--device", "cuda", "--dtype", "bfloat16", "--seq-lens", "32768", "65536",
                              "--heads", "16", "--head-dim", "128", "--kv-heads", "8"])
    step = run_step([sys.executable, "benchmarks/head_block_memory.py", *flags, "--sp-sizes", "2", "--json", out],
                    timeout_s)
    step["records"] = _read_json(out)
    if step["status"] == "ok" and not step["records"]:
        step["status"], step["note"] = "failed", "no head-block memory records"
    return step


def packed_varlen(tmp: str, dry_run: bool, timeout_s: float) -> dict:
    """``benchmarks/packed_varlen.py``: the varlen kernel against per-document SDPA; its rows."""
    out = os.path.join(tmp, "packed_varlen.json")
    flags = ["--device", "cpu", "--seq-len", "256", "--documents", "1,4,64", "--heads", "4", "--kv-heads", "2",
             "--head-dim", "8"] if dry_run else ["--device", "cuda"]
    step = run_step([sys.executable, "benchmarks/packed_varlen.py", *flags, "--out", out], timeout_s)
    text = _read_text(out)
    step["rows"] = json.loads(text)["rows"] if text else []
    return step


STEPS = ("gpu_tests", "cuda_check", "bench", "memory_ablation", "head_chunks", "head_blocks", "packed_varlen")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="gpu_check.json", help="the results JSON (rewritten after every step)")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes: check the script itself")
    parser.add_argument("--budget-s", type=float, default=480.0, help="total seconds for all steps (default 480)")
    parser.add_argument("--steps", nargs="+", choices=STEPS, default=list(STEPS),
                        help="run only these steps (default: all; environment is always recorded)")
    args = parser.parse_args(argv)
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA device; use --dry-run to check the script on CPU", file=sys.stderr)
        return 2
    gpus = 0 if args.dry_run else torch.cuda.device_count()
    start = time.monotonic()
    results = {"script": "scripts/gpu_check.py", "dry_run": args.dry_run,
               "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "budget_s": args.budget_s, "environment": environment(), "steps": {}}
    # step -> (function, share of the time left it may use)
    # shares sized from H200 runs: tests ~105 s (flex compiles), ~27 s per sdpa check case and ~85 s per
    # flex one (compiles on each rank), bench 65 s, ablation 88 s; --steps runs a subset with all the budget
    steps = {"gpu_tests": (lambda tmp, t: gpu_tests(tmp, args.dry_run, t), 0.3),
             "cuda_check": (lambda tmp, t: cuda_check(tmp, args.dry_run, t), 0.7),
             "bench": (lambda tmp, t: bench(tmp, args.dry_run, gpus, t), 0.5),
             "memory_ablation": (lambda tmp, t: memory_ablation(tmp, args.dry_run, gpus, t), 0.8),
             "head_chunks": (lambda tmp, t: head_chunks(tmp, args.dry_run, t), 0.5),
             "head_blocks": (lambda tmp, t: head_blocks(tmp, args.dry_run, t), 0.5),
             "packed_varlen": (lambda tmp, t: packed_varlen(tmp, args.dry_run, t), 1.0)}
    steps = {name: steps[name] for name in args.steps}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, (step, share)) in enumerate(steps.items()):
            left = args.budget_s - (time.monotonic() - start)
            share = 1.0 if i == len(steps) - 1 else share  # the last step run may use all the time left
            results["steps"][name] = step(tmp, share * left) if left > 10 else {"status": "skipped: no time left"}
            print(f"gpu_check: {name}: {results['steps'][name]['status']}", file=sys.stderr, flush=True)
            results["total_seconds"] = round(time.monotonic() - start, 1)
            results["ok"] = all(s["status"] == "ok" for s in results["steps"].values())
            _write(args.out, results)
    return 0 if results["ok"] and len(results["steps"]) == len(steps) else 1


def _read_text(path: str) -> str:
    if not os.path.exists(path):
        return ""
    with open(path) as f:
        return f.read()


def _read_json(path: str) -> list:
    text = _read_text(path)
    return json.loads(text) if text else []


def _write(path: str, results: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(results, f, indent=1)
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
