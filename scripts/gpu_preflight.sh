#!/usr/bin/env bash
# Check this machine before `serve.sh --gpu` downloads anything (several GB of CUDA wheels): an NVIDIA driver
# with a GPU visible, a driver new enough for the pinned CUDA build, and free disk for .venv-gpu. Each failure
# is one line with the fix, exit 2; success prints one line naming the GPUs. Seconds, no network.
#
#   bash scripts/gpu_preflight.sh [VENV]        # VENV: where .venv-gpu goes (default .venv-gpu)
#   ARDIFF_SKIP_GPU_PREFLIGHT=1 ...             # build .venv-gpu on a machine without a GPU (a cluster's login node)
#
# The pins (scripts/constraints-gpu.txt): torch 2.14.0's PyPI wheel is the CUDA 13.0 build, and CUDA 13 needs an
# NVIDIA driver of the R580 branch or newer (NVIDIA's minor-version compatibility table). docs/deploy.md, "GPU install",
# says what to do on R535 / R550.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv-gpu}"
MIN_DRIVER=580      # CUDA 13.x: driver >= 580
NEED_GIB="${ARDIFF_GPU_VENV_GIB:-12}"  # .venv-gpu measured at 9.5 GiB (docs/deploy.md), plus room for the wheels while they unpack
skip="build .venv-gpu anyway with ARDIFF_SKIP_GPU_PREFLIGHT=1 (e.g. on a login node; the server checks the GPU at start-up)"

fail() { echo "[gpu-preflight] $1" >&2; exit 2; }

if [ "${ARDIFF_SKIP_GPU_PREFLIGHT:-0}" = "1" ]; then
  echo "[gpu-preflight] skipped (ARDIFF_SKIP_GPU_PREFLIGHT=1)"
  exit 0
fi

case "$(uname -s)-$(uname -m)" in
  Linux-x86_64|Linux-aarch64) ;;
  *) fail "--gpu needs Linux on x86_64 or aarch64 (vLLM's and torch's CUDA wheels); this is $(uname -s) $(uname -m): serve on the CPU without --gpu" ;;
esac

command -v nvidia-smi > /dev/null 2>&1 \
  || fail "no NVIDIA driver here (nvidia-smi not found): --gpu needs an NVIDIA GPU with driver R${MIN_DRIVER}+; serve on the CPU without --gpu, or $skip"

if ! gpus="$(nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader 2>&1)"; then
  fail "nvidia-smi failed: $(printf '%s' "$gpus" | head -n1); fix the driver (does 'nvidia-smi' work?), or $skip"
fi
gpus="$(printf '%s\n' "$gpus" | sed '/^[[:space:]]*$/d')"
[ -n "$gpus" ] || fail "nvidia-smi sees no GPU (CUDA_VISIBLE_DEVICES? a container without --gpus?); or $skip"

driver="$(printf '%s\n' "$gpus" | head -n1 | awk -F', *' '{print $3}')"
major="${driver%%.*}"
if ! [[ "$major" =~ ^[0-9]+$ ]]; then
  fail "cannot read the driver version from nvidia-smi ('$driver'); or $skip"
fi
if [ "$major" -lt "$MIN_DRIVER" ]; then
  fail "NVIDIA driver $driver is older than R${MIN_DRIVER}, which the pinned torch 2.14.0 (CUDA 13.0) needs: upgrade to R${MIN_DRIVER} (the current long-term branch), or see docs/deploy.md 'Older drivers' for R535 / R550"
fi

if [ ! -x "$venv/bin/python" ]; then
  parent="$(dirname "$venv")"
  mkdir -p "$parent"
  free_kib="$(df -Pk "$parent" | awk 'NR==2 {print $4}')"
  free_gib=$(( free_kib / 1024 / 1024 ))
  if [ "$free_gib" -lt "$NEED_GIB" ]; then
    fail "$free_gib GiB free under $(cd "$parent" && pwd); .venv-gpu needs about $NEED_GIB GiB: free some disk, or put it elsewhere with ARDIFF_VENV=/big/disk/.venv-gpu"
  fi
fi

count="$(printf '%s\n' "$gpus" | wc -l | tr -d ' ')"
first="$(printf '%s\n' "$gpus" | head -n1 | awk -F', *' '{print $2 ", " $4}')"
echo "[gpu-preflight] $count GPU(s), driver $driver (>= R${MIN_DRIVER}): $first$([ "$count" -gt 1 ] && echo ", ...")"
