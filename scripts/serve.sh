#!/usr/bin/env bash
# Set up (first run only) and serve. Default: the embedded tiny DreamZero (configs/tiny.yaml) on
# ws://127.0.0.1:8000, from .venv with the CPU build of torch and only what serving needs. Any
# ardiff-serve argument passes through, e.g.
#   bash scripts/serve.sh --host 0.0.0.0 --set engine.max_sessions=4
#   bash scripts/serve.sh --gpu --config dreamzero_droid     # .venv-gpu: CUDA torch + vLLM pinned together
#     (--gpu first runs scripts/gpu_preflight.sh: a GPU, driver R580+, free disk; before anything downloads)
# --record adds the viz extra (PyAV, matplotlib), --ray the ray extra (Ray Serve).
set -euo pipefail
cd "$(dirname "$0")/.."
args=()
extras="${ARDIFF_EXTRAS-}"
gpu=0
for arg in "$@"; do
  case "$arg" in
    --gpu) gpu=1; continue ;;
    --record|--record=*) extras="${extras:+$extras,}viz" ;;
    --ray) extras="${extras:+$extras,}ray" ;;
  esac
  args+=("$arg")
done
venv=.venv
[ "$gpu" = 1 ] && venv="${ARDIFF_VENV:-.venv-gpu}"
[ "$gpu" = 0 ] && venv="${ARDIFF_VENV:-.venv}"
# --gpu: check the GPU, its driver and the disk before several GB of CUDA wheels download (each failure one line)
[ "$gpu" = 1 ] && bash scripts/gpu_preflight.sh "$venv"
ARDIFF_GPU="$gpu" ARDIFF_EXTRAS="$extras" bash scripts/bootstrap.sh
exec "$venv/bin/ardiff-serve" "${args[@]}"
