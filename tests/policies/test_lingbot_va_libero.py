"""LingBot-VA's LIBERO embodiment: upstream's va_libero_cfg.py values read key by key, LIBERO's 7 actions out of the
model's 30 channels, and the episode logic against upstream's own server over its LIBERO client's call order on the
tiny checkpoint (scripts/record_upstream_lingbot_va_libero.py)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from ardiff_policies.lingbot_va import upstream_configs
from ardiff_policies.lingbot_va.episode import InferRequest, LingBotVAEpisodes, kv_spec
from ardiff_policies.lingbot_va.tiny import TINY_LIBERO_EMBODIMENT, TINY_TRANSFORMER, ensure_tiny_checkpoint
from ardiff_policies.lingbot_va.upstream_configs import DEMO, LIBERO, LIBERO_CFG, UpstreamConfig, embodiment_from_upstream
from ardiff_policies.wan.tiny import tree_digest
from tests.helpers.lingbot_va import make_cache
from tests.helpers.scripts import load_script

RECORD = load_script("record_upstream_lingbot_va_libero")
REFERENCE = Path(__file__).parents[1] / "reference_data" / RECORD.NAME
ATOL = 1e-5


def test_libero_is_upstreams_config_as_released_with_the_libero_long_weights():
    e = LIBERO
    assert LIBERO_CFG.source == "Robbyant/lingbot-va wan_va/configs/va_libero_cfg.py @ 90f1fff"
    assert (e.layout, e.cameras, e.height, e.width) == ("none", ("observation.images.agentview_rgb", "observation.images.eye_in_hand_rgb"), 128, 128)
    assert (e.frame_chunk_size, e.action_per_frame, e.attn_window) == (4, 4, 30)
    assert (e.num_inference_steps, e.action_num_inference_steps, e.snr_shift, e.action_snr_shift) == (20, 50, 5.0, 0.05)
    assert (e.guidance_scale, e.action_guidance_scale) == (5, 1)
    assert e.used_action_channel_ids == tuple(range(7))  # 90f1fff moved the gripper from channel 28 to 6
    assert (e.q01[6], e.q99[6]) == (-1.0, 1.0) and e.q01[7:] == e.q99[7:] == (0.0,) * 23
    # two cameras side by side: an 8x16 latent frame, 32 tokens; 128 + 16 tokens a chunk, pages of 16; 15 chunks
    assert e.latent_size == (8, 16) and (e.video_tokens_per_chunk, e.action_tokens_per_chunk) == (128, 16)
    spec = kv_spec(e, TINY_TRANSFORMER, torch.float32)
    assert (spec.page_size, spec.window_pages, spec.max_new_pages) == (16, 135, 8)
    assert DEMO.cameras == ("observation.images.top", "observation.images.wrist") and DEMO.used_action_channel_ids == (0, 1, 2, 3, 4, 28)


def _with(**changes) -> UpstreamConfig:
    values = {k: v for k, v in {**LIBERO_CFG.values, **changes}.items() if v is not None}
    return dataclasses.replace(LIBERO_CFG, values=values)


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"action_chunk_size": 8}, r"unknown key\(s\) \['action_chunk_size'\]"),
        ({"obs_cam_keys": None}, r"missing key\(s\) \['obs_cam_keys'\]"),
        ({"action_norm_method": "meanstd"}, "action_norm_method 'meanstd' is not supported"),
        ({"video_exec_step": 10}, "video_exec_step 10 is not supported"),
        ({"patch_size": (1, 4, 4)}, "patch_size"),
        ({"norm_stat": {"q01": [0.0] * 30}}, "norm_stat must hold exactly q01 and q99"),
        ({"inverse_used_action_channel_ids": [0] * 30}, "inverse_used_action_channel_ids disagrees"),
        ({"used_action_channel_ids": [0, 0, 1]}, "distinct channels"),
        ({"height": 100}, "multiple of 32"),
    ],
)
def test_an_upstream_config_is_read_key_by_key_and_refused_by_name(changes, words):
    with pytest.raises(ValueError, match=words) as refused:
        embodiment_from_upstream(_with(**changes))
    assert str(refused.value).startswith("Robbyant/lingbot-va wan_va/configs/va_libero_cfg.py @ 90f1fff: ")


def test_deployment_keys_are_named_not_embodiment():
    """Upstream's checkpoint path, port, dtype, offload and output folder are this server's own settings."""
    assert {"wan22_pretrained_model_name_or_path", "port", "param_dtype", "enable_offload", "save_root"} <= upstream_configs.DEPLOYMENT_KEYS
    assert embodiment_from_upstream(_with(port=1, enable_offload=True, save_root="/elsewhere")) == LIBERO


@pytest.fixture(scope="module")
def policy() -> LingBotVAEpisodes:
    return LingBotVAEpisodes.load(ensure_tiny_checkpoint(), TINY_LIBERO_EMBODIMENT)


def test_libero_actions_are_channels_0_to_6_and_the_gripper_round_trips(policy):
    """Out: the 7 used channels of the model's 30, in order (0-5 the end effector's delta pose, 6 the gripper); the
    other 23 never reach the robot. In (compute_kv_cache's state): scattered back to channels 0-6, the rest read the
    zero row. The gripper's quantiles are -1 / 1, so its denormalization is the identity within 1e-6."""
    rng = np.random.default_rng(0)
    model_out = torch.from_numpy(rng.uniform(-1, 1, (1, 30, 4, 4, 1)).astype(np.float32))
    sent = policy.denormalize_actions(model_out)
    assert sent.shape == (7, 4, 4)
    q01, q99 = np.array(LIBERO.q01[:7]).reshape(7, 1, 1), np.array(LIBERO.q99[:7]).reshape(7, 1, 1)
    np.testing.assert_allclose(sent, (model_out[0, :7, ..., 0].numpy() + 1) / 2 * (q99 - q01 + 1e-6) + q01, atol=1e-6)
    np.testing.assert_allclose(sent[6], model_out[0, 6, ..., 0].numpy(), atol=2e-6)
    noisy = model_out.clone()
    noisy[:, 7:] = 1e3  # unused channels: whatever the model puts there is not sent
    np.testing.assert_array_equal(policy.denormalize_actions(noisy), sent)
    back = policy.normalize_actions(sent)
    assert back.shape == (1, 30, 4, 4, 1)
    np.testing.assert_allclose(back[0, :7, ..., 0].numpy(), model_out[0, :7, ..., 0].numpy(), atol=1e-5)
    assert (back[0, 7:] == -1).all()  # the zero row normalized with zero quantiles; the commit zeroes these channels


@pytest.fixture(scope="module")
def reference():
    if not REFERENCE.with_suffix(".safetensors").exists():
        pytest.skip(
            f"{REFERENCE.name}.safetensors is absent: record it with scripts/record_upstream_lingbot_va_libero.py (upstream's code at c479967 or later)"
        )
    meta = json.loads(REFERENCE.with_suffix(".json").read_text())
    assert meta["checkpoint_transformer_sha256"] == tree_digest(ensure_tiny_checkpoint() / "transformer"), "the tiny checkpoint changed: record again"
    assert meta["embodiment"] == json.loads(json.dumps(dataclasses.asdict(TINY_LIBERO_EMBODIMENT))), (
        "the tiny LIBERO embodiment changed: record again"
    )
    return meta, load_file(REFERENCE.with_suffix(".safetensors"))


def test_libero_episodes_batched_with_another_robot_match_upstreams_server(reference, policy):
    """Upstream's LIBERO client's order (reset; infer with the first observation every chunk; 12 then 16 key frames
    committed with the actions; an unfinished last chunk never committed; reset, the next episode), each episode's
    generator seeded at reset; a second robot batched alongside every infer: the actions are upstream's within 1e-5."""
    meta, tensors = reference
    e = TINY_LIBERO_EMBODIMENT
    cache = make_cache(policy)
    robot = policy.start_session("robot", cache.open_session("robot"))
    other = policy.start_session("other", cache.open_session("other"))
    for n, episode in enumerate(RECORD.EPISODES):
        policy.reset(robot, episode["prompt"], seed=meta["seed"])
        policy.reset(other, "stack the blue block", seed=9)
        first = RECORD.libero_frame(e.cameras, episode["frames"])
        for chunk in range(episode["chunks"] + episode["unfinished"]):
            action, _ = policy.infer_batch([InferRequest(robot, first), InferRequest(other, RECORD.libero_frame(e.cameras, 77))])
            assert isinstance(action, np.ndarray) and action.shape == (7, 4, 4)
            error = np.abs(action - tensors[f"ep{n}.actions.{chunk}"].numpy()).max()
            assert error <= ATOL, f"episode {n} chunk {chunk}: max abs error {error:.2e}"
            if chunk == 0:
                assert (robot.first_latent - tensors[f"ep{n}.first_latent"]).abs().max().item() <= ATOL
            if chunk == episode["chunks"]:
                break
            count = RECORD.key_frame_count(chunk, action.shape)
            assert count == (12 if chunk == 0 else 16)
            policy.compute_kv_cache(robot, RECORD.episode_frames(e.cameras, episode, chunk, count), action)
            policy.compute_kv_cache(other, RECORD.episode_frames(e.cameras, episode, chunk + 50, count), action)
