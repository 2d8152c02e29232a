"""What to run when an optional extra is missing: this environment's own pip, the way the project installs it.

A bare ``pip`` may be another Python's; ``bash scripts/serve.sh --record`` / ``--ray`` add their extras to
``.venv`` themselves. Imports nothing heavy (the client and the config check both use it)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# the serve.sh flag that installs each extra
_SERVE_FLAG = {"viz": "--record DIR", "ray": "--ray"}


def pip_command() -> str:
    """This interpreter's pip, as a path relative to the working directory when it lies under it (``.venv/bin/pip``)."""
    pip = Path(sys.prefix) / "bin" / "pip"
    try:
        relative = os.path.relpath(pip)
    except ValueError:  # another drive (Windows)
        return str(pip)
    return relative if not relative.startswith("..") else str(pip)


def install_hint(extra: str) -> str:
    """One clause naming how to get ``extra``: ``.venv/bin/pip install -e '.[viz]'`` (or serve.sh's flag that does it)."""
    hint = f"{pip_command()} install -e '.[{extra}]'"
    flag = _SERVE_FLAG.get(extra)
    return f"{hint} (bash scripts/serve.sh {flag} installs it too)" if flag else hint
