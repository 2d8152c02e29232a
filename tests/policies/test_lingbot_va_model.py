"""LingBot-VA's transformer (policies/lingbot_va/model.py) against upstream's own outputs, and its config reading.

``tests/reference_data/upstream_lingbot_va_tiny.*`` holds what upstream's ``WanTransformer3DModel`` computed on the
tiny checkpoint, float32 on the CPU (scripts/record_upstream_lingbot_va.py). Comparisons: max abs error <= 1e-5.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ardiff_policies.lingbot_va.checkpoint import TransformerConfig
from ardiff_policies.lingbot_va.model import LingBotVATransformer, action_grid, load_transformer, video_grid
from ardiff_policies.lingbot_va.tiny import TINY_TRANSFORMER, ensure_tiny_checkpoint
from ardiff_policies.wan.tiny import tree_digest
from tests.helpers.lingbot_va import ATOL, load_reference, randn, sha, text_embeddings


@pytest.fixture(scope="module")
def reference():
    return load_reference()


@pytest.fixture(scope="module")
def tiny_dir() -> Path:
    return ensure_tiny_checkpoint()


@pytest.fixture(scope="module")
def model(tiny_dir) -> LingBotVATransformer:
    return load_transformer(tiny_dir / "transformer")


def test_the_reference_was_recorded_on_these_weights(reference, tiny_dir):
    meta, _ = reference
    assert meta["checkpoint_transformer_sha256"] == tree_digest(tiny_dir / "transformer"), (
        "the tiny LingBot-VA changed: rerun scripts/record_upstream_lingbot_va.py"
    )


@pytest.mark.parametrize("mode", ["video", "action"])
def test_one_forward_matches_upstream(reference, model, mode):
    meta, tensors = reference
    single = meta["single"]
    text = text_embeddings(meta, model.config.text_dim)
    assert sha(text) == meta["input_sha256"]["text"]
    f = single["frames"]
    if mode == "video":
        x = randn((1, model.config.in_channels, f, single["height"], single["width"]), single["seed"])
        grid = video_grid(f, single["height"] // 2, single["width"] // 2, single["start"])
        timesteps = [0.0] + [single["t"]] * (f - 1)  # the conditioning frame at t = 0
    else:
        x = randn((1, model.config.action_dim, f, single["actions_per_frame"], 1), single["seed"] + 1)
        grid = action_grid(f, single["actions_per_frame"], single["start"])
        timesteps = [single["t"]] * f
    assert sha(x) == meta["input_sha256"][f"single.{mode}"]
    with torch.no_grad():
        out = model(
            x.repeat(2, 1, 1, 1, 1),
            torch.tensor([timesteps] * 2),
            grid[None].repeat(2, 1, 1),
            text,
            action_mode=mode == "action",
        )
    expected = tensors[f"single.{mode}"]
    assert out.shape == expected.shape
    error = (out - expected).abs().max().item()
    assert error <= ATOL, f"{mode}: max abs error {error:.3g} vs upstream"
    # the two CFG rows differ only by their text: a cross-attention that ignored it would pass on one row alone
    assert (expected[0] - expected[1]).abs().max() > 1e-3


def test_projected_text_gives_the_same_forward(reference, model):
    meta, tensors = reference
    single = meta["single"]
    text = text_embeddings(meta, model.config.text_dim)
    x = randn((1, 30, single["frames"], single["actions_per_frame"], 1), single["seed"] + 1).repeat(2, 1, 1, 1, 1)
    grid = action_grid(single["frames"], single["actions_per_frame"], single["start"])[None].repeat(2, 1, 1)
    t = torch.full((2, single["frames"]), single["t"])
    with torch.no_grad():
        out = model(x, t, grid, model.project_text(text), action_mode=True)
    assert (out - tensors["single.action"]).abs().max().item() <= ATOL


def test_action_positions_are_fractional_frames_like_upstreams():
    grid = action_grid(2, 4, 6)
    assert grid.shape == (3, 8)
    assert torch.allclose(grid[0, :4], torch.tensor([6.2, 6.4, 6.6, 6.8]))
    assert torch.allclose(grid[0, 4:], torch.tensor([7.2, 7.4, 7.6, 7.8]))
    assert (grid[1:] == -1).all()
    video = video_grid(2, 2, 3, 4)
    assert video[:, 0].tolist() == [4, 0, 0] and video[:, -1].tolist() == [5, 1, 2]


# ------------------------------------------------------------------------------------------- config


def test_the_tiny_config_round_trips(tiny_dir):
    assert TransformerConfig.from_file(tiny_dir / "transformer" / "config.json") == TINY_TRANSFORMER


def test_the_released_defaults_are_the_5b():
    cfg = TransformerConfig.from_dict({"_class_name": "WanTransformer3DModel", "_diffusers_version": "0.36.0"})
    assert (cfg.dim, cfg.num_layers, cfg.ffn_dim, cfg.in_channels, cfg.action_dim) == (3072, 30, 14336, 48, 30)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"image_dim": 1280}, "unknown key(s) ['image_dim']"),
        ({"_class_name": "WanTransformer3DModel2"}, "_class_name"),
        ({"pos_embed_seq_len": 257}, "pos_embed_seq_len"),
        ({"attn_mode": "xformers"}, "attn_mode"),
        ({"attention_head_dim": 22}, "RoPE parts"),
        ({"patch_size": [1, 2]}, "patch_size"),
        ({"num_layers": 0}, "num_layers"),
        ({"freq_dim": 33}, "freq_dim"),
    ],
)
def test_config_keys_are_read_or_refused_by_name(change, message):
    raw = {**TINY_TRANSFORMER.to_dict(), **change}
    with pytest.raises(ValueError, match=re.escape(message)):
        TransformerConfig.from_dict(raw)


def test_weights_must_be_upstreams_names_and_shapes(tiny_dir, tmp_path):
    state = load_file(tiny_dir / "transformer" / "diffusion_pytorch_model.safetensors")
    assert any(k.startswith("condition_embedder_action.text_embedder.") for k in state)  # in the file, dropped on load
    (tmp_path / "config.json").write_text((tiny_dir / "transformer" / "config.json").read_text())
    renamed = {k.replace("blocks.1.attn1.to_q", "blocks.1.attn1.q"): v for k, v in state.items()}
    save_file(renamed, tmp_path / "diffusion_pytorch_model.safetensors")
    with pytest.raises(ValueError, match=re.escape("blocks.1.attn1.to_q")):
        load_transformer(tmp_path)
    state["proj_out.weight"] = state["proj_out.weight"][:-1]
    save_file(state, tmp_path / "diffusion_pytorch_model.safetensors")
    with pytest.raises(ValueError, match=re.escape("proj_out.weight")):
        load_transformer(tmp_path)
