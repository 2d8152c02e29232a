"""The Wan2.2-5B DreamZero (``builtin:tiny_5b``) against upstream's own recorded outputs.

``tests/reference_data/upstream_5b_tiny.*`` holds what upstream's ``CausalWanModel``, ``WanVideoVAE38`` and
``WANPolicyHead.lazy_joint_video_action`` computed on the tiny 5B checkpoint, float32 on the CPU
(scripts/record_upstream_5b.py). Every comparison is float32 with max abs error <= 1e-5.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from ardiff_kv import Branch, KVSpec, PagedKVCache
from ardiff_policies.base import RuntimeOptions
from ardiff_policies.dreamzero.checkpoint import CheckpointDir, CheckpointError, load_component
from ardiff_policies.dreamzero.dit import CausalWanModel, DiTConfig
from ardiff_policies.dreamzero.model import DreamZeroModel, read_config
from ardiff_policies.dreamzero.naming import DIT_PREFIX, identity_targets
from ardiff_policies.dreamzero.policy import DreamZeroConfig, DreamZeroPolicy
from ardiff_policies.dreamzero.tiny import TINY_5B_DIT, ensure_tiny_checkpoint
from ardiff_policies.guidance import Guidance
from ardiff_policies.observation import RobotObservation
from tests.helpers.scripts import load_script

REFERENCE = Path(__file__).parents[1] / "reference_data" / "upstream_5b_tiny"
ATOL = 1e-5


@pytest.fixture(scope="module")
def reference() -> tuple[dict, dict[str, torch.Tensor]]:
    return json.loads(REFERENCE.with_suffix(".json").read_text()), load_file(REFERENCE.with_suffix(".safetensors"))


@pytest.fixture(scope="module")
def tiny_5b_dir() -> Path:
    return ensure_tiny_checkpoint(variant="tiny_5b")


@pytest.fixture(scope="module")
def tiny_5b(tiny_5b_dir) -> DreamZeroModel:
    return DreamZeroModel.load(tiny_5b_dir)


def _close(ours: torch.Tensor, theirs: torch.Tensor, what: str) -> None:
    assert ours.shape == theirs.shape, f"{what}: {tuple(ours.shape)} vs upstream {tuple(theirs.shape)}"
    error = (ours.float() - theirs.float()).abs().max().item()
    assert error <= ATOL, f"{what}: max abs error {error:.3g} vs upstream"


def test_the_reference_was_recorded_on_these_weights(reference, tiny_5b_dir):
    meta, _ = reference
    assert meta["checkpoint_sha256"] == load_script("record_upstream_5b").digest(tiny_5b_dir), (
        "the tiny 5B changed: rerun scripts/record_upstream_5b.py"
    )


def test_the_5b_is_detected_from_config_json(tiny_5b_dir, tiny_5b):
    head, dit = read_config(CheckpointDir(tiny_5b_dir))
    assert (dit.model_type, dit.in_dim, dit.out_dim, dit.concat_first_frame_latent) == ("ti2v", 48, 48, False)
    assert head.target_video_size == (96, 192)
    vae = tiny_5b.vae
    assert vae.is_wan22 and (vae.latent_channels, vae.spatial_compression, vae.temporal_compression) == (48, 16, 4)
    assert tiny_5b.dit.blocks[0].cross_attn.num_image_tokens == 257  # CLIP tokens in the context, like the 14B


def test_dit_matches_upstream_through_the_paged_kv(reference, tiny_5b_dir):
    meta, ref = reference
    cfg = TINY_5B_DIT
    with torch.device("meta"):
        model = CausalWanModel(cfg)
    load_component(model, CheckpointDir(tiny_5b_dir).weights, DIT_PREFIX, identity_targets, dtype=torch.float32, device="cpu")
    model.eval()
    spec = KVSpec(
        num_layers=cfg.num_layers,
        num_heads=cfg.num_heads,
        head_dim=cfg.head_dim,
        page_size=cfg.frame_seqlen,
        window_pages=cfg.local_attn_size,
        max_new_pages=cfg.num_frame_per_block,
        max_extra_tokens=cfg.action_register_length,
    )
    cache = PagedKVCache(spec, num_pages=spec.pages_per_branch + 1, max_sessions=1, branches=(Branch.COND,))
    session = cache.open_session("s")
    for i, call in enumerate(meta["dit_calls"]):
        x = ref[f"dit.{i}.x"]
        ctx = session.begin_forward(
            Branch.COND,
            num_video_tokens=x.shape[2] * cfg.frame_seqlen,
            commit=call["update"],
            extra_tokens=cfg.action_register_length if call["action"] else 0,
        )
        with torch.no_grad():
            video, action = model(
                x,
                ref[f"dit.{i}.timestep"],
                current_start_frame=call["start"],
                self_kv=ctx.prepare(),
                y=None,
                context=ref["dit.context"],
                clip_feature=ref["dit.clip_feature"],
                action=ref.get(f"dit.{i}.action"),
                timestep_action=ref.get(f"dit.{i}.timestep_action"),
                state=ref.get(f"dit.{i}.state"),
            )
        session.complete(Branch.COND)
        _close(video, ref[f"dit.{i}.video_pred"], f"DiT call {i} video")
        if call["action"]:
            _close(action, ref[f"dit.{i}.action_pred"], f"DiT call {i} actions")
    cache.end_session(session)


def test_wan22_vae_encode_and_decode_match_upstream(reference, tiny_5b):
    _, ref = reference
    with torch.no_grad():
        latents = tiny_5b.vae.encode(ref["vae.video"])
        decoded = tiny_5b.vae.decode(ref["vae.latents"])
    _close(latents, ref["vae.latents"], "VAE encode")
    _close(decoded, ref["vae.decoded"], "VAE decode")


def _canvas_frames(seed: int, frames: int, canvas: tuple[int, int]) -> np.ndarray:  # scripts/record_upstream_5b.py's
    rng = np.random.default_rng(seed)
    coarse = torch.from_numpy(rng.uniform(0, 255, (frames, 3, canvas[0] // 8, canvas[1] // 8)).astype(np.float32))
    fine = torch.nn.functional.interpolate(coarse, size=canvas, mode="bilinear", align_corners=False)
    return fine.round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()


def test_two_policy_calls_match_upstreams_action_head(reference, tiny_5b, monkeypatch):
    """Upstream's lazy_joint_video_action on the same stitched canvases, state and prompt: the window start (1 frame:
    CLIP tokens, the first frame's latent, KV prefill) and a 4-frame call (VAE re-encode, prefill of 2 latents), both
    CFG branches, upstream's default step mask; actions before denormalization and the denoised video latents."""
    meta, ref = reference
    policy = DreamZeroPolicy(DreamZeroConfig(checkpoint="builtin:tiny_5b"), RuntimeOptions(record=True, guidance=Guidance.single()), model=tiny_5b)
    spec = policy.kv_spec()
    cache = PagedKVCache(spec, num_pages=2 * spec.pages_per_branch + 1, max_sessions=1)
    session = policy.start_session("s", cache.open_session("s"))
    canvases = [_canvas_frames(call["seed"], call["frames"], tuple(meta["policy"]["canvas"])) for call in meta["policy"]["calls"]]
    for call, frames in zip(meta["policy"]["calls"], canvases):
        assert hashlib.sha256(frames.tobytes()).hexdigest() == call["canvas_sha256"]
    served = iter(canvases)
    monkeypatch.setattr(policy.inputs, "canvas", lambda observation: next(served))  # the stitched views upstream was given
    for i, call in enumerate(meta["policy"]["calls"]):
        blank = np.zeros((call["frames"], 8, 8, 3), np.uint8)
        observation = RobotObservation(
            exterior_left=blank,
            exterior_right=blank,
            wrist=blank,
            prompt=meta["policy"]["prompt"],
            joint_position=np.array(call["joint_position"]),
            gripper_position=np.array(call["gripper_position"]),
        )
        result = policy.step(session, observation)
        if i == 0:
            ids, _ = policy.inputs.tokenize(session.prompt)
            assert torch.equal(ids.to(torch.int32), ref["policy.text_ids"])
            _close(session.clip_feature, ref["policy.clip_feature"], "CLIP tokens")
            _close(session.first_latent, ref["policy.first_latent"], "first-frame latent")
            _close(result.recording.predicted, ref["policy.0.video_pred"][:, :, 1:], "call 0 video")
        else:
            _close(result.recording.predicted, ref[f"policy.{i}.video_pred"], f"call {i} video")
        _close(torch.from_numpy(result.recording.raw_actions), ref[f"policy.{i}.action_pred"][0], f"call {i} actions")
    cache.end_session(session.kv)


def test_the_5b_needs_no_ys_and_advertises_its_target_video_size(tiny_5b):
    policy = DreamZeroPolicy(DreamZeroConfig(checkpoint="builtin:tiny_5b"), RuntimeOptions(), model=tiny_5b)
    assert policy.view_size == (96, 192) and policy.canvas_size == (96, 192)
    # upstream's sim_policy.py overwrites metadata.json's 320 x 180 cameras with target_video_height/width (96x192 here)
    assert policy.embodiment.camera_resolutions[0] == (180, 320)
    assert policy.info.server_config["image_resolution"] == [96, 192]
    assert policy.info.details["backbone"] == "wan2.2-ti2v-5b"
    image = torch.zeros(1, 3, 1, 96, 192)
    ys, first = policy.inputs.image_conditioning(image)
    assert ys is None and first.shape == (1, 48, 1, 6, 12)
    explicit = DreamZeroPolicy(DreamZeroConfig(checkpoint="builtin:tiny_5b", image_resolution=(90, 160)), RuntimeOptions(), model=tiny_5b)
    assert explicit.info.server_config["image_resolution"] == [90, 160]


def test_config_json_mismatches_are_refused_by_name(tiny_5b_dir, tmp_path):
    import shutil

    broken = Path(shutil.copytree(tiny_5b_dir, tmp_path / "copy"))
    config = json.loads((broken / "config.json").read_text())
    config["action_head_cfg"]["config"]["diffusion_model_cfg"]["concat_first_frame_latent"] = True
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"in_dim=48, out_dim=48 .*concat_first_frame_latent=True.*expected in_dim=100"):
        DreamZeroModel.load(broken)


def test_a_5b_without_target_keys_gets_upstreams_fallback_size():
    from ardiff_policies.dreamzero.model import ActionHeadConfig

    raw = {"num_frames": 33, "num_frame_per_block": 2, "action_horizon": 24, "tiled": False, "train_architecture": "full"}
    five_b = DiTConfig(model_type="ti2v", in_dim=48, out_dim=48, frame_seqlen=50, concat_first_frame_latent=False)
    assert ActionHeadConfig.from_dict(raw, five_b).target_video_size == (176, 320)  # frame_seqlen 50 or 55
    assert ActionHeadConfig.from_dict(raw, DiTConfig()).target_video_size is None
    assert ActionHeadConfig.from_dict({**raw, "target_video_height": 160, "target_video_width": 320}, five_b).target_video_size == (160, 320)


def test_tiny_5b_served_end_to_end_to_an_openpi_client(tmp_path):
    """``ardiff-serve --config tiny_5b`` (the real server process) and openpi's own client."""
    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    from tests.helpers.server_harness import ServerProcess, droid_observation

    with ServerProcess("tiny_5b", tmp_path, args=["--set", "engine.warmup=false"]) as process:
        client = WebsocketClientPolicy(host="127.0.0.1", port=process.port)
        assert client.get_server_metadata()["image_resolution"] == [96, 192]  # the 5B checkpoint's target video size
        replies = [client.infer(droid_observation(1 if i == 0 else 4, session_id="ep", seed=i, size=(90, 160))) for i in range(3)]
        assert [r["session"]["current_start_frame"] for r in replies] == [3, 5, 7]
        assert all(r["actions"].shape == (24, 8) and r["actions"].dtype == np.float32 and np.isfinite(r["actions"]).all() for r in replies)
        assert not np.array_equal(replies[1]["actions"], replies[2]["actions"])
        assert "wan2.2" in process.http("/info")[1]


def test_full_size_5b_checkpoint_layout_has_a_home_in_the_synthetic_5b():
    """Every tensor a full-size 5B checkpoint holds (upstream names: the Wan2.2 DiT with the action register, UMT5-XXL,
    ViT-H/14, VideoVAE38_ at dim 160 / dec_dim 256) maps onto ``synthetic:droid_5b``'s modules, shape for shape."""
    from ardiff_policies.dreamzero.naming import COMPONENT_PREFIXES, image_encoder_targets, text_encoder_targets, vae_targets
    from ardiff_policies.dreamzero.synthetic import meta_modules, parse_spec
    from ardiff_policies.dreamzero.upstream_layout import checkpoint_layout

    spec = parse_spec("synthetic:droid_5b")
    dit, text, image, vae = meta_modules(spec)
    layout = checkpoint_layout(spec.dit, vae={"is_residual": True})
    maps = [
        (dit, identity_targets),
        (text, text_encoder_targets),
        (image, image_encoder_targets),
        (vae, lambda key: vae_targets(key, dict(vae.model.config))),
    ]
    for prefix, (module, targets_of) in zip(COMPONENT_PREFIXES, maps):
        expected = {name: tuple(t.shape) for name, t in module.state_dict().items()}
        got = {
            t.name: tuple(t.transform(torch.empty(shape, device="meta")).shape)
            for key, shape in layout.items()
            if key.startswith(prefix)
            for t in targets_of(key[len(prefix) :])
        }
        assert {k: v for k, v in got.items() if expected.get(k) != v} == {}, prefix
        assert set(expected) == set(got), prefix
    assert "action_head.vae.model.decoder.upsamples.0.upsamples.3.time_conv.weight" in layout  # VideoVAE38_ naming
    assert layout["action_head.vae.model.decoder.conv1.weight"] == (1024, 48, 3, 3, 3)  # dec_dim 256 x 4
    assert round(sum(p.numel() for p in dit.parameters()) / 1e9, 2) == 5.61 and spec.dit.frame_seqlen == 50


def test_synthetic_5b_policy_steps_and_gpu_check_knows_the_family():
    from ardiff_policies.dreamzero.synthetic import release_cached_model

    gpu_check = load_script("gpu_check")
    assert gpu_check.FAMILY_CHECKPOINTS["5b"] == ("synthetic:droid_5b", "synthetic:tiny_5b,layers=2")
    release_cached_model()
    policy = DreamZeroPolicy(DreamZeroConfig(checkpoint="synthetic:tiny_5b,layers=2"), RuntimeOptions())
    assert policy.view_size == (96, 192) and policy.info.server_config["image_resolution"] == [96, 192]
    spec = policy.kv_spec()
    assert spec.page_size == 18 and spec.cross_image_tokens == 257
    session = policy.start_session("s", PagedKVCache(spec, num_pages=2 * spec.pages_per_branch + 1, max_sessions=1).open_session("s"))
    frames = np.random.default_rng(0).integers(0, 256, (1, 180, 320, 3), dtype=np.uint8)
    observation = RobotObservation(
        exterior_left=frames, exterior_right=frames, wrist=frames, prompt="pick up the cup", joint_position=np.zeros(7), gripper_position=np.zeros(1)
    )
    assert policy.step(session, observation).actions.shape == (24, 8)
    release_cached_model()


def test_upstreams_176x320_fallback_is_refused_because_its_latent_has_an_odd_row(tiny_5b):
    import dataclasses

    odd = DreamZeroModel(**{**tiny_5b.__dict__, "action_head_config": dataclasses.replace(tiny_5b.action_head_config, target_video_size=(176, 320))})
    with pytest.raises(ValueError, match=r"target_video_height/width 176x320 gives a 11x20 latent; the DiT needs it divisible by its 2x2 patch"):
        DreamZeroPolicy(DreamZeroConfig(checkpoint="builtin:tiny_5b"), RuntimeOptions(), model=odd)


def _opencv_canvas(policy: DreamZeroPolicy, cameras: list[np.ndarray], size: tuple[int, int]) -> np.ndarray:
    """Upstream's 5B server path, with OpenCV itself: every frame cv2-resized (INTER_LINEAR) to the advertised size,
    then the transform's 95 % crop + per-view resize, stitched."""
    import cv2

    from ardiff_policies.dreamzero.transforms import crop_and_resize, stitch_canvas

    resized = [np.stack([cv2.resize(f, (size[1], size[0]), interpolation=cv2.INTER_LINEAR) for f in frames]) for frames in cameras]
    views = [crop_and_resize(frames, policy.view_size, policy.embodiment.crop_scale) for frames in resized]
    return stitch_canvas(policy.embodiment.layout, views, view_size=policy.view_size)


@pytest.mark.parametrize("camera", [(180, 320), (720, 1280), (61, 97)])
def test_the_5b_resizes_received_frames_to_the_advertised_size_as_upstreams_opencv_call(tiny_5b, camera):
    """Frames at a camera size other than the advertised one reach the transform as upstream's 5B server hands them
    over: cv2.resize(..., INTER_LINEAR) to the advertised size first (so a client sending its native 180x320 DROID
    frames gets the same canvas from both servers)."""
    pytest.importorskip("cv2", reason="opencv-python-headless (the dev extra) is the independent reference")
    policy = DreamZeroPolicy(DreamZeroConfig(checkpoint="builtin:tiny_5b"), RuntimeOptions(), model=tiny_5b)
    size = tuple(policy.info.server_config["image_resolution"])
    assert size != camera
    rng = np.random.default_rng(7)
    cameras = [rng.integers(0, 256, (2, *camera, 3), dtype=np.uint8) for _ in range(3)]
    observation = RobotObservation(
        exterior_left=cameras[0],
        exterior_right=cameras[1],
        wrist=cameras[2],
        prompt="pick up the cup",
        joint_position=np.zeros(7),
        gripper_position=np.zeros(1),
    )
    ours = policy.inputs.canvas(observation)
    np.testing.assert_array_equal(ours, _opencv_canvas(policy, cameras, size))
    # without the pre-resize (the 14B's path) the canvas differs: the test would catch its removal
    from ardiff_policies.dreamzero.transforms import crop_and_resize, stitch_canvas

    direct = stitch_canvas(
        policy.embodiment.layout, [crop_and_resize(c, policy.view_size, policy.embodiment.crop_scale) for c in cameras], view_size=policy.view_size
    )
    assert not np.array_equal(ours, direct)


def test_frames_at_the_advertised_size_are_not_resampled_first(tiny_5b):
    from ardiff_policies.dreamzero.transforms import crop_and_resize, stitch_canvas

    policy = DreamZeroPolicy(DreamZeroConfig(checkpoint="builtin:tiny_5b", image_resolution=(90, 160)), RuntimeOptions(), model=tiny_5b)
    frames = np.random.default_rng(3).integers(0, 256, (1, 90, 160, 3), dtype=np.uint8)
    observation = RobotObservation(
        exterior_left=frames, exterior_right=frames, wrist=frames, prompt="pick up the cup", joint_position=np.zeros(7), gripper_position=np.zeros(1)
    )
    view = crop_and_resize(frames, policy.view_size, policy.embodiment.crop_scale)
    np.testing.assert_array_equal(policy.inputs.canvas(observation), stitch_canvas(policy.embodiment.layout, [view] * 3, view_size=policy.view_size))
