#!/usr/bin/env bash
# Create a virtual environment and install ardiff-server with the extras asked for. Idempotent: a venv
# that already has them (and this pyproject.toml and torch) is left alone; asking for more adds them.
#
#   bash scripts/bootstrap.sh                        # .venv, CPU torch, the extras the tests use (dev,viz,ray): CI, test.sh
#   ARDIFF_EXTRAS= bash scripts/bootstrap.sh         # .venv, only what serving needs (serve.sh)
#   ARDIFF_GPU=1 bash scripts/bootstrap.sh           # .venv-gpu: CUDA torch + vLLM pinned together (scripts/constraints-gpu.txt)
#
# CPU: torch comes first, pinned to the CPU build these machines carry (a bare "torch" requirement would pull a
# multi-GB CUDA build); the rest from PyPI. GPU: torch and vLLM at the versions in scripts/constraints-gpu.txt,
# every install constrained by that file, in its own venv. A venv whose torch differs from the one asked for is
# refused, never silently replaced. ARDIFF_VENV, ARDIFF_TORCH_SPEC and PYTHON override the defaults.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
CONSTRAINTS=()
if [ "${ARDIFF_GPU:-0}" = "1" ]; then
  VENV="${ARDIFF_VENV:-.venv-gpu}"
  TORCH_SPEC="${ARDIFF_TORCH_SPEC:-$(grep -E '^torch==' scripts/constraints-gpu.txt)}"
  EXTRAS="${ARDIFF_EXTRAS-}"
  EXTRAS="gpu${EXTRAS:+,$EXTRAS}"
  CONSTRAINTS=(-c scripts/constraints-gpu.txt)
else
  VENV="${ARDIFF_VENV:-.venv}"
  TORCH_SPEC="${ARDIFF_TORCH_SPEC:-torch==2.13.0}"
  EXTRAS="${ARDIFF_EXTRAS-dev,viz,ray}"
fi
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)

if [ ! -x "$VENV/bin/python" ]; then
  echo "[bootstrap] creating $VENV with $($PYTHON --version 2>&1)"
  "$PYTHON" -m venv "$VENV"
fi

# The stamp: "<pyproject hash> <torch spec> <installed extras>"; extras accumulate (serve.sh after test.sh installs nothing).
stamp="$VENV/.ardiff-installed"
base="$(sha256sum pyproject.toml | cut -c1-16) $TORCH_SPEC"
have=""
if [ -f "$stamp" ]; then
  read -r stamp_hash stamp_torch stamp_extras < "$stamp" || true
  [ "$stamp_hash $stamp_torch" = "$base" ] && have="${stamp_extras:-}"
fi
want="$(printf '%s\n' ${have//,/ } ${EXTRAS//,/ } | sed '/^$/d' | sort -u | paste -sd, -)"
if [ -f "$stamp" ] && [ "$(cut -d' ' -f1-2 "$stamp")" = "$base" ] && [ "$want" = "$have" ]; then
  exit 0  # everything asked for is there
fi

installed_torch="$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null || true)"
wanted_torch="${TORCH_SPEC#torch==}"
if [ -n "$installed_torch" ] && [ "$wanted_torch" != "$TORCH_SPEC" ] && [ "${installed_torch%%+*}" != "${wanted_torch%%+*}" ]; then
  echo "[bootstrap] $VENV has torch $installed_torch, and $TORCH_SPEC was asked for: not replacing it." >&2
  echo "[bootstrap] Use another venv (ARDIFF_VENV=.venv-new), remove $VENV, or keep it with ARDIFF_TORCH_SPEC=torch==${installed_torch%%+*}." >&2
  exit 1
fi
echo "[bootstrap] installing $TORCH_SPEC and ardiff-server${want:+[$want]} into $VENV"
"${PIP[@]}" --upgrade pip
"${PIP[@]}" "${CONSTRAINTS[@]}" "$TORCH_SPEC"
# setuptools' build backend warns about every editable install ("folders ... with the same name as your package"):
# true of any checkout, and noise in the first serve's log; pip's own errors still show
PYTHONWARNINGS="ignore::UserWarning" "${PIP[@]}" "${CONSTRAINTS[@]}" -e ".${want:+[$want]}"
echo "$base $want" > "$stamp"
