"""scripts/bootstrap.sh without installing anything: a fake venv python records the pip calls it would make."""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

import pytest

from tests.helpers.server_harness import REPO

FAKE_PYTHON = """#!/usr/bin/env bash
# pip calls are logged; the torch version query answers $FAKE_TORCH (none: not installed)
if [ "$1" = "-c" ]; then [ -n "$FAKE_TORCH" ] && echo "$FAKE_TORCH" && exit 0; exit 1; fi
echo "$*" >> "$(dirname "$0")/../pip.log"
"""


def run_bootstrap(venv: Path, torch: str = "", **env: str) -> subprocess.CompletedProcess:
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    python = venv / "bin" / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    environ = {**os.environ, "ARDIFF_VENV": str(venv), "FAKE_TORCH": torch, **env}
    return subprocess.run(["bash", "scripts/bootstrap.sh"], cwd=REPO, env=environ, capture_output=True, text=True, timeout=30)


def pip_calls(venv: Path) -> list[str]:
    log = venv / "pip.log"
    return log.read_text().splitlines() if log.exists() else []


def pyproject_hash() -> str:
    return hashlib.sha256((REPO / "pyproject.toml").read_bytes()).hexdigest()[:16]


def test_serving_needs_no_test_extras_and_extras_accumulate(tmp_path):
    venv = tmp_path / "venv"
    out = run_bootstrap(venv, ARDIFF_EXTRAS="")
    assert out.returncode == 0, out.stderr
    assert pip_calls(venv)[-2:] == [
        "-m pip install --quiet --disable-pip-version-check torch==2.13.0",
        "-m pip install --quiet --disable-pip-version-check -e .",
    ]
    assert (venv / ".ardiff-installed").read_text().split() == [pyproject_hash(), "torch==2.13.0"]
    # the tests' extras are added; serving again after that installs nothing
    assert run_bootstrap(venv, "2.13.0+cpu", ARDIFF_EXTRAS="dev,viz,ray").returncode == 0
    assert pip_calls(venv)[-1].endswith("-e .[dev,ray,viz]")
    calls = len(pip_calls(venv))
    assert run_bootstrap(venv, "2.13.0+cpu", ARDIFF_EXTRAS="").returncode == 0
    assert run_bootstrap(venv, "2.13.0+cpu", ARDIFF_EXTRAS="viz").returncode == 0
    assert len(pip_calls(venv)) == calls


def test_the_gpu_install_pins_torch_and_vllm_together_in_its_own_venv(tmp_path):
    constraints = (REPO / "scripts" / "constraints-gpu.txt").read_text()
    torch_pin = next(line for line in constraints.splitlines() if line.startswith("torch=="))
    vllm_pin = next(line for line in constraints.splitlines() if line.startswith("vllm=="))
    assert f'gpu = ["{vllm_pin}"]' in (REPO / "pyproject.toml").read_text()  # the extra and the constraints agree
    venv = tmp_path / "gpu"
    out = run_bootstrap(venv, ARDIFF_GPU="1", ARDIFF_EXTRAS="")
    assert out.returncode == 0, out.stderr
    calls = pip_calls(venv)
    assert calls[-2].endswith(f"-c scripts/constraints-gpu.txt {torch_pin}")
    assert calls[-1].endswith("-c scripts/constraints-gpu.txt -e .[gpu]")


@pytest.mark.parametrize("gpu", ["0", "1"])
def test_a_venv_with_another_torch_is_refused_not_replaced(tmp_path, gpu):
    venv = tmp_path / "venv"
    out = run_bootstrap(venv, "2.9.1", ARDIFF_GPU=gpu, ARDIFF_EXTRAS="")
    assert out.returncode == 1
    assert "has torch 2.9.1" in out.stderr and "not replacing it" in out.stderr and "ARDIFF_VENV" in out.stderr
    assert pip_calls(venv) == []
