#!/usr/bin/env bash
# Set up (first run only) and run the whole test suite in .venv (CPU torch, the dev, viz and ray extras).
# Extra arguments go to pytest. The tests are spread over ARDIFF_TEST_WORKERS processes (default: 2, one per core of
# CI's machine; 0 runs them in this process), a whole file to a worker (pytest-xdist's loadfile: a file's module
# fixtures, e.g. a server it starts once, are built once). About 14 minutes on 2 cores; a `-n` of your own wins.
set -euo pipefail
cd "$(dirname "$0")/.."
ARDIFF_EXTRAS="${ARDIFF_EXTRAS-dev,viz,ray}" bash scripts/bootstrap.sh
workers="${ARDIFF_TEST_WORKERS:-2}"
spread=(-n "$workers" --dist loadfile)
for arg in "$@"; do
  case "$arg" in -n|-n*|--numprocesses|--numprocesses=*|no:xdist) spread=() ;; esac
done
if [ "${#spread[@]}" -gt 0 ]; then
  echo "[test] $(date -u +%FT%TZ): pytest on $workers worker(s); the whole suite takes about 14 minutes on 2 cores"
fi
start=$(date +%s)
status=0
"${ARDIFF_VENV:-.venv}/bin/python" -m pytest "${spread[@]}" "$@" || status=$?
echo "[test] pytest exited $status after $(( $(date +%s) - start )) s"
exit "$status"
