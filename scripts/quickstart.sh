#!/usr/bin/env bash
# The main job on the embedded default: install, fetch the offline SmolLM2 model, prepare the
# synthetic memory task, build its latent memory bank (layer-mean keys, each chunk's per-layer keys
# and values) and the retrieval's learned query/key map, then a shortened version of the persona
# recipe (docs/recipe.md):
# the supervised reading warm-up with the budget policy's supervised start, then GRPO from it; then
# compare trained ElasticMem on the 208 test questions with the same checkpoint with nothing
# retrieved (its memory's gain) and with the base reasoner without memory
# (runs/eval/quickstart/comparison.md), from scratch (eval.overwrite=true: a rerun with other
# settings must not resume the last run's predictions), and draw the learning curves
# (runs/eval/quickstart/warmup_curves.png, grpo_curves.png). The summary printed last: each system's
# accuracy with its 95 % interval and n, then each other system against ElasticMem on the same
# questions (accuracy difference with its 95 % interval, exact McNemar p, discordant counts).
#   bash scripts/quickstart.sh [key=value ...]      # overrides go to every step
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup.sh
CONFIG=${CONFIG:-configs/quickstart.yaml}
python -m elasticmem.backbone fetch smollm2
python -m elasticmem.data.prepare synthetic --config "$CONFIG" "$@"
python build_bank.py --config "$CONFIG" "$@"
read -r MAP BANK < <(python -c "import sys; from elasticmem.config import load_config; c = load_config(sys.argv[1], sys.argv[2:]); print(c.memory.retrieval_map or '-', c.bank.dir)" "$CONFIG" "$@")
# the learned query/key map of the preset's retrieval (~1 min), again whenever the bank is newer
if [ "$MAP" != - ] && { [ ! -f "$MAP" ] || [ "$MAP" -ot "$BANK/manifest.json" ]; }; then
  python -m elasticmem.warmup.retrieval_map --config "$CONFIG" "$@" --kind mlp --hidden 256 --out "$MAP"
fi
python -m elasticmem.warmup.reading --config "$CONFIG" "$@"
python train.py --config "$CONFIG" "$@"
python evaluate.py --config "$CONFIG" eval.overwrite=true "$@"
python -m elasticmem.eval.plots learning-curves runs/warmup/quickstart --out runs/eval/quickstart/warmup_curves.png
python -m elasticmem.eval.plots learning-curves runs/train/quickstart --out runs/eval/quickstart/grpo_curves.png
