#!/usr/bin/env bash
# Final results table for docs/bench.md: our Ulysses vs DeepSpeed's UlyssesSPAttentionHF vs our ring
# attention vs one process, S in {1024, 2048, 4096}, P in {2, 4}, on this machine (CPU/gloo, or
# CUDA/NCCL when a GPU is visible). Run it on a QUIET machine; about 3-5 minutes on 2 idle CPU cores.
#   benchmarks/run_bench.sh [extra ulysses-sp bench flags]
set -euo pipefail
cd "$(dirname "$0")/.."
out=benchmarks/results
mkdir -p "$out"
tag=$(python -c 'import torch; print("cuda" if torch.cuda.is_available() else "cpu")' 2>/dev/null || echo cpu)
exec "${PYTHON:-.venv/bin/python}" -m ulysses_sp.cli.main bench \
  --seq-lens 1024 2048 4096 --sp-sizes 2 4 --warmup 2 --repeats 5 \
  --json "$out/bench_$tag.json" --markdown "$out/bench_$tag.md" --plots "$out/plots_$tag" "$@"
