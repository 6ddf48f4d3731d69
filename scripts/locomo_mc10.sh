#!/usr/bin/env bash
# LoCoMo MC-10 with SmolLM2 on CPU: ElasticMem trained with the recipe (layer-mean keys and their
# learned retrieval map, token alignment, reading warm-up, GRPO; configs/locomo_mc10.yaml) against
# the untrained reasoner without memory, text RAG with the same retrieval and with MiniLM, and the
# full context (the latest history that fits memory.recent_max_tokens), on the 314 questions of
# the 2 test conversations.
# Hours on 2 CPU cores. Resumable: run it again after an interruption; the data and the bank are
# reused, the warm-up and GRPO resume from their last checkpoints and the evaluation from its
# predictions.
#
#   LOCOMO=PATH/locomo10.json bash scripts/locomo_mc10.sh [key=value ...]
#
# Output: runs/eval/locomo_mc10/comparison.md (accuracy, n, 95 % interval, #Tok, paired tests)
# and the learning curves of both training stages next to it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
: "${LOCOMO:?set LOCOMO to locomo10.json (snap-research/LoCoMo, data/locomo10.json)}"
[ -f "$LOCOMO" ] || { echo "LOCOMO=$LOCOMO: no such file" >&2; exit 2; }
source scripts/setup.sh
CONFIG=${CONFIG:-configs/locomo_mc10.yaml}
mapfile -t DIRS < <(python - "$CONFIG" "$@" <<'PY'
import sys
from elasticmem.config import load_config
c = load_config(sys.argv[1], sys.argv[2:])
print(c.data.dir, c.warmup.output_dir, c.train.output_dir, c.eval.output_dir, c.memory.retrieval_map or "", sep="\n")
PY
)
DATA=${DIRS[0]} WARMUP=${DIRS[1]} TRAIN=${DIRS[2]} OUT=${DIRS[3]} MAP=${DIRS[4]}
python -m elasticmem.backbone fetch smollm2
if [ ! -f "$DATA/test.jsonl" ]; then
  python -m elasticmem.data.prepare locomo-mc10 --input "$LOCOMO" --out "$DATA"
fi
python build_bank.py --config "$CONFIG" "$@"
if [ -n "$MAP" ] && [ ! -f "$MAP" ]; then  # the learned query/key map of the preset's retrieval, on the training questions
  python -m elasticmem.warmup.retrieval_map --config "$CONFIG" "$@" --kind mlp --hidden 256 --out "$MAP"
fi
python -m elasticmem.warmup.reading --config "$CONFIG" "$@"
python train.py --config "$CONFIG" "$@"
python evaluate.py --config "$CONFIG" "$@"
mkdir -p "$OUT"
python -m elasticmem.eval.plots learning-curves "$WARMUP" --out "$OUT/warmup_curves.png"
python -m elasticmem.eval.plots learning-curves "$TRAIN" --out "$OUT/grpo_curves.png"
