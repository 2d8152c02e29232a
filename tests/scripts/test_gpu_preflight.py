"""scripts/gpu_preflight.sh, which `serve.sh --gpu` runs before anything downloads: a fake `nvidia-smi` on PATH
plays each machine (none, a failing driver, no GPU visible, R535, R580), and each failure is one line, exit 2."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.helpers.server_harness import REPO

PREFLIGHT = REPO / "scripts" / "gpu_preflight.sh"


def fake_bin(tmp_path: Path, nvidia_smi: str | None) -> Path:
    """A PATH folder with the tools the script uses and, if given, an nvidia-smi with this body."""
    folder = tmp_path / "bin"
    folder.mkdir()
    for tool in ("bash", "uname", "awk", "sed", "head", "wc", "tr", "df", "dirname", "mkdir", "printf"):
        real = subprocess.run(["bash", "-c", f"command -v {tool}"], capture_output=True, text=True).stdout.strip()
        if real.startswith("/"):
            (folder / tool).symlink_to(real)
    if nvidia_smi is not None:
        script = folder / "nvidia-smi"
        script.write_text(f"#!/bin/bash\n{nvidia_smi}\n")
        script.chmod(0o755)
    return folder


def run(tmp_path: Path, nvidia_smi: str | None, *, venv: Path | None = None, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "ARDIFF_SKIP_GPU_PREFLIGHT"}
    environ |= {"PATH": str(fake_bin(tmp_path, nvidia_smi)), **env}
    venv = venv or tmp_path / "venv-gpu"
    return subprocess.run(["bash", str(PREFLIGHT), str(venv)], env=environ, capture_output=True, text=True, timeout=30)


def one_line_failure(out: subprocess.CompletedProcess) -> str:
    assert out.returncode == 2, (out.returncode, out.stdout, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    return lines[0]


def test_no_driver_is_one_line_that_says_serve_on_the_cpu(tmp_path):
    line = one_line_failure(run(tmp_path, None))
    assert "nvidia-smi not found" in line and "without --gpu" in line and "ARDIFF_SKIP_GPU_PREFLIGHT=1" in line


def test_a_failing_driver_quotes_nvidia_smi(tmp_path):
    line = one_line_failure(run(tmp_path, 'echo "NVIDIA-SMI has failed because it couldn\'t communicate with the NVIDIA driver." >&2; exit 9'))
    assert "nvidia-smi failed: NVIDIA-SMI has failed because it couldn't communicate" in line


def test_no_gpu_visible(tmp_path):
    line = one_line_failure(run(tmp_path, "exit 0"))
    assert "sees no GPU" in line


@pytest.mark.parametrize("driver", ["535.183.01", "550.127.05", "575.57.08"])
def test_a_driver_older_than_r580_is_refused_with_the_upgrade_and_the_docs(tmp_path, driver):
    line = one_line_failure(run(tmp_path, f'echo "0, NVIDIA H100 80GB HBM3, {driver}, 81559 MiB"'))
    assert f"driver {driver} is older than R580" in line and "CUDA 13.0" in line and "docs/deploy.md" in line


def test_too_little_disk_names_the_folder_and_ARDIFF_VENV(tmp_path):
    line = one_line_failure(run(tmp_path, 'echo "0, NVIDIA H100 80GB HBM3, 580.95.05, 81559 MiB"', ARDIFF_GPU_VENV_GIB="100000"))
    assert "GiB free under" in line and "ARDIFF_VENV=" in line


def test_an_existing_venv_is_not_checked_for_disk(tmp_path):
    venv = tmp_path / "have"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("#!/bin/sh\n")
    (venv / "bin" / "python").chmod(0o755)
    out = run(tmp_path, 'echo "0, NVIDIA H100 80GB HBM3, 580.95.05, 81559 MiB"', venv=venv, ARDIFF_GPU_VENV_GIB="100000")
    assert out.returncode == 0, out.stderr


def test_a_good_machine_passes_in_one_line_naming_its_gpus(tmp_path):
    smi = 'printf "0, NVIDIA H200, 580.95.05, 143771 MiB\\n1, NVIDIA H200, 580.95.05, 143771 MiB\\n"'
    out = run(tmp_path, smi, ARDIFF_GPU_VENV_GIB="0")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[gpu-preflight] 2 GPU(s), driver 580.95.05 (>= R580): NVIDIA H200, 143771 MiB, ..."


def test_the_skip_is_said(tmp_path):
    out = run(tmp_path, None, ARDIFF_SKIP_GPU_PREFLIGHT="1")
    assert out.returncode == 0 and "skipped" in out.stdout


def test_serve_sh_runs_the_preflight_before_any_install(tmp_path):
    """On this (GPU-less) machine `serve.sh --gpu` fails within seconds, in one line, and makes no venv."""
    if subprocess.run(["bash", "-c", "command -v nvidia-smi"], capture_output=True).returncode == 0:
        pytest.skip("this machine has nvidia-smi: the GPU-less path cannot be shown here")
    venv = tmp_path / "venv-gpu"
    environ = {k: v for k, v in os.environ.items() if k != "ARDIFF_SKIP_GPU_PREFLIGHT"} | {"ARDIFF_VENV": str(venv)}
    command = ["bash", "scripts/serve.sh", "--gpu", "--config", "dreamzero_droid"]
    out = subprocess.run(command, cwd=REPO, env=environ, capture_output=True, text=True, timeout=30)
    line = one_line_failure(out)
    assert "nvidia-smi not found" in line
    assert not venv.exists()
