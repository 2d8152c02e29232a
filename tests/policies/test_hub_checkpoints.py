"""Checkpoints and tokenizers by Hugging Face id, served from a hub cache with HF_HUB_OFFLINE=1 (no network)."""

from __future__ import annotations

import os
import re
import resource
import socket
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from openpi_client.websocket_client_policy import WebsocketClientPolicy

from ardiff_policies import hub
from ardiff_policies.dreamzero.config import CHECKPOINT_FILES, DreamZeroConfig
from tests.helpers.hub_cache import populate_hub_cache
from tests.helpers.server_harness import REPO, ServerProcess, droid_observation

REPO_ID = "test-org/DreamZero-tiny"
TOKENIZER_ID = "test-org/tiny-umt5"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
OLD_COMMIT = "fedcba9876543210fedcba9876543210fedcba98"


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory) -> Path:
    """HF_HOME with the tiny checkpoint cached as REPO_ID (main and tag v1 at COMMIT; an older
    commit holding only its metadata) and its tokenizer alone as TOKENIZER_ID."""
    from ardiff_policies.dreamzero.tiny import ensure_tiny_checkpoint

    home = tmp_path_factory.mktemp("hf_home")
    tiny = ensure_tiny_checkpoint()
    populate_hub_cache(home / "hub", REPO_ID, tiny, commit=COMMIT, refs=("main", "v1"))
    old = tmp_path_factory.mktemp("old")
    (old / "experiment_cfg").mkdir()
    (old / "experiment_cfg" / "metadata.json").write_text((tiny / "experiment_cfg" / "metadata.json").read_text())
    populate_hub_cache(home / "hub", REPO_ID, old, commit=OLD_COMMIT, refs=())
    populate_hub_cache(home / "hub", TOKENIZER_ID, tiny / "tokenizer", commit=COMMIT)
    return home


@pytest.fixture
def offline_hub(hf_home, monkeypatch) -> Path:
    """huggingface_hub in this process pointed at the cache, offline (it read the environment at import)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hf_home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return hf_home / "hub"


def test_the_cache_has_the_hubs_own_layout(hf_home):
    from huggingface_hub import scan_cache_dir

    info = scan_cache_dir(hf_home / "hub")
    assert not info.warnings, info.warnings
    repos = {r.repo_id: r for r in info.repos}
    assert set(repos) == {REPO_ID, TOKENIZER_ID}
    revisions = {r.commit_hash: r for r in repos[REPO_ID].revisions}
    assert set(revisions) == {COMMIT, OLD_COMMIT} and revisions[COMMIT].refs == {"main", "v1"}
    assert "model.safetensors.index.json" in {f.file_name for f in revisions[COMMIT].files}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("GEAR-Dreams/DreamZero-DROID", hub.HubId("GEAR-Dreams/DreamZero-DROID")),
        ("google/umt5-xxl@main", hub.HubId("google/umt5-xxl", "main")),
        (f"org/name@{COMMIT}", hub.HubId("org/name", COMMIT)),
        ("org/name@refs/pr/3", hub.HubId("org/name", "refs/pr/3")),
        ("org/my_model.v2", hub.HubId("org/my_model.v2")),
    ],
)
def test_hub_ids_are_org_slash_name_with_an_optional_revision(text, expected):
    assert hub.classify(text, key="policy.checkpoint", example="/x") == expected
    assert str(expected) == text


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("/models/DreamZero-DROID", "policy.checkpoint: /models/DreamZero-DROID does not exist"),
        ("./org/name", "does not exist"),  # a path, even though it ends like an id
        ("models/org/name", "does not exist"),
        ("DreamZero-DROID", "neither an existing local directory nor a Hugging Face id"),
        ("org/na--me", "neither"),
        ("org/name@", "neither"),
        ("org/name@a..b", "neither"),
        ("org /name", "neither"),
        ("", "neither"),
    ],
)
def test_anything_else_is_one_line_naming_the_key(text, needle):
    with pytest.raises(hub.HubError, match=needle) as caught:
        hub.classify(text, key="policy.checkpoint", example="/x")
    assert "\n" not in str(caught.value)


def test_builtin_and_synthetic_names_are_not_resolved():
    assert DreamZeroConfig().preflight().checkpoint == "builtin:tiny"
    assert DreamZeroConfig(checkpoint="synthetic:droid").preflight().checkpoint == "synthetic:droid"
    with pytest.raises(ValueError, match="unknown 'builtin:huge'; built in: builtin:tiny, builtin:tiny_5b"):
        DreamZeroConfig(checkpoint="builtin:huge").preflight()


def test_an_existing_local_directory_wins_over_an_id_of_the_same_shape(tmp_path, monkeypatch):
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert hub.classify("org/name", key="k", example="/x") == Path("org/name")


def test_preflight_resolves_ids_to_snapshots_and_fetches_only_what_the_server_reads(offline_hub):
    snapshot = offline_hub / "models--test-org--DreamZero-tiny" / "snapshots" / COMMIT
    resolved = DreamZeroConfig(checkpoint=REPO_ID).preflight()
    assert resolved.checkpoint == str(snapshot) and resolved.tokenizer == str(snapshot / "tokenizer")
    for revision in ("v1", COMMIT):  # a tag, a commit
        assert DreamZeroConfig(checkpoint=f"{REPO_ID}@{revision}").preflight().checkpoint == str(snapshot)
    with_tokenizer = DreamZeroConfig(checkpoint=REPO_ID, tokenizer=TOKENIZER_ID).preflight()
    assert with_tokenizer.tokenizer == str(offline_hub / "models--test-org--tiny-umt5" / "snapshots" / COMMIT)
    # beside a built-in checkpoint too (the worker must never see a hub id)
    builtin = DreamZeroConfig(checkpoint="builtin:tiny_5b", tokenizer=TOKENIZER_ID).preflight()
    assert builtin.checkpoint == "builtin:tiny_5b" and builtin.tokenizer == with_tokenizer.tokenizer
    # What the server reads matches the patterns; the tokenizer's files too.
    from huggingface_hub.utils import filter_repo_objects

    files = [p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file()]
    wanted = set(filter_repo_objects(files, allow_patterns=list(CHECKPOINT_FILES)))
    assert wanted == {f for f in files if not f.startswith("tokenizer/")}
    assert hub.snapshot_label(resolved.checkpoint) == f"{REPO_ID}@{COMMIT}"


def test_an_incomplete_or_foreign_snapshot_and_an_uncached_id_fail_in_one_line(offline_hub):
    with pytest.raises(ValueError, match=f"policy.checkpoint: .*/{OLD_COMMIT} \\({REPO_ID}@{OLD_COMMIT}\\) has no config.json"):
        DreamZeroConfig(checkpoint=f"{REPO_ID}@{OLD_COMMIT}").preflight()
    with pytest.raises(ValueError, match=re.escape("policy.tokenizer: /no/such/umt5 does not exist")):
        DreamZeroConfig(checkpoint=REPO_ID, tokenizer="/no/such/umt5").preflight()
    with pytest.raises(hub.HubError) as caught:
        DreamZeroConfig(checkpoint="test-org/not-cached@v2").preflight()
    message = str(caught.value)
    assert message.startswith("policy.checkpoint: test-org/not-cached@v2 is not in the Hugging Face cache")
    assert "HF_HUB_OFFLINE=1" in message and "hf download test-org/not-cached --revision v2" in message and "\n" not in message
    with pytest.raises(hub.HubError, match=re.escape("policy.tokenizer: google/umt5-xxl is not in the Hugging Face cache")) as caught:
        DreamZeroConfig(checkpoint=REPO_ID, tokenizer="google/umt5-xxl").preflight()
    # the fix fetches only what the server reads: umt5-xxl's tokenizer files, not its weights
    fetch = re.search(r"\((hf download google/umt5-xxl[^)]*)\)", str(caught.value)).group(1)
    assert "--include tokenizer.json" in fetch and "--include spiece.model" in fetch and "safetensors" not in fetch and ".bin" not in fetch


def test_the_download_hint_includes_only_the_files_the_server_reads_and_the_hf_cli_takes_it():
    from click.testing import CliRunner
    from huggingface_hub.cli.hf import app

    from ardiff_policies.dreamzero.config import CHECKPOINT_FILES, CHECKPOINT_TOKENIZER_FILES

    command = hub.download_command(hub.HubId("GEAR-Dreams/DreamZero-DROID", "v2"), CHECKPOINT_FILES + CHECKPOINT_TOKENIZER_FILES)
    assert command.startswith("hf download GEAR-Dreams/DreamZero-DROID --revision v2 --include config.json ")
    assert "--include 'model-*.safetensors'" in command and "--include 'tokenizer/*'" in command  # quoted: the shell must not glob
    # the installed hf CLI parses it: every pattern reaches its include list (download itself is not run)
    import shlex
    from unittest import mock

    with mock.patch("huggingface_hub.cli.download.snapshot_download", return_value="/x") as download:
        result = CliRunner().invoke(app, shlex.split(command)[1:])
    assert result.exit_code == 0, result.output
    assert download.call_args.kwargs["allow_patterns"] == [*CHECKPOINT_FILES, *CHECKPOINT_TOKENIZER_FILES]
    assert download.call_args.kwargs["revision"] == "v2"


def test_a_hub_id_is_served_through_the_cli_from_the_offline_cache(hf_home, tmp_path):
    env = {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(hf_home / "hub")}
    args = ["--set", f"policy.checkpoint={REPO_ID}@v1", "--set", "engine.warmup=false"]
    with ServerProcess("tiny", tmp_path, args=args, env=env) as process:
        client = WebsocketClientPolicy(host="127.0.0.1", port=process.port)
        assert client.get_server_metadata() is not None
        replies = [client.infer(droid_observation(1 if i == 0 else 4, seed=i, size=(90, 160), session_id="hub")) for i in range(2)]
        assert all(r["actions"].shape == (24, 8) and np.isfinite(r["actions"]).all() for r in replies)
        status, body = process.http("/info")
        assert status == 200 and f"{REPO_ID}@{COMMIT}" in body, body  # the snapshot's commit, not a temp path
        maps = Path(f"/proc/{process.proc.pid}/maps").read_text()
        assert "libtorch" not in maps, "resolving the id loaded torch into the front end"


def test_an_uncached_id_fails_before_any_worker_with_one_line(tmp_path):
    env = {**os.environ, "HF_HOME": str(tmp_path / "empty"), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    env.pop("HF_HUB_CACHE", None)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(
        [sys.executable, "-m", "ardiff_server", "--config", "tiny", "--set", "policy.checkpoint=GEAR-Dreams/DreamZero-DROID"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert "policy.checkpoint: GEAR-Dreams/DreamZero-DROID is not in the Hugging Face cache" in lines[0]
    assert "--set policy.checkpoint=/path/to/DreamZero-DROID" in lines[0] and "hf download GEAR-Dreams/DreamZero-DROID" in lines[0]
    assert "worker" not in out.stdout + out.stderr
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    assert cpu_s < 2.0, f"{cpu_s:.1f} s of CPU: the failure should come before anything heavy is imported"  # ~0.8 s


def test_a_hub_tokenizer_beside_a_built_in_checkpoint_resolves_the_same_without_preflight(offline_hub, tmp_path, monkeypatch):
    """Ray replicas get the config unresolved (preflight runs with local=False): files() must fetch the id, not read
    it as a path relative to the replica's working directory."""
    monkeypatch.chdir(tmp_path)
    config = DreamZeroConfig(checkpoint="builtin:tiny", tokenizer=TOKENIZER_ID)
    _, tokenizer = config.files()
    assert tokenizer == Path(config.preflight().tokenizer) == offline_hub / "models--test-org--tiny-umt5" / "snapshots" / COMMIT


class FakeProxy:
    """An HTTP proxy on 127.0.0.1 that reads one CONNECT request per connection and answers 403
    (``refuse``) or closes the connection without a word (``hang_up``). Nothing leaves the machine."""

    def __init__(self, behaviour: str) -> None:
        self.behaviour = behaviour
        self.requests: list[str] = []
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:  # closed
                return
            with conn:
                data = b""
                while b"\r\n\r\n" not in data and (chunk := conn.recv(4096)):
                    data += chunk
                self.requests.append(data.split(b"\r\n", 1)[0].decode(errors="replace"))
                if self.behaviour == "refuse":
                    conn.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n")

    def close(self) -> None:
        self.server.close()


@pytest.mark.parametrize(
    ("behaviour", "error"), [("refuse", "ProxyError: 403 Forbidden"), ("hang_up", "RemoteProtocolError|ConnectionError|ProxyError")]
)
def test_a_proxy_that_refuses_or_hangs_up_is_one_line(tmp_path, behaviour, error):
    """HTTPS_PROXY names a proxy that answers CONNECT with 403, or drops it: one line naming the proxy
    (without its credentials) and the fix, as for an unreachable Hub, not a 90-line traceback.
    HF_ENDPOINT is a host that never resolves, so a client that ignored the proxy could not go out either."""
    proxy = FakeProxy(behaviour)
    try:
        env = {key: value for key, value in os.environ.items() if "proxy" not in key.lower() and not key.startswith("HF_")}
        env.update(
            {
                "HF_HOME": str(tmp_path / "hf"),
                "HF_ENDPOINT": "https://hub.invalid",
                "HTTPS_PROXY": f"http://robot:s3cret@127.0.0.1:{proxy.port}",
                "HF_HUB_ETAG_TIMEOUT": "5",
                "HF_HUB_DOWNLOAD_TIMEOUT": "5",
                "PYTHONPATH": str(REPO),
            }
        )
        out = subprocess.run(
            [sys.executable, "-m", "ardiff_server", "--config", "tiny", "--set", "policy.checkpoint=GEAR-Dreams/DreamZero-DROID"],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        proxy.close()
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert proxy.requests and all(r.startswith("CONNECT hub.invalid:443") for r in proxy.requests), proxy.requests
    assert f"policy.checkpoint: GEAR-Dreams/DreamZero-DROID cannot be fetched: the proxy http://127.0.0.1:{proxy.port} (HTTPS_PROXY)" in lines[0]
    assert re.search(error, lines[0]) and "s3cret" not in lines[0] and "robot" not in lines[0], lines[0]
    assert "--set policy.checkpoint=/path/to/DreamZero-DROID" in lines[0] and "hf download GEAR-Dreams/DreamZero-DROID" in lines[0]
