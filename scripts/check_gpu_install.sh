#!/usr/bin/env bash
# Resolve the GPU install with pip's resolver without installing anything (pip install --dry-run --report):
# what `bash scripts/serve.sh --gpu` would put into a fresh .venv-gpu. Needs PyPI; takes minutes (vLLM's tree).
# Prints the versions that matter and the package count; docs/deploy.md ("GPU install") records the last run.
#
#   bash scripts/check_gpu_install.sh            # with python3 (the Python the venv would be made with)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
report="$(mktemp)"
trap 'rm -f "$report"' EXIT
torch_spec="$(grep -E '^torch==' scripts/constraints-gpu.txt)"
"$PYTHON" -m pip install --dry-run --quiet --disable-pip-version-check --ignore-installed --report "$report" \
  -c scripts/constraints-gpu.txt "$torch_spec" ".[gpu]"
"$PYTHON" - "$report" <<'PY'
import json, platform, sys

report = json.load(open(sys.argv[1]))
versions = {item["metadata"]["name"].lower().replace("_", "-"): item["metadata"]["version"] for item in report["install"]}
shown = ["torch", "vllm", "triton", "flashinfer-python", "nvidia-cuda-runtime", "nvidia-cudnn-cu13", "numpy", "transformers", "diffusers",
         "huggingface-hub", "ardiff-server"]
print(f"resolved for Python {platform.python_version()} on {platform.system()} {platform.machine()}: {len(versions)} packages")
for name in shown:
    print(f"  {name}=={versions[name]}" if name in versions else f"  {name}: not in the resolution")
pins = dict(line.split("==") for line in open("scripts/constraints-gpu.txt") if "==" in line and not line.startswith("#"))
wrong = {name: (pin.strip(), versions.get(name)) for name, pin in pins.items() if versions.get(name) != pin.strip()}
if wrong:
    sys.exit(f"the resolution moved pinned packages: {wrong}")
print("the pins of scripts/constraints-gpu.txt hold")
PY
