#!/usr/bin/env bash
# Create the project's virtual environment (default .venv) and install elasticmem into it.
#   bash scripts/setup.sh            # sourced by scripts/quickstart.sh and scripts/test.sh
# Torch is installed first and pinned, so no multi-GB CUDA build is pulled on a CPU machine.
# Env: ELASTICMEM_VENV (venv path), PYTHON (interpreter for the venv), TORCH_VERSION,
#      ELASTICMEM_TORCH_INDEX (e.g. https://download.pytorch.org/whl/cpu on CPU-only machines
#      whose default index only has CUDA builds), EXTRAS (default "dev").
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV=${ELASTICMEM_VENV:-.venv}
PYTHON=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV" >&2
  "$PYTHON" -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
if ! python -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "[setup] CUDA found: installing torch==$TORCH_VERSION" >&2
    pip install -q "torch==$TORCH_VERSION"
  else
    echo "[setup] no CUDA: installing CPU torch==$TORCH_VERSION" >&2
    pip install -q "torch==$TORCH_VERSION" ${ELASTICMEM_TORCH_INDEX:+--index-url "$ELASTICMEM_TORCH_INDEX"}
  fi
fi
# pip takes ~20 s even when everything is installed, and every script sources this: skip it when
# this checkout was installed into this venv, from the same pyproject.toml, with at least these
# extras (an editable install follows code changes by itself).
_stamp="$VENV/.elasticmem-installed"
_key="$(pwd) $({ sha256sum pyproject.toml 2>/dev/null || shasum -a 256 pyproject.toml; } | cut -d' ' -f1)"  # shasum: macOS
_installed() {
  [ -f "$_stamp" ] && [ "$(head -1 "$_stamp")" = "$_key" ] || return 1
  local have=",$(sed -n 2p "$_stamp")," e want
  IFS=, read -r -a want <<< "${EXTRAS:-dev}"
  for e in "${want[@]}"; do case "$have" in *",$e,"*) ;; *) return 1 ;; esac; done
  python -c "import elasticmem" >/dev/null 2>&1
}
if _installed; then
  echo "[setup] elasticmem[${EXTRAS:-dev}] already installed in $VENV" >&2
else
  echo "[setup] installing elasticmem[${EXTRAS:-dev}]" >&2
  rm -f "$_stamp"
  pip install -q -e ".[${EXTRAS:-dev}]"
  printf '%s\n%s\n' "$_key" "${EXTRAS:-dev}" > "$_stamp"
fi
unset -f _installed
unset _stamp _key
