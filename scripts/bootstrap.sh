#!/usr/bin/env bash
# Create .venv and install ardiff-server with the extras the tests exercise (dev: pytest, the
# openpi client, ruff; viz: PyAV + matplotlib for recordings and ardiff-client; ray: Ray Serve).
# Idempotent and offline-friendly: torch comes first, pinned to the CPU build these machines carry
# (a bare "torch" requirement would otherwise pull a multi-GB CUDA build); the rest from PyPI.
# ARDIFF_EXTRAS=dev skips the optional ones (their tests then skip, saying why).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VENV="${ARDIFF_VENV:-.venv}"
TORCH_SPEC="${ARDIFF_TORCH_SPEC:-torch==2.13.0}"
EXTRAS="${ARDIFF_EXTRAS:-dev,viz,ray}"

if [ ! -x "$VENV/bin/python" ]; then
  echo "[bootstrap] creating $VENV with $($PYTHON --version 2>&1)"
  "$PYTHON" -m venv "$VENV"
fi
stamp="$VENV/.ardiff-installed"
want="$(cat pyproject.toml | sha256sum | cut -c1-16) $TORCH_SPEC $EXTRAS"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "[bootstrap] installing $TORCH_SPEC and ardiff-server[$EXTRAS] into $VENV"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "$TORCH_SPEC"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -e ".[$EXTRAS]"
  echo "$want" > "$stamp"
fi
