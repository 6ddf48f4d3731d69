#!/usr/bin/env bash
# The baselines comparison (docs/baselines.md, "The comparison protocol") on the synthetic persona
# task of configs/quickstart.yaml (208 test questions) with SmolLM2: ElasticMem and MemGen each
# trained with several seeds on the same data and bank, then every system evaluated on the same
# test questions, each system in its own process, then one comparison.md (seed 0 of the trained
# systems, paired McNemar against ElasticMem) and one seeds.md (mean over seeds, t interval).
#
#   bash scripts/compare_baselines.sh                        # everything, 2 jobs at a time
#   SYSTEMS="elasticmem memgen text_rag no_memory" SEEDS="0 1 2" JOBS=2 bash scripts/compare_baselines.sh
#   bash scripts/compare_baselines.sh key=value ...         # overrides go to every step
#
# Environment: OUT (runs/compare), CONFIG (configs/quickstart.yaml), SEEDS ("0 1 2"), JOBS (2:
# processes at once, each with one torch thread), SYSTEMS (the systems to evaluate: elasticmem,
# elasticmem_no_memory, elasticmem_text, memgen, text_rag, no_memory, mem0, langmem, amem),
# MEMGEN_SFT (1), MEMGEN_STEPS (28), MEMGEN_BATCH (2). elasticmem_no_memory is the memory ablation:
# each seed's ElasticMem checkpoint (its LoRA) answering with nothing retrieved
# (eval.system=no_memory), so ElasticMem's gain over it is its memory's, and its gain over
# no_memory is the training's. elasticmem_text is the reading ablation: the same checkpoint, so
# the same retrieved chunks, read as text (eval.system=text_rag) instead of latent tokens.
# Training budget: ElasticMem trains as the preset does (warm-up 24 steps x 8 teacher-forced
# questions, then 4 GRPO steps x 2 questions x G = 4): 28 optimizer steps. MemGen (MEMGEN_SFT=1)
# gets the same supervision and steps with its native objectives: the same warm-up steps as its
# weaver's SFT (train.system=memgen; no projector-only alignment steps, MemGen has no projector),
# then the same GRPO steps from it. MEMGEN_SFT=0: MemGen from scratch with GRPO alone, MEMGEN_STEPS
# steps of MEMGEN_BATCH questions x G = 4 at MEMGEN_LR (1e-3). MemGen's reasoner is frozen, so it
# retrieves with the frozen model's query state (memory.retrieval=frozen) and has no retrieval loss.
# Mem0 and LangMem: TEXTMEM_TOKENS (256) new tokens per library call (cut-offs are counted).
# Mem0, LangMem and A-Mem read what they retrieve through ElasticMem's prompt and decoder, as
# text_rag reads its chunks (answer_prompt=shared), so every system differs only in its memory.
# Every step skips what its output folder already holds, so a rerun resumes; logs in $OUT/logs.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-runs/compare}
CONFIG=${CONFIG:-configs/quickstart.yaml}
SEEDS=${SEEDS:-0 1 2}
JOBS=${JOBS:-2}
ALL_SYSTEMS="elasticmem elasticmem_no_memory elasticmem_text memgen text_rag no_memory mem0 langmem amem"
SYSTEMS=${SYSTEMS:-$ALL_SYSTEMS}
MEMGEN_STEPS=${MEMGEN_STEPS:-28}
MEMGEN_BATCH=${MEMGEN_BATCH:-2}
MEMGEN_SFT=${MEMGEN_SFT:-1}
MEMGEN=(memory.retrieval=frozen train.loss.retrieval_weight=0 train.system=memgen)
TEXTMEM_TOKENS=${TEXTMEM_TOKENS:-256}
export OMP_NUM_THREADS=1
. "${ELASTICMEM_VENV:-.venv}/bin/activate"
q() { printf '%q ' "$@"; }  # words for the job lines below, which bash -c reads again
mkdir -p "$OUT/logs"
COMMON=(data.dir="$OUT/data" bank.dir="$OUT/bank" "$@")

has() { [[ " $SYSTEMS " == *" $1 "* ]]; }
has_any() { local s; for s; do has "$s" && return 0; done; return 1; }
log() { echo "[compare $(date +%H:%M:%S)] $*" >&2; }
pool() {  # run each line of stdin as a bash command, at most $JOBS at once; fail if any failed
  local cmd failed=0 pid
  reap() { pid=; wait -n -p pid; local rc=$?; [ -n "${pid:-}" ] || return 1; [ "$rc" -eq 0 ] || failed=1; }
  while IFS= read -r cmd; do
    while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do reap || break; done
    log "start: $cmd"
    bash -c "$cmd" &
  done
  while reap; do :; done  # every job's exit status, once each (bash >= 5.1: wait -p)
  return $failed
}

# 1. data and bank, once (seed 0): every system and seed sees the same questions and memories
if [ ! -f "$OUT/data/test.jsonl" ]; then
  python -m elasticmem.data.prepare synthetic --config "$CONFIG" "${COMMON[@]}" >"$OUT/logs/prepare.log" 2>&1
fi
if [ ! -f "$OUT/bank/manifest.json" ]; then
  python build_bank.py --config "$CONFIG" "${COMMON[@]}" >"$OUT/logs/bank.log" 2>&1
fi

# 2. training: every (system, seed) its own process
{
  for s in $SEEDS; do
    d="$OUT/s$s"
    if has_any elasticmem elasticmem_no_memory elasticmem_text && [ ! -f "$d/elasticmem/final/elasticmem_config.json" ]; then
      echo "python -m elasticmem.warmup.reading --config $CONFIG $(q "${COMMON[@]}") seed=$s warmup.output_dir=$d/warmup \
>$OUT/logs/warmup_s$s.log 2>&1 && python train.py --config $CONFIG $(q "${COMMON[@]}") seed=$s \
train.init_from=$d/warmup/final train.output_dir=$d/elasticmem >$OUT/logs/elasticmem_s$s.log 2>&1"
    fi
    if has memgen && [ ! -f "$d/memgen/final/elasticmem_config.json" ]; then
      train="python train.py --config $CONFIG $(q "${COMMON[@]}") seed=$s ${MEMGEN[*]} train.output_dir=$d/memgen"
      if [ "$MEMGEN_SFT" = 1 ]; then
        echo "python -m elasticmem.warmup.reading --config $CONFIG $(q "${COMMON[@]}") seed=$s ${MEMGEN[*]} \
warmup.align_steps=0 warmup.retrieval_weight=0 warmup.output_dir=$d/memgen_sft >$OUT/logs/memgen_sft_s$s.log 2>&1 \
&& $train train.init_from=$d/memgen_sft/final >$OUT/logs/memgen_s$s.log 2>&1"
      else
        echo "$train train.init_from=null train.lr=${MEMGEN_LR:-1e-3} train.max_steps=$MEMGEN_STEPS \
train.batch_size=$MEMGEN_BATCH train.save_every=5 >$OUT/logs/memgen_s$s.log 2>&1"
      fi
    fi
  done
} | pool

# 3. evaluation: each system (and trained seed) in its own folder, with its own process
ev() {  # name, overrides...
  local name=$1; shift
  [ -f "$OUT/eval/$name/$name/results.json" ] && return 0
  echo "python evaluate.py --config $CONFIG $(q "${COMMON[@]}") eval.output_dir=$OUT/eval/$name \
'eval.variants={$name: []}' $(q "$@")>$OUT/logs/eval_$name.log 2>&1"
}
{
  for s in $SEEDS; do
    has elasticmem && ev "elasticmem@$s" eval.system=elasticmem eval.checkpoint="$OUT/s$s/elasticmem/final"
    has elasticmem_no_memory && ev "elasticmem_no_memory@$s" eval.system=no_memory \
      eval.checkpoint="$OUT/s$s/elasticmem/final"
    has elasticmem_text && ev "elasticmem_text@$s" eval.system=text_rag eval.checkpoint="$OUT/s$s/elasticmem/final"
    has memgen && ev "memgen@$s" eval.system=memgen "${MEMGEN[0]}" eval.checkpoint="$OUT/s$s/memgen/final"
  done
  for sys in text_rag no_memory; do
    has "$sys" && ev "$sys" eval.system="$sys" eval.checkpoint=null
  done
  # A-Mem builds every conversation's memory in lockstep (one batch of all questions: its LLM
  # calls batch across conversations), into a store a rerun resumes
  has amem && ev amem eval.system=amem eval.checkpoint=null amem.answer_prompt=shared \
    amem.store_dir="$OUT/amem_store" eval.batch_size=100000
  for sys in mem0 langmem; do
    has "$sys" && ev "$sys" eval.system="$sys" eval.checkpoint=null textmem.max_new_tokens="$TEXTMEM_TOKENS"
  done
  true  # the status of the last 'has' is not the block's
} | pool

# 4. the reports: comparison.md of the first seed, seeds.md over all seeds
first=${SEEDS%% *}
names=() files=() groups=()
for sys in $ALL_SYSTEMS; do
  has "$sys" || continue
  case $sys in
    elasticmem|elasticmem_no_memory|elasticmem_text|memgen)
      names+=("$sys@$first"); files+=("$OUT/eval/$sys@$first/$sys@$first/results.json")
      g=""; for s in $SEEDS; do g="$g,$OUT/eval/$sys@$s/$sys@$s/results.json"; done
      groups+=("$sys=${g#,}") ;;
    *)  # untrained: deterministic, one run stands for every seed (paired with each seed's run)
      names+=("$sys"); files+=("$OUT/eval/$sys/$sys/results.json")
      g=""; for s in $SEEDS; do g="$g,$OUT/eval/$sys/$sys/results.json"; done
      groups+=("$sys=${g#,}") ;;
  esac
done
python -m elasticmem.eval.report compare "${files[@]}" --names "${names[@]}" --out "$OUT/comparison.md"
python -m elasticmem.eval.report seeds "${groups[@]}" --out "$OUT/seeds.md"
log "done: $OUT/comparison.md, $OUT/seeds.md"
