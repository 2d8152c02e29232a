"""The wheel installs its import packages under names no other distribution uses: ardiff_server, ardiff_kv,
ardiff_policies, ardiff_client and ardiff_sim (the repository keeps kv/, policies/, client/ and sim/; pyproject's
[tool.setuptools] package-dir maps them).
Installed into a fresh venv beside PyPI's `kv` and `policies` distributions, each name resolves to its own files.

Needs PyPI for `kv` and `policies` (skips, saying so, when it
cannot be reached); builds the wheel offline (no build isolation) and borrows this venv's torch & co. through a
.pth line after the fresh venv's own site-packages, so nothing large is downloaded (~30 s, most of it pip)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PYPI_NAMESAKES = ("kv==0.4.1", "policies==0.4.2")  # a dictionary over SQLite; an access-policy language (2015)


def _run(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=300, **kwargs)


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel_names")
    wheels = tmp / "wheels"
    built = _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels), str(REPO))
    assert built.returncode == 0, built.stderr
    (wheel,) = wheels.glob("ardiff_server-*.whl")
    venv = tmp / "venv"
    assert _run(sys.executable, "-m", "venv", str(venv)).returncode == 0
    python = venv / "bin" / "python"
    site = Path(_run(str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip())
    # the dependencies (torch, pydantic, ...) from this venv, searched after the fresh one's own packages
    (site / "zz_borrowed_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    namesakes = _run(
        str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *PYPI_NAMESAKES, env={**os.environ, "PIP_DEFAULT_TIMEOUT": "15"}
    )
    if namesakes.returncode != 0:
        pytest.skip(f"PyPI's {' and '.join(PYPI_NAMESAKES)} could not be installed (is PyPI reachable?): {namesakes.stderr.strip()[-300:]}")
    ours = _run(str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps", str(wheel))
    assert ours.returncode == 0, ours.stderr
    return venv, wheel


def test_the_wheel_lists_only_unique_top_level_names(fresh_venv):
    _, wheel = fresh_venv
    top = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert {name for name in top if not name.endswith(".dist-info")} == {
        "ardiff_server",
        "ardiff_kv",
        "ardiff_policies",
        "ardiff_client",
        "ardiff_sim",
    }, top


def test_ours_and_pypis_namesakes_import_side_by_side(fresh_venv):
    venv, _ = fresh_venv
    python = venv / "bin" / "python"
    probe = textwrap.dedent("""
        import importlib.util, json, sys
        import kv                                   # PyPI's: a dictionary interface over SQLite
        import ardiff_kv, ardiff_policies, ardiff_server
        from ardiff_kv import PagedKVCache
        from ardiff_policies.dreamzero.config import DreamZeroConfig
        from ardiff_policies.registry import policy_entry
        spec = importlib.util.find_spec("policies")  # PyPI's (it no longer imports on Python 3.10+: found, not run)
        print(json.dumps({
            "kv": kv.__file__, "kv_is_pypis": hasattr(kv, "KV"), "policies": spec.origin,
            "ardiff_kv": ardiff_kv.__file__, "ardiff_policies": ardiff_policies.__file__, "ardiff_server": ardiff_server.__file__,
            "registry": policy_entry("dreamzero").config_model().__module__,
        }))
    """)
    out = _run(str(python), "-c", probe, cwd=venv)  # not the repository: its kv/ and policies/ folders must not count
    assert out.returncode == 0, out.stderr
    found = json.loads(out.stdout)
    site = str(venv)
    assert found["kv_is_pypis"] and found["kv"].startswith(site), found
    assert found["policies"].startswith(site) and not Path(found["policies"]).with_name("registry.py").exists()
    for name in ("ardiff_kv", "ardiff_policies", "ardiff_server"):
        assert found[name].startswith(site) and f"/{name}/" in found[name], found
    assert found["registry"] == "ardiff_policies.dreamzero.config"  # the registry's import paths use the installed names


def test_pyproject_lists_every_package_under_its_installed_name():
    """[tool.setuptools] packages is an explicit list (find cannot rename): a new subpackage must be added to it."""
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    installed = {"kv": "ardiff_kv", "policies": "ardiff_policies", "client": "ardiff_client", "sim": "ardiff_sim"}
    found = set()
    for folder in ("ardiff_server", "kv", "policies", "client", "sim"):
        for init in (REPO / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(REPO).parts
            found.add(".".join((installed.get(parts[0], parts[0]), *parts[1:])))
    assert listed == found, f"add {sorted(found - listed)} to / remove {sorted(listed - found)} from pyproject.toml's packages"
