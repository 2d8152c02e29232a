"""The DreamZero-DROID checkpoint layout, the loader, and the embedded tiny checkpoint."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch

from ardiff_policies.dreamzero.checkpoint import CheckpointDir, CheckpointError
from ardiff_policies.dreamzero.dit import DiTConfig
from ardiff_policies.dreamzero.model import DreamZeroModel
from ardiff_policies.dreamzero.tiny import TINY_DIT, write_tiny_checkpoint
from ardiff_policies.dreamzero.upstream_layout import checkpoint_layout
from tests.helpers.reference import REFERENCE_DIR

REFERENCE_TENSORS = REFERENCE_DIR / "dreamzero_droid_tensors.json"


@pytest.mark.skipif(not REFERENCE_TENSORS.exists(), reason=f"released checkpoint tensor list not found at {REFERENCE_TENSORS}")
def test_droid_configuration_reproduces_the_released_tensor_set():
    """Names and shapes our modules (DROID geometry) expect == the released checkpoint's, all 2146."""
    released = {k: tuple(v[0]) for k, v in json.loads(REFERENCE_TENSORS.read_text())["tensors"].items()}
    ours = checkpoint_layout(DiTConfig())  # DiTConfig() is DreamZero-DROID's 14B geometry
    assert len(released) == 2146
    assert sorted(set(released) - set(ours)) == [], "released tensors with no home in our modules"
    assert sorted(set(ours) - set(released)) == [], "module tensors the released checkpoint does not have"
    assert {k: v for k, v in ours.items() if released[k] != v} == {}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt")


def test_tiny_checkpoint_is_byte_identical_across_generations(tiny_dir, tmp_path):
    again = write_tiny_checkpoint(tmp_path / "again")
    files = sorted(p.relative_to(tiny_dir) for p in tiny_dir.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file())
    assert any(f.suffix == ".safetensors" for f in files) and Path("tokenizer/tokenizer.json") in files
    for rel in files:
        assert (tiny_dir / rel).read_bytes() == (again / rel).read_bytes(), rel


def test_tiny_checkpoint_has_the_released_layout(tiny_dir):
    ckpt = CheckpointDir(tiny_dir)
    assert (tiny_dir / "model.safetensors.index.json").exists() and len(set(ckpt.weights.weight_map.values())) == 2
    prefixes = {n.split(".")[1] for n in ckpt.weights.weight_map}
    assert prefixes == {"model", "text_encoder", "image_encoder", "vae"}
    assert "action_head.text_encoder.blocks.0.ffn.gate.0.weight" in ckpt.weights.weight_map  # Wan-T5 naming
    assert "action_head.image_encoder.model.visual.transformer.0.attn.to_qkv.weight" in ckpt.weights.weight_map
    assert DiTConfig.from_dict(ckpt.diffusion_model_cfg).frame_seqlen == TINY_DIT.frame_seqlen == 60
    assert "oxe_droid" in ckpt.metadata


def test_tiny_checkpoint_loads_quickly_and_completely(tiny_dir):
    start = time.perf_counter()
    model = DreamZeroModel.load(tiny_dir)
    elapsed = time.perf_counter() - start
    assert elapsed < 10.0, f"tiny checkpoint took {elapsed:.1f} s to load"
    tensors = [t for m in (model.dit, model.text_encoder, model.image_encoder, model.vae) for t in m.state_dict().values()]
    assert all(not t.is_meta and torch.isfinite(t).all() for t in tensors)
    assert model.text_encoder.model.shared.weight is model.text_encoder.model.encoder.embed_tokens.weight


def test_load_in_another_dtype(tiny_dir):
    model = DreamZeroModel.load(tiny_dir, dtype=torch.bfloat16)
    assert model.dit.blocks[0].self_attn.q.weight.dtype == torch.bfloat16
    assert model.vae.model.encoder.conv_in.weight.dtype == torch.bfloat16


def _copy(tiny_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_dir, tmp_path / "copy"))


def test_missing_shard_is_named(tiny_dir, tmp_path):
    broken = _copy(tiny_dir, tmp_path)
    (broken / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model-00002-of-00002\.safetensors"):
        DreamZeroModel.load(broken)


def test_truncated_shard_is_named(tiny_dir, tmp_path):
    broken = _copy(tiny_dir, tmp_path)
    shard = broken / "model-00001-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match=r"model-00001-of-00002\.safetensors"):
        DreamZeroModel.load(broken)


def test_tensor_dropped_from_the_index_is_reported_missing(tiny_dir, tmp_path):
    broken = _copy(tiny_dir, tmp_path)
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    del index["weight_map"]["action_head.model.head.head.bias"]
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"missing 1: head\.head\.bias"):
        DreamZeroModel.load(broken)


@pytest.mark.parametrize("victim", ["config.json", "experiment_cfg/metadata.json", "tokenizer"])
def test_missing_files_are_named(tiny_dir, tmp_path, victim):
    broken = _copy(tiny_dir, tmp_path)
    target = broken / victim
    shutil.rmtree(target) if target.is_dir() else target.unlink()
    with pytest.raises(CheckpointError, match=victim.split("/")[-1]):
        DreamZeroModel.load(broken)


def test_bad_config_is_named(tiny_dir, tmp_path):
    broken = _copy(tiny_dir, tmp_path)
    (broken / "config.json").write_text('{"action_head_cfg": {}}')
    with pytest.raises(CheckpointError, match="diffusion_model_cfg"):
        DreamZeroModel.load(broken)


# ------------------------------------------------------------------------------------------- config.json


def _config(tiny_dir: Path) -> dict:
    return json.loads((tiny_dir / "config.json").read_text())


def _read(config: dict):
    """read_config on an in-memory config.json (what CheckpointDir exposes of it)."""
    from types import SimpleNamespace

    from ardiff_policies.dreamzero.model import read_config

    head = config["action_head_cfg"]["config"]
    return read_config(SimpleNamespace(root_config=config, action_head=head, diffusion_model_cfg=head["diffusion_model_cfg"]))


def test_tiny_config_carries_every_released_key_in_its_section(tiny_dir):
    from ardiff_policies.dreamzero.upstream_layout import (
        RELEASED_ACTION_HEAD_KEYS,
        RELEASED_DIT_KEYS,
        RELEASED_ENCODER_KEYS,
        RELEASED_HEAD_WRAPPER_KEYS,
        RELEASED_ROOT_KEYS,
    )

    config = _config(tiny_dir)
    head = config["action_head_cfg"]["config"]
    assert set(config) >= RELEASED_ROOT_KEYS
    assert set(config["action_head_cfg"]) == RELEASED_HEAD_WRAPPER_KEYS
    assert set(head) == RELEASED_ACTION_HEAD_KEYS
    assert set(head["diffusion_model_cfg"]) >= RELEASED_DIT_KEYS
    for section, keys in RELEASED_ENCODER_KEYS.items():
        assert set(head[section]) == keys | {"architecture"}, section
    # the keys the brief names, where upstream reads them
    assert head["diffusion_model_cfg"]["num_frame_per_block"] == head["num_frame_per_block"] == 2
    assert head["action_dim"] == head["max_action_dim"] == 32 and head["max_state_dim"] == 64
    assert head["decouple_inference_noise"] is False and head["video_inference_final_noise"] == 0.8


def test_every_released_action_head_key_is_read_refused_or_listed_as_ignored(tiny_dir, caplog):
    from ardiff_policies.dreamzero.model import (
        FIXED_ACTION_HEAD_KEYS,
        IGNORED_ACTION_HEAD_KEYS,
        READ_ACTION_HEAD_KEYS,
        SECTIONS,
    )
    from ardiff_policies.dreamzero.upstream_layout import RELEASED_ACTION_HEAD_KEYS

    handled = [READ_ACTION_HEAD_KEYS, set(FIXED_ACTION_HEAD_KEYS), IGNORED_ACTION_HEAD_KEYS, set(SECTIONS)]
    assert set().union(*handled) >= RELEASED_ACTION_HEAD_KEYS
    assert sum(len(group) for group in handled) == len(set().union(*handled))  # each key in one group only
    with caplog.at_level("WARNING"):
        head, _ = _read(_config(tiny_dir))
    assert caplog.records == []  # the released key set raises no warning
    assert (head.num_frames, head.num_frame_per_block, head.action_horizon) == (33, 2, 24)


def test_dit_keys_come_from_the_dit_section_with_upstreams_defaults(tiny_dir):
    from ardiff_policies.dreamzero.model import UPSTREAM_DIT_DEFAULTS
    from ardiff_policies.dreamzero.upstream_layout import RELEASED_DIT_KEYS

    config = _config(tiny_dir)
    head = config["action_head_cfg"]["config"]
    _, dit = _read(config)
    assert head["hidden_size"] == 64 and dit.hidden_size == TINY_DIT.hidden_size == 32  # the head's is not the DiT's
    # a key the released file leaves out gets upstream's CausalWanModel default, which is DiTConfig's default too
    defaults = DiTConfig()
    for key, value in UPSTREAM_DIT_DEFAULTS.items():
        if key not in RELEASED_DIT_KEYS:
            assert getattr(defaults, key) == value, key
    del head["diffusion_model_cfg"]["action_dim"], head["diffusion_model_cfg"]["max_state_dim"]
    _, dit = _read(config)
    assert (dit.action_dim, dit.max_state_dim) == (32, 64)
    del head["diffusion_model_cfg"]["num_action_per_block"]  # upstream default 32 != the head's 24 actions
    with pytest.raises(CheckpointError, match="num_action_per_block = 32"):
        _read(config)


@pytest.mark.parametrize(
    ("path", "value", "needle"),
    [
        ("tiled", True, r"action_head_cfg.config.tiled = True, .*supported: False"),
        ("tiled", None, r"action_head_cfg.config.tiled is absent \(upstream then uses True\).*supported: False"),
        ("train_architecture", "lora", r"train_architecture = 'lora'.*supported: 'full'"),
        ("vae_cfg.dim", 96, r"vae_cfg.dim is an argument of WanVideoVAE38 only"),
        ("vae_cfg._target_", "groot.vla.model.dreamzero.modules.wan_video_vae.WanVideoVAE99", r"vae_cfg\._target_ = .*VAE99"),
        ("num_frame_per_block", 1, r"num_frame_per_block = 1 disagrees with .*diffusion_model_cfg.num_frame_per_block = 2"),
        ("action_dim", 8, r"action_dim = 8 disagrees with .*diffusion_model_cfg.action_dim = 32"),
        ("max_state_dim", 44, r"max_state_dim = 44 disagrees"),
        ("video_inference_final_noise", 1.5, r"video_inference_final_noise must be in \[0, 1\]"),
        ("decouple_inference_noise", "yes", r"decouple_inference_noise must be true or false"),
        ("diffusion_model_cfg.mystery", 1, r"diffusion_model_cfg: unknown DiT config keys: \['mystery'\]"),
    ],
)
def test_an_unsupported_inference_setting_is_refused_by_name(tiny_dir, path, value, needle):
    config = _config(tiny_dir)
    *sections, key = path.split(".")
    target = config["action_head_cfg"]["config"]
    for section in sections:
        target = target[section]
    if value is None:
        del target[key]
    else:
        target[key] = value
    with pytest.raises(CheckpointError, match=needle):
        _read(config)


def test_an_unsupported_setting_stops_the_load(tiny_dir, tmp_path):
    broken = _copy(tiny_dir, tmp_path)
    config = _config(broken)
    config["action_head_cfg"]["config"]["tiled"] = True
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="tiled"):
        DreamZeroModel.load(broken)


def test_unknown_keys_are_named_in_one_warning_line(tiny_dir, caplog):
    config = _config(tiny_dir)
    head = config["action_head_cfg"]["config"]
    head["mystery_knob"] = 3
    head["vae_cfg"]["spare"] = True
    with caplog.at_level("WARNING"):
        _read(config)
    lines = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(lines) == 1 and "\n" not in lines[0]
    assert "action_head_cfg.config.mystery_knob" in lines[0] and "action_head_cfg.config.vae_cfg.spare" in lines[0]


def test_decoupled_inference_noise_is_read(tiny_dir):
    config = _config(tiny_dir)
    config["action_head_cfg"]["config"] |= {"decouple_inference_noise": True, "video_inference_final_noise": 0.7}
    head, _ = _read(config)
    assert head.decouple_inference_noise is True and head.video_inference_final_noise == 0.7
