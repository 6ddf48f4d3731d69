#!/usr/bin/env bash
# The CPU training recipe on SmolLM2 for the synthetic persona task, with its controls and
# ablations, each trained with the same recipe and budget, then compared on the test split.
# Resumable: run it again after an interruption and finished stages are skipped (warm-ups with
# a final/ folder), trainings resume from their last checkpoint, evaluations from their
# predictions.
#
#   bash scripts/recipe_synthetic.sh                       # every arm below
#   ARMS="elasticmem no_memory" bash scripts/recipe_synthetic.sh [key=value ...]
#
# Arms (each a folder under $RUN):
#   elasticmem    the reading warm-up, then GRPO from it                          (the recipe)
#   no_memory     the same recipe with nothing retrieved (train.use_memory=false)
#   text          the same recipe with memory.injection=text (text memory + GRPO control)
#   grpo_only     GRPO alone, as long as the recipe's GRPO stage                 (ablation)
#   letter        the warm-up teaching "(b)" instead of "amber (b)"               (ablation)
#   no_align      the warm-up without its token-alignment steps                   (ablation)
#   reconstruct   60 reconstruction steps (xRAG stage 1) before the warm-up      (candidate)
# plus, at evaluation, the recipe's warm-up alone (no GRPO; ablation) and the untrained
# reasoner without memory. Output: $RUN/eval/comparison.md (accuracy, n, 95 % interval, #Tok,
# paired tests against ElasticMem).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup.sh
CONFIG=${CONFIG:-configs/persona_recipe.yaml}
RUN=${RUN:-runs/recipe}
ARMS=${ARMS:-elasticmem no_memory text grpo_only letter no_align reconstruct}
python -m elasticmem.backbone fetch smollm2
python -m elasticmem.data.prepare synthetic --config "$CONFIG" "$@"
python build_bank.py --config "$CONFIG" "$@"

arm_args() {  # the config overrides of one arm
  case "$1" in
    elasticmem|grpo_only) ;;
    letter) echo "warmup.target=letter" ;;
    no_align) echo "warmup.align_steps=0" ;;
    reconstruct) echo "warmup.reconstruct_steps=60" ;;
    no_memory) echo "train.use_memory=false warmup.retrieval_weight=0 train.loss.retrieval_weight=0 train.memory_token_cost=0" ;;
    text) echo "memory.injection=text" ;;
    *) echo "unknown arm $1" >&2; exit 2 ;;
  esac
}

variants=""
for arm in $ARMS; do
  read -r -a extra <<< "$(arm_args "$arm")"
  if [ "$arm" = grpo_only ]; then
    init=train.init_from=null
  else
    # the arm's own settings last: they win over the command line's
    python -m elasticmem.warmup.reading --config "$CONFIG" "$@" warmup.output_dir="$RUN/$arm/warmup" \
      "${extra[@]}"
    init=train.init_from="$RUN/$arm/warmup/final"
  fi
  python train.py --config "$CONFIG" "$@" train.output_dir="$RUN/$arm/train" "$init" "${extra[@]}"
  case "$arm" in
    no_memory) system=no_memory ;;
    text) system=text_rag ;;
    *) system=elasticmem ;;
  esac
  variants+="$arm: [eval.system=$system, eval.checkpoint=$RUN/$arm/train/final], "
  [ "$arm" = elasticmem ] && variants+="warmup_only: [eval.checkpoint=$RUN/elasticmem/warmup/final], "
done
variants+="untrained_no_memory: [eval.system=no_memory, eval.checkpoint=null]"
python evaluate.py --config "$CONFIG" eval.output_dir="$RUN/eval" "eval.variants={$variants}" "$@"
