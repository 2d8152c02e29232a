#!/usr/bin/env bash
# Set up (first run only) and run the whole test suite in .venv (CPU torch, the dev, viz and ray extras).
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
ARDIFF_EXTRAS="${ARDIFF_EXTRAS-dev,viz,ray}" bash scripts/bootstrap.sh
exec "${ARDIFF_VENV:-.venv}/bin/python" -m pytest "$@"
