#!/usr/bin/env bash
# The main job on the embedded default: install, fetch the offline SmolLM2 model, prepare the
# synthetic memory task, build its latent memory bank, train ElasticMem with GRPO (train.py
# evaluates it greedily on the validation split at the end), then compare it on the test split
# with the no-memory and text-RAG baselines (runs/eval/quickstart/comparison.md), from scratch
# (eval.overwrite=true: a rerun with other settings must not resume the last run's predictions).
# The summary printed last: each system's accuracy with its 95 % interval and n, then each
# baseline against ElasticMem on the same questions (accuracy difference with its 95 %
# interval, exact McNemar p, discordant counts; flagged when n < 200: the quickstart's test
# split is a demonstration, too small for a headline).
#   bash scripts/quickstart.sh [key=value ...]      # overrides go to every step
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup.sh
CONFIG=${CONFIG:-configs/quickstart.yaml}
python -m elasticmem.backbone fetch smollm2
python -m elasticmem.data.prepare synthetic --config "$CONFIG" "$@"
python build_bank.py --config "$CONFIG" "$@"
python train.py --config "$CONFIG" "$@"
python evaluate.py --config "$CONFIG" eval.overwrite=true "$@"
