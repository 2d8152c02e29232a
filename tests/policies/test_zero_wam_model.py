"""Zero-WAM's transformer (ardiff_policies.lingbot_va.zero_wam_model) and its config, read key by key.

What it shares with LingBot-VA is LingBot-VA's code: its video stream equals LingBot-VA's transformer on the same
weights, and its action stream equals LingBot-VA's action stream once the action expert's weights are put under
LingBot-VA's names; so the two checks pin every name the action expert reads. Loading refuses, by name, every key
it does not read or account for.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ardiff_policies.lingbot_va.checkpoint import TransformerConfig
from ardiff_policies.lingbot_va.model import LingBotVATransformer, load_transformer, video_grid
from ardiff_policies.lingbot_va.tiny import ensure_tiny_checkpoint
from ardiff_policies.lingbot_va.zero_wam_checkpoint import ZeroWAMConfig
from ardiff_policies.lingbot_va.zero_wam_model import (
    ZeroWAMTransformer,
    dropped_tensors,
    expert_action_grid,
    load_zero_wam_transformer,
    parameter_count,
)
from ardiff_policies.lingbot_va.zero_wam_tiny import TINY_ZERO_WAM, ensure_tiny_zero_wam_checkpoint


@pytest.fixture(scope="module")
def tiny_dir() -> Path:
    return ensure_tiny_zero_wam_checkpoint()


@pytest.fixture(scope="module")
def state(tiny_dir) -> dict[str, torch.Tensor]:
    return load_file(tiny_dir / "transformer" / "diffusion_pytorch_model.safetensors")


@pytest.fixture(scope="module")
def model(tiny_dir) -> ZeroWAMTransformer:
    return load_zero_wam_transformer(tiny_dir / "transformer")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _inputs(cfg: ZeroWAMConfig, action_mode: bool):
    text = torch.randn(1, 7, cfg.base.text_dim, generator=_gen(1))
    if action_mode:
        x = torch.randn(1, cfg.base.action_dim, 2, 4, 1, generator=_gen(2))
        grid = expert_action_grid(2, 4, start_frame=2)[None]
    else:
        x = torch.randn(1, cfg.base.in_channels, 2, 4, 6, generator=_gen(3))
        grid = video_grid(2, 2, 3, start_frame=2)[None]
    return x, torch.tensor([[0.0, 700.0]]), grid, text


def _lingbot_va(base: TransformerConfig, state: dict[str, torch.Tensor]) -> LingBotVATransformer:
    model = LingBotVATransformer(base)
    model.load_state_dict(state, strict=True)
    return model.eval()


def test_the_tiny_checkpoint_is_in_the_released_layout(tiny_dir, state):
    for part in ("transformer/config.json", "vae/config.json", "text_encoder/config.json", "tokenizer"):
        assert (tiny_dir / part).exists(), part
    raw = json.loads((tiny_dir / "transformer" / "config.json").read_text())
    assert raw["_class_name"] == "WanICLTransformer3DModel" and raw["attn_moe"] is True and raw["fully_share"] is False
    # what serving drops is in the file, as upstream's state dict holds it
    for name in ("patch_embedding.weight", "mcp_mlp_hidden.0.weight", "mcp_blocks.0.0.attn1.action_to_q.weight", "blocks.1.attn2.action_to_k.weight"):
        assert name in state, name
    assert torch.equal(state["blocks.1.attn2.action_to_k.weight"], state["blocks.1.attn2.to_k.weight"])


def test_the_video_stream_is_lingbot_vas(model, state):
    lingbot = _lingbot_va(TINY_ZERO_WAM.base, {k: v for k, v in state.items() if k in LingBotVATransformer(TINY_ZERO_WAM.base).state_dict()})
    x, t, grid, text = _inputs(TINY_ZERO_WAM, action_mode=False)
    with torch.no_grad():
        ours = model(x, t, grid, text, action_mode=False)
        theirs = lingbot(x, t, grid, text, action_mode=False)
    assert ours.shape == x.shape
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)


def _action_expert_as_lingbot_va(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The action expert's weights under LingBot-VA's names (a LingBot-VA whose shared blocks are the expert)."""
    out = {}
    renames = [
        (".attn1.action_to_q.", ".attn1.to_q."),
        (".attn1.action_to_k.", ".attn1.to_k."),
        (".attn1.action_to_v.", ".attn1.to_v."),
        (".attn1.action_to_out.", ".attn1.to_out."),
        (".attn1.action_norm_q.", ".attn1.norm_q."),
        (".attn1.action_norm_k.", ".attn1.norm_k."),
        (".attn2.action_to_q.", ".attn2.to_q."),
        (".attn2.action_to_out.", ".attn2.to_out."),
        (".attn2.action_norm_q.", ".attn2.norm_q."),
        (".action_norm2.", ".norm2."),
        (".action_ffn.", ".ffn."),
        (".scale_shift_table_action", ".scale_shift_table"),
    ]
    for name, value in state.items():
        if not name.startswith("blocks."):
            continue
        for old, new in renames:
            if old in name:
                out[name.replace(old, new)] = value
    for name, value in state.items():  # attn2's text K/V: the video's, shared
        if name.startswith("blocks.") and re.search(r"\.attn2\.(to_k|to_v|norm_k)\.", name):
            out[name] = value
    for name in ("action_embedder.weight", "action_embedder.bias", "action_proj_out.weight", "action_proj_out.bias"):
        out[name] = state[name]
    out["scale_shift_table"] = state["scale_shift_table_action"]
    for name, value in state.items():
        if name.startswith(("condition_embedder.", "condition_embedder_action.time")):
            out[name] = value
    # LingBot-VA's video-only modules, unused by its action stream
    for name in ("patch_embedding_mlp.weight", "patch_embedding_mlp.bias", "proj_out.weight", "proj_out.bias"):
        out[name] = state[name]
    return out


def test_the_action_stream_reads_the_action_expert(model, state):
    base = dataclasses.replace(TINY_ZERO_WAM.base, ffn_dim=TINY_ZERO_WAM.action_ffn_dim)
    lingbot = _lingbot_va(base, _action_expert_as_lingbot_va(state))
    x, t, grid, text = _inputs(TINY_ZERO_WAM, action_mode=True)
    with torch.no_grad():
        ours = model(x, t, grid, text, action_mode=True)
        expert = lingbot(x, t, grid, text, action_mode=True)
        # and it is not LingBot-VA's action stream over the video weights
        plain = _lingbot_va(TINY_ZERO_WAM.base, {k: v for k, v in state.items() if k in LingBotVATransformer(TINY_ZERO_WAM.base).state_dict()})
        shared = plain(x, t, grid, text, action_mode=True)
    assert ours.shape == x.shape
    torch.testing.assert_close(ours, expert, rtol=0, atol=1e-6)
    assert (ours - shared).abs().max() > 1e-2


def test_projected_text_is_shared_by_both_streams(model):
    for action_mode in (False, True):
        x, t, grid, text = _inputs(TINY_ZERO_WAM, action_mode)
        with torch.no_grad():
            direct = model(x, t, grid, text, action_mode=action_mode)
            projected = model(x, t, grid, model.project_text(text), action_mode=action_mode)
        torch.testing.assert_close(direct, projected, rtol=0, atol=0)


def test_the_action_grid_is_upstreams_video_like_grid():
    grid = expert_action_grid(2, 3, start_frame=4)
    assert grid.tolist() == [[4, 4, 4, 5, 5, 5], [0, 1, 2, 0, 1, 2], [0, 0, 0, 0, 0, 0]]


# ----------------------------------------------------------------------------- config


def test_the_config_round_trips():
    assert ZeroWAMConfig.from_dict(TINY_ZERO_WAM.to_dict()) == TINY_ZERO_WAM
    released = ZeroWAMConfig()  # the released defaults: 30 layers of 3072, the MCP heads
    assert ZeroWAMConfig.from_dict(json.loads(json.dumps(released.to_dict()))) == released


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"attn_mode": "torch"}, "unknown key(s) ['attn_mode']"),
        ({"frobnicate": 1}, "unknown key(s) ['frobnicate']"),
        ({"attn_moe": False}, "attn_moe must be true"),
        ({"fully_share": True}, "fully_share must be false"),
        ({"action_inner_dim": 48}, "action_inner_dim 48 must equal"),
        ({"attn_window": 0}, "attn_window must be -1 (unbounded) or positive"),
        ({"pos_embed_seq_len": 16}, "pos_embed_seq_len must be null"),
        ({"_class_name": "WanTransformer3DModel"}, "is not Zero-WAM's 'WanICLTransformer3DModel'"),
        ({"mcp_hidden_collect_layers": [0, 5]}, "mcp_hidden_collect_layers [0, 5] must be layer indices < 2"),
        ({"num_layers": 0}, "num_layers must be a positive integer"),
    ],
)
def test_a_config_key_is_read_or_refused_by_name(change, message):
    raw = TINY_ZERO_WAM.to_dict() | change
    with pytest.raises(ValueError, match=re.escape(message)):
        ZeroWAMConfig.from_dict(raw)


def test_a_lingbot_va_checkpoint_is_not_read_as_zero_wam_and_back(tiny_dir, tmp_path):
    with pytest.raises(ValueError, match="is not Zero-WAM's"):
        load_zero_wam_transformer(ensure_tiny_checkpoint() / "transformer")
    with pytest.raises(ValueError, match="is not LingBot-VA's"):
        load_transformer(tiny_dir / "transformer")


# ----------------------------------------------------------------------------- weights


def _write(tmp_path: Path, tiny_dir: Path, state: dict[str, torch.Tensor], config: dict | None = None) -> Path:
    config = config or json.loads((tiny_dir / "transformer" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file(state, tmp_path / "diffusion_pytorch_model.safetensors")
    return tmp_path


def test_a_missing_or_renamed_weight_is_named(tiny_dir, state, tmp_path):
    renamed = {k.replace("blocks.1.attn1.action_to_q", "blocks.1.attn1.action_q"): v for k, v in state.items()}
    with pytest.raises(ValueError, match=re.escape("missing ['blocks.1.attn1.action_to_q.bias'")):
        load_zero_wam_transformer(_write(tmp_path, tiny_dir, renamed))
    with pytest.raises(ValueError, match=re.escape("unexpected ['blocks.1.attn1.action_q.bias'")):
        load_zero_wam_transformer(_write(tmp_path, tiny_dir, renamed))
    no_conv = {k: v for k, v in state.items() if not k.startswith("patch_embedding.")}
    with pytest.raises(ValueError, match=re.escape("missing ['patch_embedding.bias'")):
        load_zero_wam_transformer(_write(tmp_path, tiny_dir, no_conv))


def test_a_wrong_shape_or_a_diverging_alias_is_named(tiny_dir, state, tmp_path):
    short = dict(state) | {"action_proj_out.weight": state["action_proj_out.weight"][:-1]}
    with pytest.raises(ValueError, match=re.escape("wrong shape ['action_proj_out.weight']")):
        load_zero_wam_transformer(_write(tmp_path, tiny_dir, short))
    diverged = dict(state) | {"blocks.0.attn2.action_to_v.bias": state["blocks.0.attn2.to_v.bias"] + 1}
    with pytest.raises(ValueError, match=re.escape("blocks.0.attn2.action_to_v.bias differs from blocks.0.attn2.to_v.bias")):
        load_zero_wam_transformer(_write(tmp_path, tiny_dir, diverged))


def test_aliases_may_be_absent_and_mcp_follows_the_config(tiny_dir, state, tmp_path, model):
    deduplicated = {k: v for k, v in state.items() if not re.search(r"attn2\.action_(to_k|to_v|norm_k)\.", k)}
    loaded = load_zero_wam_transformer(_write(tmp_path, tiny_dir, deduplicated))
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))
    # enable_mcp false: the heads must then be absent, not silently dropped
    config = TINY_ZERO_WAM.to_dict() | {"enable_mcp": False}
    with pytest.raises(ValueError, match=re.escape("unexpected ['mcp_")):
        load_zero_wam_transformer(_write(tmp_path, tiny_dir, state, config))
    without = {k: v for k, v in state.items() if not k.startswith("mcp_")}
    load_zero_wam_transformer(_write(tmp_path, tiny_dir, without, config))


def test_the_released_size():
    # 10.8 B in the file (the figure): what is served plus what is dropped (the MCP heads and the copies)
    cfg = ZeroWAMConfig()
    served = parameter_count(cfg)
    dropped = sum(torch.Size(s).numel() for s in dropped_tensors(cfg).values())
    assert 10.75e9 < served + dropped < 10.85e9, (served, dropped)
    assert 9.35e9 < served < 9.45e9, served  # what the GPU holds


def test_the_tiny_checkpoint_is_the_same_bytes_every_time(tiny_dir, tmp_path):
    from ardiff_policies.lingbot_va.zero_wam_tiny import write_tiny_zero_wam_checkpoint
    from ardiff_policies.wan.tiny import tree_digest

    assert tree_digest(write_tiny_zero_wam_checkpoint(tmp_path / "again")) == tree_digest(tiny_dir)
