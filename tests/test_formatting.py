"""The tree is as ``ruff format`` writes it (CI checks that too, ``.ci/run``), and the few places it may not touch say why.

A ``# fmt: off`` (or ``# fmt: skip``) is kept only where a table of numbers truly reads better aligned; the comment
lines right above it say so (the word "unformatted"), and every ``# fmt: off`` is closed by a ``# fmt: on``.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FOLDERS = ("ardiff_server", "policies", "kv", "client", "sim", "scripts", "tests")
MARKER = re.compile(r"#\s*fmt:\s*(off|skip|on)\b")


def markers() -> list[tuple[Path, int, str]]:
    found = []
    for folder in FOLDERS:
        for path in sorted((REPO / folder).rglob("*.py")):
            if path == Path(__file__).resolve():  # its docstring names the markers
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if m := MARKER.search(line):
                    found.append((path, n, m.group(1)))
    return found


def test_every_formatter_marker_says_why_and_every_off_is_turned_on_again():
    unexplained, unclosed = [], []
    for path, n, kind in markers():
        lines = path.read_text().splitlines()
        if kind in ("off", "skip"):
            above = []
            for line in reversed(lines[: n - 1]):
                if not line.lstrip().startswith("#"):
                    break
                above.append(line)
            if not any("unformatted" in line for line in above):
                unexplained.append(f"{path.relative_to(REPO)}:{n}")
        if kind == "off" and not any(MARKER.search(line) and "on" in line.split("fmt:")[1] for line in lines[n:]):
            unclosed.append(f"{path.relative_to(REPO)}:{n}")
    assert unexplained == [], "fmt: off / skip without a comment above saying why it stays unformatted"
    assert unclosed == []
    assert len([m for m in markers() if m[2] != "on"]) <= 4, "fmt markers are for the odd aligned table, not a habit"


def test_ruff_format_leaves_the_tree_as_it_is():
    ruff = Path(sys.executable).parent / "ruff"
    out = subprocess.run([str(ruff), "format", "--check", "."], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
