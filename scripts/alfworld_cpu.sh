#!/usr/bin/env bash
# ALFWorld on CPU with SmolLM2, without the ALFWorld data: games generated in the kitchen of the
# sample trial (../shared/data/alfworld_sample_game), the expert's trajectories split 80/20 into
# skill cards and imitation steps, imitation GRPO, then episodes in the real engine on held-out
# generated games for ElasticMem, no memory and text RAG with the cards as text
# (configs/alfworld_cpu.yaml). About 1.5 hours on 2 CPU cores (a GRPO step 3-5 min, an episode to
# the 30-step limit ~2 min, 3.5 with text RAG; N_VALID games are played).
# Resumable: run it again after an interruption; finished stages are kept, training and
# evaluation resume.
#
#   bash scripts/alfworld_cpu.sh [key=value ...]          # SAMPLE=path/to/trial to use another scene
#
# Output: runs/eval/alfworld_cpu/comparison.md (success rate, n, 95 % interval, #Tok per episode,
# paired tests), per-episode traces in each system's predictions.jsonl, the GRPO curve beside it,
# and steps/comparison.md: step accuracy on the held-out imitation steps (HELDOUT, default 25 %).
# The cards are the deterministic fallback cards (SmolLM2 does not write usable ones,
# docs/alfworld.md); CARDS_BACKEND=openai CARDS_MODEL=... CARDS_API=... to use a served LLM.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
EXTRAS=${EXTRAS:-dev,agent} source scripts/setup.sh
CONFIG=${CONFIG:-configs/alfworld_cpu.yaml}
SAMPLE=${SAMPLE:-../shared/data/alfworld_sample_game}
N_TRAIN=${N_TRAIN:-80} N_VALID=${N_VALID:-6}
mapfile -t DIRS < <(python - "$CONFIG" "$@" <<'PY'
import sys
from elasticmem.config import load_config
c = load_config(sys.argv[1], sys.argv[2:])
print(c.agent.games_dir, c.data.dir, c.train.output_dir, c.eval.output_dir, sep="\n")
PY
)
GAMES=${DIRS[0]} DATA=${DIRS[1]} TRAIN=${DIRS[2]} OUT=${DIRS[3]}
WORK=${WORK:-runs/alfworld/cpu}
python -m elasticmem.backbone fetch smollm2
# a finished generation leaves a marker; an interrupted one is generated again from scratch
for split in train valid; do
  if [ ! -f "$GAMES/$split.done" ]; then
    rm -rf "${GAMES:?}/$split"
    n=$N_TRAIN seed=0 exclude=()
    if [ "$split" = valid ]; then n=$N_VALID seed=1 exclude=(--exclude "$GAMES/train"); fi
    python -m elasticmem.agent.generate_games "$SAMPLE" --out "$GAMES/$split" --n "$n" --seed "$seed" "${exclude[@]}"
    touch "$GAMES/$split.done"
  fi
done
python -m elasticmem.agent.trajectories collect --games "$GAMES/train" --out "$WORK/trajectories.jsonl" --processes 2
python -m elasticmem.agent.trajectories split "$WORK/trajectories.jsonl" --out "$WORK/pools"
python -m elasticmem.agent.skill_cards "$WORK/trajectories.jsonl" --ids "$WORK/pools/memory_ids.txt" \
  --out "$WORK/cards.jsonl" --backend "${CARDS_BACKEND:-fallback}" ${CARDS_MODEL:+--model "$CARDS_MODEL"} \
  ${CARDS_API:+--api-base "$CARDS_API"}
if [ ! -f "$DATA/train.jsonl" ]; then
  python -m elasticmem.agent.imitation --trajectories "$WORK/trajectories.jsonl" --pools "$WORK/pools" \
    --cards "$WORK/cards.jsonl" --out "$DATA" --heldout "${HELDOUT:-0.25}"
fi
python build_bank.py --config "$CONFIG" "$@"
python train.py --config "$CONFIG" "$@"
LAUNCH=(accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no --dynamo_backend no)
export ACCELERATE_USE_CPU=1
# held-out imitation steps (step accuracy), the trained model against the untrained one and the baselines
"${LAUNCH[@]}" evaluate.py --config "$CONFIG" eval.task=qa eval.split=val eval.output_dir="$OUT/steps" \
  'eval.variants={elasticmem: [], untrained: [eval.checkpoint=null], no_memory: [eval.system=no_memory, eval.checkpoint=null], text_rag: [eval.system=text_rag, eval.checkpoint=null]}' "$@"
# episodes on the held-out games (the preset's eval.variants)
"${LAUNCH[@]}" evaluate.py --config "$CONFIG" "$@"
python -m elasticmem.eval.plots learning-curves "$TRAIN" --out "$OUT/grpo_curves.png"
