"""What the README and docs/ name exists, and names are cited as they are imported (issue #37).

* Every file or folder of this repository that a document names in backticks exists: a path from the repository's
  root or a package's root (``wire/openpi.py``), or a bare file name of a file somewhere in it (``episode.py``,
  named in its folder's section). Paths of upstream's repositories, of checkpoints and of files still to be written
  are listed below, each group with why.
* Every dotted ``ardiff_*`` name in a document or a docstring (``ardiff_policies.batch_retry.run_batched``) is a module
  of the tree, and the name after the module is defined at its top level: a rename that leaves a citation behind
  fails here.
* Documents cite modules by their import names: ``ardiff_kv.window``, not ``kv.window`` (``kv/window.py`` as a path).
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
ROOTS = ("", "ardiff_server/", "policies/", "kv/", "client/", "sim/", "scripts/", "tests/", "docs/", "configs/")
PACKAGES = {"ardiff_server": "ardiff_server", "ardiff_policies": "policies", "ardiff_kv": "kv", "ardiff_client": "client", "ardiff_sim": "sim"}

# Named in the documents, and not files of this repository (each group says whose they are).
ELSEWHERE = {
    # upstream DreamZero (dreamzero0/dreamzero) and its clients: what the server reproduces or serves
    "open_loop_yam.py",
    "test_client_AR.py",
    "eval_utils/run_sim_eval.py",
    "eval_utils/serve_dreamzero_wan22.py",
    "serve_dreamzero_wan22.py",
    "scripts/train/droid_training_full_finetune_wan22.sh",
    "scripts/train/agibot_training.sh",
    "yam_training.sh",
    "docs/DATASET_TO_GEAR_AND_TRAIN.md",
    "docs/WAN22_BACKBONE.md",
    "wan_flow_matching_action_tf_wan22.yaml",
    "droid_relative_wan22.yaml",
    "droid_relative.yaml",
    "base_48_wan_fine_aug_relative.yaml",
    "sim_policy.py",
    "socket_test_optimized_AR.py",
    # upstream LingBot-VA (Robbyant/lingbot-va) and Zero-WAM (jianwenli96/Zero-WAM)
    "evaluation/robotwin/eval_polict_client_openpi.py",
    "evaluation/robotwin/websocket_client_policy.py",
    "evaluation/robotwin/icl_reference.py",
    "evaluation/robotwin/eval_policy_client_openpi.py",
    "icl_reference.py",
    "icl_model.py",
    "human_data/robotwin/",
    "wan_va/utils/logging.py",
    "wan_va/distributed/fsdp.py",
    "distributed/util.py",
    "modules/utils.py",
    "evaluation/libero/client.py",
    "va_libero_cfg.py",
    "va_robotwin_cfg.py",
    "va_franka_cfg.py",
    "va_demo_cfg.py",
    "va_arms_cfg.py",
    "wan_va/wan_va_server.py",
    "wan_va/modules/model.py",
    "wan_va/modules/utils.py",
    "wan_va/modules/icl_model.py",
    "wan_va/utils/scheduler.py",
    "wan_va/utils/utils.py",
    "wan_va/utils/Simple_Remote_Infer/deploy/",
    "wan_va/configs/va_libero_cfg.py",
    "wan_va/configs/zerowam_train_config.py",
    "docs/ARMS_MI300X_POSTTRAIN.md",
    "docs/icl_inference.md",
    "docs/icl_model_architecture.md",
    # openpi, RoboArena, vLLM-Omni
    "src/openpi/serving/websocket_policy_server.py",
    "packages/openpi-client/src/openpi_client/msgpack_numpy.py",
    "scripts/test_policy_server.py",
    "openpi_client.py",
    "vllm_omni/diffusion/models/dreamzero/",
    # inside a checkpoint directory or a log folder, not the repository
    "config.json",
    "metadata.json",
    "experiment_cfg/metadata.json",
    "experiment_cfg/conf.yaml",
    "conf.yaml",
    "transformer/config.json",
    "meta/action_stats.json",
    "vae/",
    "observation/",
    "/tmp/ray/session_latest/logs/serve/",
    "timings.json",  # a recording's file (server.record_dir), written per session
    "rollout.json",  # in ../shared/reference/upstream_dit_tiny/, the parity data outside the repository
}

PATH = re.compile(r"`([A-Za-z0-9_./\-]+?(?:\.(?:py|md|yaml|yml|sh|txt|toml|json)|/))`")
DOTTED = re.compile(r"\b((?:ardiff_server|ardiff_policies|ardiff_kv|ardiff_client|ardiff_sim)(?:\.[A-Za-z_][A-Za-z0-9_]*)+)")


@cache
def tracked_names() -> frozenset[str]:
    skip = {".git", ".venv", ".venv-gpu", "__pycache__", ".device_wheels"}
    return frozenset(p.name for p in REPO.rglob("*") if not skip & set(p.relative_to(REPO).parts))


def named_paths(document: Path) -> list[tuple[int, str]]:
    return [(n, m.group(1)) for n, line in enumerate(document.read_text().splitlines(), 1) for m in PATH.finditer(line)]


def exists(path: str) -> bool:
    """Whether ``path`` is a file or folder of this repository (an absolute path never is)."""
    if path.startswith("/"):
        return False
    if any((REPO / root / path).exists() for root in ROOTS):
        return True
    return "/" not in path.rstrip("/") and path.rstrip("/") in tracked_names()


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: p.name)
def test_every_path_a_document_names_exists(document):
    # ``../shared/`` is the reference set beside a checkout, not in it: absent from a plain clone (the parity tests skip then).
    named = [(n, path) for n, path in named_paths(document) if not path.startswith("../shared/")]
    missing = [f"{document.name}:{n}: {path}" for n, path in named if path not in ELSEWHERE and not exists(path)]
    assert missing == [], "paths named that do not exist (a file moved? or add upstream's to ELSEWHERE):\n" + "\n".join(missing)


def test_the_list_of_paths_elsewhere_holds_only_what_a_document_still_names():
    named = {path for document in DOCUMENTS for _, path in named_paths(document)}
    assert sorted(ELSEWHERE - named) == []
    assert sorted(path for path in ELSEWHERE if exists(path) and "/" in path.rstrip("/")) == []  # not ours after all


@cache
def top_level_names(module: Path) -> frozenset[str]:
    """The names a module defines or imports at its top level (under ``if``/``try`` too)."""
    names: set[str] = set()
    pending = list(ast.parse(module.read_text()).body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, ast.If | ast.Try):
            pending += [*node.body, *node.orelse, *getattr(node, "handlers", ()), *getattr(node, "finalbody", ())]
        elif isinstance(node, ast.ExceptHandler):
            pending += node.body
    return frozenset(names)


def unresolved(name: str) -> str | None:
    """Why the dotted name is no module of the tree (or no top-level name of its module), or None."""
    package, *parts = name.split(".")
    folder = REPO / PACKAGES[package]
    for depth in range(len(parts), -1, -1):
        base = folder.joinpath(*parts[:depth])
        module = base.with_suffix(".py") if depth and base.with_suffix(".py").is_file() else base / "__init__.py"
        if not module.is_file():
            continue
        rest = parts[depth:]
        if rest and not rest[0].startswith("__") and rest[0] not in top_level_names(module):
            return f"{'.'.join([package, *parts[:depth]])} has no {rest[0]}"
        return None
    return f"no module {name}"


def sources() -> list[Path]:
    folders = ("ardiff_server", "policies", "kv", "client", "sim", "scripts", "tests")
    return [*DOCUMENTS, *(p for folder in folders for p in sorted((REPO / folder).rglob("*.py")))]


def test_every_dotted_name_cited_is_a_module_of_the_tree_and_defined_there():
    wrong = []
    for path in sources():
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for match in DOTTED.finditer(line):
                if (why := unresolved(match.group(1))) is not None:
                    wrong.append(f"{path.relative_to(REPO)}:{n}: {match.group(1)}: {why}")
    assert wrong == [], "citations of names that are not there (moved or renamed?):\n" + "\n".join(wrong)


def test_documents_cite_kv_and_policies_by_their_import_names():
    modules = {
        folder: {p.stem for p in (REPO / folder).glob("*.py")} | {p.name for p in (REPO / folder).iterdir() if (p / "__init__.py").is_file()}
        for folder in ("kv", "policies")
    }
    pattern = re.compile(r"`(kv|policies)\.([A-Za-z_]\w*)")
    wrong = [
        f"{document.name}:{n}: {m.group(0)}` (ardiff_{m.group(1)}.{m.group(2)})"
        for document in DOCUMENTS
        for n, line in enumerate(document.read_text().splitlines(), 1)
        for m in pattern.finditer(line)
        if m.group(2) in modules[m.group(1)]
    ]
    assert wrong == []


def test_the_checks_catch_a_moved_file_and_a_stale_citation():
    assert not exists("ardiff_server/wire/no_such_module.py") and exists("wire/openpi.py") and exists("episode.py")
    assert unresolved("ardiff_policies.batch_retry.run_batched") is None
    stale, absent = ".".join(("ardiff_policies", "lingbot_va", "config", "Embodiment")), ".".join(("ardiff_kv", "no_module"))
    assert unresolved(stale) == "ardiff_policies.lingbot_va.config has no Embodiment"  # (moved to embodiments.py)
    assert unresolved(absent) == "ardiff_kv has no no_module"
