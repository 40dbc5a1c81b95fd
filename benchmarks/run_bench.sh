#!/usr/bin/env bash
# The results table of docs/bench.md / benchmarks/README.md: our Ulysses vs DeepSpeed's
# UlyssesSPAttentionHF vs our ring attention vs one process, S in {256, 1024, 2048}, P in {2, 4},
# isolated runs (time, memory, bytes) and paired runs (alternating steps, robust time ratios).
# CPU/gloo, or CUDA/NCCL when a GPU is visible. Run it on a QUIET machine (~3-5 min on 2 idle cores):
#   benchmarks/run_bench.sh [extra ulysses-sp bench flags, e.g. --seq-lens 1024 4096]
set -euo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-.venv/bin/python}"
out=benchmarks/results
mkdir -p "$out"
tag=$("$py" -c 'import torch; print("cuda" if torch.cuda.is_available() else "cpu")')
exec "$py" -m ulysses_sp.cli.main bench \
  --seq-lens 256 1024 2048 --sp-sizes 2 4 --warmup 1 --repeats 5 --mode both \
  --json "$out/bench_$tag.json" --markdown "$out/bench_$tag.md" --plots "$out/plots_$tag" "$@"
