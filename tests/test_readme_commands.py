"""Every shell command in the README and docs/ runs as written from a fresh clone: each executable it names resolves.

A command line is a line of a ```bash / ```sh / ```console block. Its programs must be one of: `bash <a script of
this repository>`, `<venv>/bin/<a program the bootstrap installs>` (resolved in the venv running these tests, which
`scripts/test.sh` made as `serve.sh` makes `.venv`; `.venv-gpu` has the same console scripts), `python3
scripts/<a script>` (the bare interpreter a fresh machine has: the device runs), a shell builtin, or a program on this
machine's PATH. A bare console script (`ardiff-serve`, `ardiff-client`, `ray`) is `command not found` on a fresh
clone: allowed only after the document has said `source <venv>/bin/activate` in a command block.
"""

from __future__ import annotations

import re
import shlex
import shutil
import sys
import tomllib
from pathlib import Path

import pytest

from tests.helpers.server_harness import REPO

DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SHELL_BLOCKS = {"bash", "sh", "shell", "console"}
BUILTINS = {"export", "set", "source", "cd", "kill", "echo", "."}
CONSOLE_SCRIPTS = set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"])
VENV_BIN = Path(sys.executable).parent


def command_lines(document: Path) -> list[tuple[int, str]]:
    """(line number, command) for each command of the document's shell blocks, continuation lines joined."""
    lines, block, pending = [], None, ""
    for number, raw in enumerate(document.read_text().splitlines(), 1):
        stripped = raw.strip()
        if stripped.startswith("```"):
            block = (stripped[3:].strip() or "-") if block is None else None
            continue
        if block not in SHELL_BLOCKS:
            continue
        stripped = stripped.removeprefix("$ ")
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        lines.append((number, pending + stripped))
        pending = ""
    return lines


def programs(command: str) -> list[list[str]]:
    """The words of each simple command of a line (split on ; && || |), comments and VAR=value prefixes dropped."""
    words = shlex.split(command, comments=True)
    segments, current = [], []
    for word in words:
        if word in {";", "&&", "||", "|"} or word.endswith(";"):
            if word.endswith(";") and word != ";":
                current.append(word[:-1])
            segments.append(current)
            current = []
        else:
            current.append(word)
    segments.append(current)
    out = []
    for segment in segments:
        while segment and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", segment[0]):
            segment = segment[1:]
        segment = [word for word in segment if not re.fullmatch(r"\d?>.*|2>&1", word)]
        if segment:
            out.append(segment)
    return out


def unresolved(words: list[str], activated: bool) -> str | None:
    """Why this simple command would not run on a fresh clone, or None."""
    program, args = words[0], words[1:]
    if program in BUILTINS:
        return None
    if program in ("bash", "python3"):
        script = next((arg for arg in args if not arg.startswith("-")), None)
        if script is None or not (REPO / script).is_file():
            return f"{program} {script}: no such file in the repository"
        return None
    match = re.fullmatch(r"(\.venv(?:-gpu)?)/bin/(.+)", program)
    if match:
        name = match[2]
        if name in CONSOLE_SCRIPTS or (VENV_BIN / name).exists():
            if name.startswith("python") and args[:2] == ["-m", "pytest"]:
                paths = [arg.split("::")[0] for arg in args[2:] if arg.startswith("tests")]
                missing = [path for path in paths if not (REPO / path).exists()]
                return f"pytest {missing}: no such path" if missing else None
            if name.startswith("python") and args and not args[0].startswith("-"):
                return None if (REPO / args[0]).is_file() else f"{args[0]}: no such file"
            return None
        return f"{program}: the bootstrap installs no {name}"
    if program in CONSOLE_SCRIPTS or ((VENV_BIN / program).exists() and shutil.which(program, path="/usr/bin:/bin") is None):
        return None if activated else f"{program}: command not found on a fresh clone (use .venv/bin/{program} or bash scripts/serve.sh)"
    return None if shutil.which(program) else f"{program}: not on PATH"


def test_the_parser_reads_blocks_continuations_and_environment():
    assert programs("HF_HUB_OFFLINE=1 bash scripts/serve.sh --gpu   # a comment") == [["bash", "scripts/serve.sh", "--gpu"]]
    assert programs('set -o pipefail; PYTHONUNBUFFERED=1 python3 scripts/gpu_check.py --out "$OUT" 2>&1 | tail -n 3') == [
        ["set", "-o", "pipefail"],
        ["python3", "scripts/gpu_check.py", "--out", "$OUT"],
        ["tail", "-n", "3"],
    ]
    assert unresolved(["ardiff-serve", "--config", "tiny"], activated=False).startswith("ardiff-serve: command not found")
    assert unresolved(["ardiff-serve", "--config", "tiny"], activated=True) is None
    assert unresolved([".venv/bin/ardiff-client", "--port", "8000"], activated=False) is None
    assert "no such file" in unresolved(["bash", "scripts/no_such.sh"], activated=False)


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: path.name)
def test_every_command_in_the_docs_runs_from_a_fresh_clone(document):
    problems, activated = [], False
    for number, command in command_lines(document):
        for words in programs(command):
            if words[0] in ("source", ".") and len(words) > 1 and words[1].endswith("/bin/activate"):
                activated = True
            why = unresolved(words, activated)
            if why:
                problems.append(f"{document.name}:{number}: {why}")
    assert not problems, "\n".join(problems)
