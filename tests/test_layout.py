"""The layout's rules: no lower floor imports a higher one, and the front end stays torch-free.

Floors of ``ardiff_server`` (a module may import its own floor and any lower one):
config/net/media < wire < engine < frontend < ray < cli. Across packages: kv imports neither
policies nor ardiff_server; policies never imports ardiff_server. Inside policies, the two model families
(dreamzero, lingbot_va) share Wan parts only through ``policies/wan/``, which imports neither family.
The client (``client/`` -> ``ardiff_client``) imports no torch, and no server package imports it or the
benches' simulated task (``sim/`` -> ``ardiff_sim``).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

FLOORS = {"extras": 0, "config": 0, "net": 0, "media": 0, "wire": 1, "engine": 3, "frontend": 4, "ray": 5, "cli": 6, "__main__": 6, "ray_serve": 6}

NAMES = {
    "kv": "ardiff_kv",
    "policies": "ardiff_policies",
    "client": "ardiff_client",
    "sim": "ardiff_sim",
}  # folders -> installed names (pyproject.toml)


def _floor(module: str) -> int | None:
    """The floor of an ``ardiff_server.*`` module name (None for the package root itself)."""
    parts = module.split(".")
    return FLOORS[parts[1]] if len(parts) > 1 else None


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def _modules(package: str) -> list[tuple[str, Path]]:
    """(dotted name, path) of every module; a package's ``__init__`` is named as the package."""
    root = REPO / package
    out = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        parts = (NAMES.get(parts[0], parts[0]), *parts[1:])  # the installed name (kv/ -> ardiff_kv)
        out.append((".".join(parts[:-1] if parts[-1] == "__init__" else parts), path))
    return out


def test_every_server_module_sits_on_a_known_floor():
    unknown = [name for name, _ in _modules("ardiff_server") if len(name.split(".")) > 1 and name.split(".")[1] not in FLOORS]
    assert unknown == [], "add new subpackages to FLOORS (and to docs/design-notes.md's layout)"


def test_no_lower_floor_imports_a_higher_one():
    upward = []
    for name, path in _modules("ardiff_server"):
        floor = _floor(name)
        if floor is None:
            continue
        for imported in _imports(path):
            if imported.startswith("ardiff_server.") and (target := _floor(imported)) is not None and target > floor:
                upward.append(f"{name} -> {imported}")
    assert upward == []


@pytest.mark.parametrize(("package", "forbidden"), [("kv", ("ardiff_policies", "ardiff_server")), ("policies", ("ardiff_server",))])
def test_kv_and_policies_do_not_import_the_server(package, forbidden):
    bad = [f"{name} -> {imp}" for name, path in _modules(package) for imp in _imports(path) if imp.split(".")[0] in forbidden]
    assert bad == []


FAMILIES = ("ardiff_policies.dreamzero", "ardiff_policies.lingbot_va")


@pytest.mark.parametrize("package", ["dreamzero", "lingbot_va", "wan"])
def test_model_families_share_code_only_through_the_wan_package(package):
    """A family importing the other's modules would make a change to one silently change the other."""
    own = f"ardiff_policies.{package}"
    bad = [
        f"{name} -> {imp}"
        for name, path in _modules(f"policies/{package}")
        for imp in _imports(path)
        if any(imp == family or imp.startswith(family + ".") for family in FAMILIES if family != own)
    ]
    assert bad == []


def test_front_end_modules_never_load_torch():
    front = [
        "ardiff_server.cli",
        "ardiff_server.frontend.server",
        "ardiff_server.engine.replicas",
        "ardiff_server.engine.inproc_client",
        "ardiff_server.ray.run",
        "ardiff_server.ray.client",
        "ardiff_policies.dreamzero.config",
    ]
    code = f"import sys; import {', '.join(front)}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("package", ["ardiff_server", "kv", "policies"])
def test_no_server_package_imports_the_client_or_the_simulated_task(package):
    """Every import statement counts: module level, inside functions and under ``if TYPE_CHECKING:`` alike."""
    bad = [f"{name} -> {imp}" for name, path in _modules(package) for imp in _imports(path) if imp.split(".")[0] in ("ardiff_client", "ardiff_sim")]
    assert bad == []


# Imports every module of ardiff_client with torch blocked: a finder ahead of all others refuses torch and notes who
# asked, so a module that swallows the ImportError (``try: import torch``) is caught too.
_NO_TORCH = """
import importlib, json, pkgutil, sys, traceback

asked = []

class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            asked.append("".join(traceback.format_stack(limit=12)))
            raise ImportError(f"torch is blocked: {name}")
        return None

sys.meta_path.insert(0, NoTorch())
import ardiff_client
names = sorted(m.name for m in pkgutil.walk_packages(ardiff_client.__path__, "ardiff_client."))
for name in names:
    importlib.import_module(name)
print(json.dumps({"modules": names, "asked": asked, "loaded": sorted(m for m in ("torch", "matplotlib") if m in sys.modules)}))
"""


def test_every_client_module_imports_with_torch_blocked():
    out = subprocess.run([sys.executable, "-c", _NO_TORCH], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    files = {name for name, _ in _modules("client")} - {"ardiff_client"}
    assert set(result["modules"]) == files  # every file of client/ was imported
    assert result["asked"] == [], "a client module imported torch:\n" + "\n".join(result["asked"])
    assert result["loaded"] == []  # nor matplotlib: plotting loads it on use


def test_test_modules_share_helpers_only_through_tests_helpers():
    borrowed = [
        f"{name} -> {imp}"
        for name, path in _modules("tests")
        for imp in _imports(path)
        if imp.startswith("tests.") and not imp.startswith("tests.helpers")
    ]
    assert borrowed == []
