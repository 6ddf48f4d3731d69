#!/usr/bin/env bash
# The GPU check: the gpu-marked tests, DeepSpeed ZeRO-2 bf16 training with gradient checkpointing,
# activation memory at Qwen2.5's vocabulary, group-restricted search on the GPU against the CPU, the
# warm-up and A-Mem's local backend on the GPU, and the GPU benchmarks at a Qwen2.5-3B-shaped random
# model: one JSON of figures. For a CUDA machine with no network (everything is local). Each stage
# runs in its own process with its own time limit and is recorded even when another fails; an
# optional piece that is missing (faiss-gpu, bitsandbytes, deepspeed, trl) is named in the JSON and
# the rest runs. Under 10 minutes on one GPU.
#   bash scripts/gpu_check.sh                                  # writes runs/gpu_check/gpu_check.json
#   bash scripts/gpu_check.sh --out /tmp/gpu.json --device cuda:1
#   bash scripts/gpu_check.sh --dry-run                        # on a CPU: every stage at tiny sizes
# The stages and the JSON are described in benchmarks/gpu_check.py; docs/cluster.md says how to
# read them. Install first: pip install -e '.[dev,gpu]' (faiss-gpu replaces faiss-cpu: see docs/installation.md).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ -z "${VIRTUAL_ENV:-}" ] && [ -f .venv/bin/activate ]; then
  source .venv/bin/activate
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec python benchmarks/gpu_check.py "$@"
