#!/usr/bin/env bash
# Set up (first run only) and serve. Default: the embedded tiny DreamZero (configs/tiny.yaml)
# on ws://127.0.0.1:8000. Any ardiff-serve argument passes through, e.g.
#   bash scripts/serve.sh --host 0.0.0.0 --set engine.max_sessions=4
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/ardiff-serve "$@"
