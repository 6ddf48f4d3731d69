#!/usr/bin/env bash
# LoCoMo MC-10 with the recipe that makes SmolLM2 read its memories (configs/locomo_mc10.yaml: per-layer
# key/value content, layer-mean keys and their learned map, the policy's supervised start from LoCoMo's
# evidence labels, then GRPO), its controls trained the same way (no memory; text memory, whose reader
# also reads the ladder's text top-k rungs) and the reading ladder on the 314 test questions, in
# resumable pieces of at most PIECE_HOURS hours: scripts/persona_recipe.sh with LoCoMo as its data
# (every variable of that script applies). Then the full context (the latest history that fits
# memory.recent_max_tokens) as a reference, read by the untrained reasoner.
#
#   LOCOMO=PATH/locomo10.json OUT=~/runs/locomo SEEDS=0 bash scripts/locomo_mc10.sh [key=value ...]
#   # exit 0: done; 75: this piece's time is up, run the same command again
#
# Outputs under OUT (default runs/locomo_mc10): data/, bank/, map.safetensors, sS/{elasticmem,no_memory,
# text}/{warmup,train}, sS/ladder/ (ladder.md: rungs, per question type in each rung's report.md),
# summary.md, full_context/. Download locomo10.json yourself (snap-research/LoCoMo, data/locomo10.json).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
: "${LOCOMO:?set LOCOMO to locomo10.json (snap-research/LoCoMo, data/locomo10.json)}"
[ -f "$LOCOMO" ] || { echo "LOCOMO=$LOCOMO: no such file" >&2; exit 2; }
case "$LOCOMO" in *" "*) echo "LOCOMO=$LOCOMO: a path without spaces, please" >&2; exit 2 ;; esac
export CONFIG=${CONFIG:-configs/locomo_mc10.yaml}
export OUT=${OUT:-runs/locomo_mc10}
export SEEDS=${SEEDS:-0}                # seed 0 first (issue 54); seeds 1 and 2 once it is above the no-memory arm
export CAPS=${CAPS:-32,64,128,256}      # the cost dial's token caps a question (B_max = 128 a memory)
export PREPARE="locomo-mc10 --input $LOCOMO"
bash scripts/persona_recipe.sh "$@"
source scripts/setup.sh >/dev/null 2>&1
args=(--config "$CONFIG" data.dir="$OUT/data" bank.dir="$OUT/bank" "$@")
[ -e "$OUT/full_context/results.json" ] ||
  python evaluate.py "${args[@]}" eval.system=full_context eval.checkpoint=null eval.output_dir="$OUT/full_context" \
    'eval.variants={}'
echo "[locomo] done: $OUT/summary.md, $OUT/full_context/report.md" >&2
