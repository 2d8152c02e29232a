"""The zero_wam policy section: every key read or refused by name, the shipped configs, and its Hub ids
(robbyant-research/zero-wam-posttrain-robotwin, -pretrain) resolved from a hub cache built here (no network)."""

from __future__ import annotations

import shutil

import pytest
import torch

from ardiff_policies.lingbot_va.config import CHECKPOINT_FILES
from ardiff_policies.lingbot_va.zero_wam_config import HUB_IDS, ZeroWAMPolicyConfig
from ardiff_server.config import ConfigError, load_config, validate_config
from tests.helpers.hub_cache import populate_hub_cache

COMMIT = "89abcdef0123456789abcdef0123456789abcdef"


@pytest.mark.parametrize(
    ("config", "checkpoint", "embodiment", "root"),
    [
        ("tiny_zero_wam", "builtin:tiny", "tiny_robotwin", "builtin:tiny"),
        ("zero_wam_robotwin", "robbyant-research/zero-wam-posttrain-robotwin", "robotwin", None),
    ],
)
def test_the_shipped_configs(config, checkpoint, embodiment, root):
    section = load_config(config).policy_options()
    assert isinstance(section, ZeroWAMPolicyConfig)
    assert (section.checkpoint, section.embodiment_name, section.demonstration_root) == (checkpoint, embodiment, root)
    assert (section.video_guidance_scale, section.icl_guidance_scale) == (-1.0, 5.0)  # upstream's launch defaults
    assert section.demonstration_frames == (4 if embodiment == "tiny_robotwin" else 32)


@pytest.mark.parametrize(
    ("section", "needle"),
    [
        ({"checkpoint": "builtin:tiny", "embodiment": "robotwin"}, "builtin:tiny is served with tiny_robotwin"),
        ({"checkpoint": "/models/zero-wam", "embodiment": "tiny_robotwin"}, "is served with robotwin"),
        ({"checkpoint": "/models/zero-wam", "demonstration_root": "builtin:tiny"}, "builtin:tiny holds the tiny checkpoint's"),
        ({"checkpoint": "synthetic:huge"}, "unknown synthetic preset 'huge'"),
        ({"video_guidance_scale": 21.0}, "video_guidance_scale"),
        ({"icl_guidance_scale": -1.0}, "icl_guidance_scale"),
        ({"max_demonstration_frames": 0}, "max_demonstration_frames"),
        ({"safety": {"mode": "clamp", "limits": {"x": {"max_step": 0.1}}}}, "cannot apply to zero_wam"),
    ],
)
def test_bad_values_are_refused_by_name(section, needle):
    with pytest.raises(ValueError, match=needle):
        ZeroWAMPolicyConfig.model_validate({"name": "zero_wam", **section})


def test_unknown_keys_and_missing_files_fail_at_start_up_with_their_name(tmp_path):
    with pytest.raises(ConfigError, match="demonstrations_root"):
        validate_config({"policy": {"name": "zero_wam", "demonstrations_root": "/data"}}, source="<test>")
    with pytest.raises(ValueError, match=r"policy\.demonstration_root: /no/such/root is not a directory"):
        ZeroWAMPolicyConfig(demonstration_root="/no/such/root").preflight()
    (tmp_path / "transformer").mkdir()
    with pytest.raises(ValueError, match="lacks vae/, text_encoder/, tokenizer/"):
        ZeroWAMPolicyConfig(checkpoint=str(tmp_path), embodiment="robotwin").preflight()


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """Both released ids cached at COMMIT, holding the tiny Zero-WAM checkpoint and an empty-text embedding file."""
    from huggingface_hub import constants

    from ardiff_policies.lingbot_va.zero_wam_tiny import ensure_tiny_zero_wam_checkpoint

    files = tmp_path / "files"
    shutil.copytree(ensure_tiny_zero_wam_checkpoint(), files)
    torch.save(torch.zeros(512, 32), files / "empty_text_emb.pt")
    for repo in HUB_IDS:
        populate_hub_cache(tmp_path / "hub", repo, files, commit=COMMIT)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return tmp_path / "hub"


@pytest.mark.parametrize("repo", HUB_IDS)
def test_a_hub_id_resolves_to_its_snapshot_with_what_the_server_reads(offline_hub, repo):
    resolved = ZeroWAMPolicyConfig(checkpoint=repo, embodiment="robotwin", empty_text_embedding="empty_text_emb.pt").preflight()
    snapshot = next(offline_hub.glob(f"models--{repo.replace('/', '--')}/snapshots/{COMMIT}"))
    assert resolved.checkpoint == str(snapshot) and resolved.empty_text_path() == snapshot / "empty_text_emb.pt"
    from huggingface_hub.utils import filter_repo_objects

    files = [p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file()]
    assert set(filter_repo_objects(files, allow_patterns=[*CHECKPOINT_FILES, "empty_text_emb.pt"])) == set(files)
    with pytest.raises(ValueError, match=r"policy\.empty_text_embedding: .*missing\.pt is not a file"):
        ZeroWAMPolicyConfig(checkpoint=repo, embodiment="robotwin", empty_text_embedding="missing.pt").preflight()


def test_a_stored_empty_text_replaces_umt5s_and_a_wrong_one_is_refused_at_start_up(tmp_path):
    from ardiff_policies.base import RuntimeOptions, StartRefused
    from ardiff_policies.lingbot_va.zero_wam_policy import build_zero_wam, load_empty_text

    stored = torch.randn(512, 32, generator=torch.Generator().manual_seed(3))
    torch.save(stored, tmp_path / "empty.pt")
    config = ZeroWAMPolicyConfig(empty_text_embedding=str(tmp_path / "empty.pt"), demonstration_root="builtin:tiny")
    policy = build_zero_wam(config, RuntimeOptions())
    assert torch.equal(policy.episodes.empty_text, stored[None])
    torch.save(torch.zeros(7, 32), tmp_path / "short.pt")
    with pytest.raises(StartRefused, match=r"policy.empty_text_embedding: .*short.pt holds \(7, 32\); expected a \(512, 32\)"):
        load_empty_text(tmp_path / "short.pt", 32)
