"""The DreamZero-DROID checkpoint layout, the loader, and the embedded tiny checkpoint."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch

from policies.dreamzero.checkpoint import CheckpointDir, CheckpointError
from policies.dreamzero.dit import DiTConfig
from policies.dreamzero.model import DreamZeroModel
from policies.dreamzero.tiny import TINY_DIT, write_tiny_checkpoint
from policies.dreamzero.upstream_layout import checkpoint_layout
from tests.reference import REFERENCE_DIR

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
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
        DreamZeroModel.load(broken)


def test_truncated_shard_is_named(tiny_dir, tmp_path):
    broken = _copy(tiny_dir, tmp_path)
    shard = broken / "model-00001-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="model-00001-of-00002.safetensors"):
        DreamZeroModel.load(broken)


def test_tensor_dropped_from_the_index_is_reported_missing(tiny_dir, tmp_path):
    broken = _copy(tiny_dir, tmp_path)
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    del index["weight_map"]["action_head.model.head.head.bias"]
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="missing 1: head.head.bias"):
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
