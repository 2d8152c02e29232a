#!/usr/bin/env bash
# Download the wheels scripts/gpu_check.py needs on the bare GPU image into .device_wheels/
# (git-ignored), for the device tool's `carry`. Run it here, where pip reaches PyPI.
#
# The device image (Python 3.12, torch 2.11 + CUDA 13, transformers, tokenizers, safetensors,
# numpy, regex, pyyaml, huggingface-hub, pillow, requests, msgpack, prometheus-client) lacks
# what the torch-side import chain (policies/, kv/, ardiff_server.engine.core, ardiff_server.config)
# adds: diffusers (the Wan VAE and the UniPC scheduler), pydantic (configs) and ftfy (prompt
# cleaning), with their own needs. No torch, no vLLM: the total stays near 8 MiB.
#
# Versions are the ones this repository's venv runs (so the device runs what CI tested), with
# pydantic-core pinned to what that pydantic requires. gpu_check.py installs them at start
# (pip --no-index --no-deps --target) only when a module is missing.
#
#   bash scripts/fetch_device_wheels.sh [DEST]     # default DEST: .device_wheels
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-.device_wheels}
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3

# distribution -> version in the local venv (fallback: the version last checked here)
version() {
  "$PY" - "$1" "$2" <<'EOF'
import importlib.metadata as m, sys
try:
    print(m.version(sys.argv[1]))
except m.PackageNotFoundError:
    print(sys.argv[2])
EOF
}

PACKAGES=(
  "diffusers $(version diffusers 0.42.1)"
  "pydantic $(version pydantic 2.14.4)"
  "pydantic-core $(version pydantic-core 2.50.5)"
  "annotated-types $(version annotated-types 0.8.0)"
  "typing-inspection $(version typing-inspection 0.4.5)"
  "typing-extensions $(version typing-extensions 4.16.0)"
  "ftfy $(version ftfy 6.3.1)"
  "wcwidth $(version wcwidth 0.9.4)"
)

mkdir -p "$DEST"
rm -f "$DEST"/*.whl  # one version of each: two would stop the install
specs=()
for entry in "${PACKAGES[@]}"; do
  read -r name ver <<<"$entry"
  specs+=("$name==$ver")
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
  -d "$DEST" "${specs[@]}"

echo "wheels in $DEST (carry this folder with the device run):"
total=0
for wheel in "$DEST"/*.whl; do
  size=$(stat -c %s "$wheel")
  total=$((total + size))
  printf '  %-70s %8.1f KiB\n' "$(basename "$wheel")" "$(echo "$size / 1024" | bc -l)"
done
printf '  total %.2f MiB\n' "$(echo "$total / 1048576" | bc -l)"
