#!/usr/bin/env bash
# The persona recipe on SmolLM2-135M-Instruct (configs/persona_recipe.yaml) over several seeds, with
# its controls and the reading ladder, in resumable pieces of at most PIECE_HOURS hours: run the same
# command again until it exits 0. A piece stops a stage with SIGTERM at its deadline; the warm-up and
# GRPO write a checkpoint and the next piece resumes them, evaluations resume from their predictions,
# the bank build from its shards. Every output is under OUT.
#
#   OUT=~/runs/persona bash scripts/persona_recipe.sh [key=value ...]      # exit 0: done; 75: run again
#   SEEDS="0 1 2" ARMS="elasticmem no_memory text" PIECE_HOURS=2 CAPS=16,32,48,64 MAP=1 OUT=... bash scripts/persona_recipe.sh
#   (PIECE_SECONDS overrides PIECE_HOURS; two instances with disjoint ARMS may run at once on one OUT)
#   PREPARE="locomo-mc10 --input PATH/locomo10.json" CONFIG=configs/locomo_mc10.yaml OUT=... bash scripts/persona_recipe.sh
#   (PREPARE: the arguments of `python -m elasticmem.data.prepare` for a real data set, --out OUT/data added;
#   unset, the preset's synthetic task. scripts/locomo_mc10.sh is this line.)
#
# OUT/map.safetensors: the retrieval map (MAP=1, the default: a residual MLP on the layer-mean query
# states and keys, trained once on the training questions; MAP=0: none). Per seed S, under OUT/sS/:
#   elasticmem/{warmup,train}  the recipe: the reading warm-up (with the policy's supervised start), then GRPO
#   no_memory/{warmup,train}   the same recipe with nothing retrieved (memory.top_z=0): the control
#   text/{warmup,train}        the same recipe with the memories as text (memory.injection=text)
#   ladder/                    the reading ladder of elasticmem/train/final on the test split (CAPS: the cost
#                              dial, on the first seed), with no_memory_trained/ and text_trained/ beside its rungs
# and OUT/summary.md: each seed's ladder, and the rungs and arms compared over seeds (pooled and by seed).
# Extra key=value arguments go to every stage (after the arms' own settings).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup.sh
CONFIG=${CONFIG:-configs/persona_recipe.yaml}
OUT=${OUT:-runs/persona_recipe}
SEEDS=${SEEDS:-0 1 2}
ARMS=${ARMS:-elasticmem no_memory text}
PIECE_HOURS=${PIECE_HOURS:-2}
CAPS=${CAPS:-16,32,48,64}
deadline=$(( $(date +%s) + ${PIECE_SECONDS:-$(( ${PIECE_HOURS%.*} * 3600 ))} ))
common=(data.dir="$OUT/data" bank.dir="$OUT/bank")

stage() {  # stage NAME DONE_PATH command...: skipped when DONE_PATH exists, else run until the deadline
  local name=$1 done=$2
  shift 2
  [ -e "$done" ] && return 0
  local left=$(( deadline - $(date +%s) ))
  if [ "$left" -le 120 ]; then
    echo "[recipe] this piece's time is up before $name: run the same command again" >&2
    exit 75
  fi
  echo "[recipe] $name ($(( left / 60 )) min left in this piece)" >&2
  local rc=0
  timeout --signal=TERM --kill-after=900 "$left" "$@" || rc=$?
  if [ "$rc" = 124 ]; then
    echo "[recipe] $name stopped at the end of this piece (checkpointed): run the same command again" >&2
    exit 75
  fi
  [ "$rc" = 0 ] || exit "$rc"
  [ -e "$done" ] || { echo "[recipe] $name ended without $done" >&2; exit 1; }
}

has() { case " $ARMS " in *" $1 "*) return 0 ;; esac; return 1; }

arm_args() {  # the config overrides of one arm
  case "$1" in
    elasticmem) ;;
    no_memory) echo "memory.top_z=0 warmup.retrieval_weight=0 warmup.budget_weight=0 train.loss.retrieval_weight=0 train.memory_token_cost=0" ;;
    text) echo "memory.injection=text warmup.budget_weight=0" ;;
    *) echo "unknown arm $1" >&2; exit 2 ;;
  esac
}

python -m elasticmem.backbone fetch smollm2
if [ -n "${PREPARE:-}" ]; then
  read -r -a prepare <<< "$PREPARE"
  stage data "$OUT/data/stats.json" python -m elasticmem.data.prepare "${prepare[@]}" --out "$OUT/data"
else
  stage data "$OUT/data/stats.json" python -m elasticmem.data.prepare synthetic --config "$CONFIG" "${common[@]}" "$@"
fi
stage bank "$OUT/bank/manifest.json" python build_bank.py --config "$CONFIG" "${common[@]}" "$@"
if [ "${MAP:-1}" = 1 ]; then  # the learned query/key map of the preset's retrieval, once for every seed
  stage "retrieval map" "$OUT/map.safetensors" python -m elasticmem.warmup.retrieval_map --config "$CONFIG" \
    "${common[@]}" "$@" --kind mlp --hidden 256 --out "$OUT/map.safetensors"
  common+=(memory.retrieval_map="$OUT/map.safetensors")
fi

first=${SEEDS%% *}
for s in $SEEDS; do
  run="$OUT/s$s"
  for arm in $ARMS; do
    read -r -a extra <<< "$(arm_args "$arm")"
    args=(--config "$CONFIG" "${common[@]}" seed="$s" warmup.output_dir="$run/$arm/warmup"
          train.output_dir="$run/$arm/train" train.init_from="$run/$arm/warmup/final" "$@" "${extra[@]}")
    stage "seed $s $arm: warm-up" "$run/$arm/warmup/final" python -m elasticmem.warmup.reading "${args[@]}"
    stage "seed $s $arm: GRPO" "$run/$arm/train/final" python train.py "${args[@]}"
  done
  if has elasticmem; then
    caps=()
    [ "$s" = "$first" ] && [ -n "$CAPS" ] && caps=(--caps "$CAPS")
    # the text rungs are read by the text arm's reader (trained on text), not the latent one
    text_ckpt=()
    if [ -e "$run/text/train/final" ]; then
      text_ckpt=(ladder.text_checkpoint="$run/text/train/final")
    else
      text_ckpt=(ladder.text_rungs=false)
      [ -e "$run/ladder/ladder.md" ] ||
        echo "[recipe] seed $s: no text arm ($run/text/train/final): the ladder runs its latent rungs only" >&2
    fi
    stage "seed $s: ladder" "$run/ladder/ladder.md" python -m elasticmem.apps.ladder --config "$CONFIG" \
      "${common[@]}" seed="$s" eval.checkpoint="$run/elasticmem/train/final" eval.output_dir="$run/ladder" \
      "${caps[@]}" "${text_ckpt[@]}" "$@"
  fi
  for arm in no_memory text; do
    has "$arm" || continue
    system=$([ "$arm" = text ] && echo text_rag || echo no_memory)
    stage "seed $s: $arm arm, evaluated" "$run/ladder/${arm}_trained/results.json" python evaluate.py --config "$CONFIG" \
      "${common[@]}" seed="$s" eval.system="$system" eval.checkpoint="$run/$arm/train/final" \
      eval.output_dir="$run/ladder/${arm}_trained" 'eval.variants={}' "$@"   # one system, whatever the preset lists
  done
done

has elasticmem || { echo "[recipe] done (no elasticmem arm: no ladder to summarise)" >&2; exit 0; }
ladders=()
for s in $SEEDS; do ladders+=("$OUT/s$s/ladder"); done
pairs="latent_uniform:latent_learned,no_memory:latent_learned,latent_oracle:latent_learned"
has no_memory && [ -e "$OUT/s$first/ladder/no_memory_trained/results.json" ] && pairs+=",no_memory_trained:latent_learned"
has text && [ -e "$OUT/s$first/ladder/text_trained/results.json" ] && pairs+=",text_trained:latent_learned"
python -m elasticmem.apps.ladder pool "${ladders[@]}" --pairs "$pairs" --out "$OUT/summary.md"
echo "[recipe] done: $OUT/summary.md" >&2
