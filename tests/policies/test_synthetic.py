"""The synthetic DreamZero (``checkpoint: synthetic:<preset>``): geometry, materialization, policy."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from ardiff_policies.dreamzero.config import DreamZeroConfig
from ardiff_policies.dreamzero.dit import CausalWanModel, DiTConfig
from ardiff_policies.dreamzero.synthetic import (
    build_model,
    meta_modules,
    parse_spec,
    release_cached_model,
    synthetic_model,
)
from ardiff_policies.dreamzero.upstream_layout import checkpoint_layout
from ardiff_policies.wan.synthetic import materialize
from tests.helpers.reference import REFERENCE_DIR

REFERENCE_TENSORS = REFERENCE_DIR / "dreamzero_droid_tensors.json"
RELEASED_PARAMETERS = 22_924_172_116  # sum of the released checkpoint's 2146 tensor sizes


def test_droid_preset_is_the_released_geometry():
    spec = parse_spec("synthetic:droid")
    assert spec.dit == DiTConfig()  # 40 x 5120, 40 heads x 128, ffn 13824, 880 tokens per frame
    assert spec.dit.frame_seqlen == 880 and spec.view_size == (176, 320)
    assert spec.text_config["d_model"] == 4096 and spec.text_config["num_layers"] == 24 and spec.text_config["vocab_size"] == 256384
    assert spec.image_config["hidden_size"] == 1280 and spec.image_config["num_hidden_layers"] == 32
    assert spec.vae_config["base_dim"] == 96
    modules = meta_modules(spec)  # nothing allocated
    unique = {id(p): p for m in modules for p in m.parameters()}
    assert sum(p.numel() for p in unique.values()) == RELEASED_PARAMETERS


@pytest.mark.skipif(not REFERENCE_TENSORS.exists(), reason=f"released checkpoint tensor list not found at {REFERENCE_TENSORS}")
def test_droid_preset_reproduces_the_released_tensor_set():
    spec = parse_spec("synthetic:droid")
    released = {k: tuple(v[0]) for k, v in json.loads(REFERENCE_TENSORS.read_text())["tensors"].items()}
    ours = checkpoint_layout(spec.dit, spec.text_encoder, spec.image_encoder, spec.vae)
    assert ours == released
    assert sum(math.prod(s) for s in released.values()) == RELEASED_PARAMETERS


def test_overrides_and_presets():
    spec = parse_spec("synthetic:droid,layers=2")
    assert spec.dit.num_layers == 2 and spec.dit.dim == 5120 and spec.text_config["num_layers"] == 24
    spec = parse_spec("synthetic:droid,layers=2,dim=256,heads=2,text_dim=64,text_heads=4,clip_dim=64,clip_heads=4,clip_mlp=128,seed=7")
    assert (spec.dit.dim, spec.dit.num_heads, spec.dit.ffn_dim) == (256, 2, 704)  # DROID's ffn / dim ratio kept
    assert spec.dit.text_dim == 64 and spec.text_config["d_kv"] == 16 and spec.dit.clip_dim == 64 and spec.seed == 7
    tiny = parse_spec("synthetic:tiny")
    assert tiny.dit.frame_seqlen == 60 and tiny.view_size == (48, 80) and tiny.dit.num_layers == 40
    assert parse_spec("synthetic:droid-small").dit.frame_seqlen == 880


@pytest.mark.parametrize(
    ("checkpoint", "needle"),
    [
        ("synthetic:nope", "unknown synthetic preset"),
        ("synthetic:droid,wings=2", "unknown key 'wings'"),
        ("synthetic:droid,layers=two", "key=<non-negative int>"),
        ("synthetic:droid,layers", "key=<non-negative int>"),
        ("synthetic:droid,dim=100,heads=3", "must split into 3 heads"),
        ("/models/DreamZero-DROID", "not a synthetic checkpoint"),
    ],
)
def test_bad_specs_are_named(checkpoint, needle):
    from ardiff_policies.errors import StartRefused

    with pytest.raises(ValueError, match=needle) as caught:
        parse_spec(checkpoint)
    assert isinstance(caught.value, StartRefused)  # a setting: the worker logs it in one line, no traceback


def test_preflight_accepts_a_synthetic_checkpoint_where_a_missing_directory_is_refused(tmp_path):
    missing = str(tmp_path / "DreamZero-DROID")
    with pytest.raises(ValueError, match="does not exist"):
        DreamZeroConfig(checkpoint=missing).preflight()
    assert DreamZeroConfig(checkpoint="synthetic:droid").preflight().checkpoint == "synthetic:droid"  # no directory to look for


@pytest.fixture(scope="module")
def tiny_model():
    return build_model(parse_spec("synthetic:tiny,layers=2"), dtype=torch.float32, device="cpu")


def test_materialized_model_is_complete_deterministic_and_tied(tiny_model):
    again = build_model(parse_spec("synthetic:tiny,layers=2"), dtype=torch.float32, device="cpu")
    other = build_model(parse_spec("synthetic:tiny,layers=2,seed=1"), dtype=torch.float32, device="cpu")
    for a, b in zip(tiny_model.dit.parameters(), again.dit.parameters()):
        assert not a.is_meta and not a.requires_grad
        assert torch.equal(a, b)
    assert not all(torch.equal(a, c) for a, c in zip(tiny_model.dit.parameters(), other.dit.parameters()))
    t5 = tiny_model.text_encoder.model
    assert t5.shared.weight is t5.encoder.embed_tokens.weight  # tied, as transformers builds it
    assert torch.equal(tiny_model.dit.blocks[0].norm3.weight, torch.ones_like(tiny_model.dit.blocks[0].norm3.weight))
    assert torch.equal(tiny_model.dit.img_emb.proj[0].weight, torch.ones(tiny_model.dit.config.clip_dim))  # a LayerNorm gain
    positions = tiny_model.image_encoder.model.vision_model.embeddings.position_ids
    assert torch.equal(positions[0], torch.arange(positions.shape[1]))


def test_materialize_in_bfloat16_keeps_integer_buffers():
    spec = parse_spec("synthetic:tiny,layers=1")
    _, _, image, _ = meta_modules(spec)
    materialize(image, device=torch.device("cpu"), dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0), depth=32)
    assert all(p.dtype == torch.bfloat16 for p in image.parameters())
    assert image.model.vision_model.embeddings.position_ids.dtype == torch.long


def test_forty_layers_keep_activations_finite_and_bounded():
    """The init's depth scaling: a full-depth DiT (narrow) stays O(1) through all 40 blocks."""
    cfg = DiTConfig(frame_seqlen=15, dim=128, ffn_dim=256, num_heads=2, text_dim=32, clip_dim=32, hidden_size=32, text_len=16)
    with torch.device("meta"):
        dit = CausalWanModel(cfg)
    materialize(dit, device=torch.device("cpu"), dtype=torch.float32, generator=torch.Generator().manual_seed(0), depth=40)
    torch.manual_seed(0)
    x = torch.randn(1, 16, 2, 6, 10)
    y = torch.randn(1, 20, 2, 6, 10)
    video, action = dit(
        x,
        torch.full((1, 2), 500),
        current_start_frame=1,
        self_kv=None,
        y=y,
        context=torch.randn(1, 16, 32),
        clip_feature=torch.randn(1, 257, 32),
        action=torch.randn(1, 24, 32),
        timestep_action=torch.full((1, 24), 500),
        state=torch.randn(1, 1, 64),
    )
    assert torch.isfinite(video).all() and torch.isfinite(action).all()
    assert 0.05 < video.std().item() < 20 and 0.01 < action.std().item() < 20


def test_policy_builds_from_a_synthetic_checkpoint_and_shares_the_model():
    from ardiff_kv import PagedKVCache
    from ardiff_policies.base import RuntimeOptions
    from ardiff_policies.dreamzero.policy import DreamZeroPolicy
    from ardiff_policies.observation import RobotObservation

    release_cached_model()
    config = DreamZeroConfig(checkpoint="synthetic:tiny,layers=2", view_size=(48, 80))
    policy = DreamZeroPolicy(config, RuntimeOptions())
    assert DreamZeroPolicy(config, RuntimeOptions()).model is policy.model  # one set of weights per process
    assert synthetic_model(config.checkpoint, dtype=torch.float32, device="cpu") is policy.model
    spec = policy.kv_spec()
    assert spec.page_size == 60 and spec.num_layers == 2
    cache = PagedKVCache(spec, num_pages=2 * spec.pages_per_branch + 1, max_sessions=1)
    session = policy.start_session("s", cache.open_session("s"))
    frames = np.random.default_rng(0).integers(0, 256, (1, 180, 320, 3), dtype=np.uint8)
    observation = RobotObservation(
        exterior_left=frames,
        exterior_right=frames,
        wrist=frames,
        joint_position=np.zeros(7, np.float32),
        gripper_position=np.zeros(1, np.float32),
        prompt="pick up the cup",
    )
    result = policy.step(session, observation)
    assert result.actions.shape == (24, 8) and np.isfinite(result.actions).all()
    assert result.info["dit_forwards"] == 8
    release_cached_model()

    with pytest.raises(ValueError, match="frame_seqlen=60"):  # the view size must give the preset's tokens per frame
        DreamZeroPolicy(DreamZeroConfig(checkpoint="synthetic:tiny,layers=2", view_size=(176, 320)), RuntimeOptions())
    release_cached_model()
    assert DreamZeroPolicy(DreamZeroConfig(checkpoint="synthetic:tiny,layers=2"), RuntimeOptions()).view_size == (48, 80)  # the preset's
    release_cached_model()
