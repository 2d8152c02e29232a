"""Upstream's embodiment configs added after 6f092cb, recorded as data in upstream's key names, and read key by key.

Upstream keeps an embodiment in a Python config (``wan_va/configs/va_<name>_cfg.py``: an EasyDict over
``shared_config.py``). :class:`UpstreamConfig` records one such config's values (what its module evaluates to, not its
code) with the repository, path and commit they were read from; :func:`embodiment_from_upstream` turns it into an
:class:`~ardiff_policies.lingbot_va.embodiments.Embodiment`, reading every key: the embodiment's keys are mapped, the
keys that only say how upstream deploys (checkpoint path, port, dtype, offload, output folder) are named and left to
this server's own settings, and anything else is refused by name, as are values the episode logic does not implement
(another normalization than quantiles, a cut video loop, another patch size, an inverse channel map that disagrees
with the used channels).

Recorded here (``Robbyant/lingbot-va``, official history as of 58c2ae5, 2026-04-29):

* :data:`LIBERO_CFG`: ``va_libero_cfg.py`` as of 90f1fff ("modify settings for libero inference", 2026-04-24), the
  commit that released ``robbyant/lingbot-va-posttrain-libero-long`` and whose README says these values must match
  that checkpoint. It changed the config of c479967 ("LIBERO", 2026-04-08): the used channels from 0-5 + 28 to 0-6
  (the gripper moved from channel 28 to 6, its statistics with it) and the action shift from 1.0 to 0.05.
* :data:`DEMO_CFG`: ``va_demo_cfg.py`` as of 62abff7 ("add new training demo", 2026-02-27; unchanged since): the
  configuration of upstream's post-training demo (a two-camera arm with 5 joints and a gripper); no checkpoint of it
  is released.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ardiff_policies.lingbot_va.embodiments import Embodiment

UPSTREAM_REPO = "Robbyant/lingbot-va"

# What each embodiment key of upstream's configs becomes here (Embodiment's field names).
_EMBODIMENT_KEYS = {
    "env_type": "layout",
    "obs_cam_keys": "cameras",
    "height": "height",
    "width": "width",
    "frame_chunk_size": "frame_chunk_size",
    "action_per_frame": "action_per_frame",
    "attn_window": "attn_window",
    "action_dim": "action_dim",
    "used_action_channel_ids": "used_action_channel_ids",
    "guidance_scale": "guidance_scale",
    "action_guidance_scale": "action_guidance_scale",
    "num_inference_steps": "num_inference_steps",
    "action_num_inference_steps": "action_num_inference_steps",
    "snr_shift": "snr_shift",
    "action_snr_shift": "action_snr_shift",
}
# Keys read and checked against what the episode logic implements (their only supported value here).
_FIXED_KEYS = {"action_norm_method": "quantiles", "video_exec_step": -1, "patch_size": (1, 2, 2)}
# Keys of how upstream deploys its server, not of the embodiment: this server's own settings say these (the checkpoint
# is policy.checkpoint, dtype engine.dtype, host / port server.*; upstream's offload and output folder have no use).
DEPLOYMENT_KEYS = frozenset(
    {"__name__", "wan22_pretrained_model_name_or_path", "host", "port", "param_dtype", "save_root", "enable_offload", "infer_mode"}
)


@dataclass(frozen=True)
class UpstreamConfig:
    """One of upstream's embodiment configs: its values as its module evaluates them, and where they come from."""

    name: str  # upstream's VA_CONFIGS key (wan_va/configs/__init__.py)
    path: str
    commit: str
    values: Mapping[str, Any]
    repo: str = UPSTREAM_REPO

    @property
    def source(self) -> str:
        return f"{self.repo} {self.path} @ {self.commit[:7]}"


def _inverse(used: list[int], dim: int = 30) -> list[int]:
    """What upstream's config modules compute as ``inverse_used_action_channel_ids`` (recorded with the values)."""
    out = [len(used)] * dim
    for i, channel in enumerate(used):
        out[channel] = i
    return out


def embodiment_from_upstream(config: UpstreamConfig) -> Embodiment:
    """Every key of ``config.values`` read (see the module docstring); ValueError naming the key and the source."""
    raw = dict(config.values)
    where = config.source
    unknown = sorted(set(raw) - set(_EMBODIMENT_KEYS) - set(_FIXED_KEYS) - {"norm_stat", "inverse_used_action_channel_ids"} - DEPLOYMENT_KEYS)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; LingBot-VA's embodiment configs take {sorted(_EMBODIMENT_KEYS)} and more")
    missing = sorted(k for k in (*_EMBODIMENT_KEYS, "norm_stat") if k not in raw)
    if missing:
        raise ValueError(f"{where}: missing key(s) {missing}")
    for key, supported in _FIXED_KEYS.items():
        value = raw.get(key, supported)
        if (tuple(value) if isinstance(value, (list, tuple)) else value) != supported:
            raise ValueError(f"{where}: {key} {value!r} is not supported (only {supported!r}, as every shipped config)")
    norm = raw["norm_stat"]
    if not isinstance(norm, Mapping) or set(norm) != {"q01", "q99"}:
        raise ValueError(f"{where}: norm_stat must hold exactly q01 and q99 (quantile normalization)")
    fields = {ours: raw[theirs] for theirs, ours in _EMBODIMENT_KEYS.items()}
    for key in ("cameras", "used_action_channel_ids"):
        fields[key] = tuple(fields[key])
    try:
        embodiment = Embodiment(**fields, q01=tuple(float(v) for v in norm["q01"]), q99=tuple(float(v) for v in norm["q99"]))
    except (TypeError, ValueError) as exc:  # a value of the wrong kind or out of range: the embodiment's own check
        raise ValueError(f"{where}: {exc}") from None
    # upstream stores the inverse map beside the used channels (computed in the config's module): they must agree
    inverse = _inverse(list(embodiment.used_action_channel_ids), embodiment.action_dim)
    if "inverse_used_action_channel_ids" in raw and list(raw["inverse_used_action_channel_ids"]) != inverse:
        raise ValueError(f"{where}: inverse_used_action_channel_ids disagrees with used_action_channel_ids")
    return embodiment


_LIBERO_USED = list(range(0, 7))
LIBERO_CFG = UpstreamConfig(
    name="libero",
    path="wan_va/configs/va_libero_cfg.py",
    commit="90f1ffff0141fa7c8ed584b2eb587f057759d61b",
    values={
        "__name__": "Config: VA libero",
        # shared_config.py (c479967)
        "host": "0.0.0.0",
        "port": 29536,
        "param_dtype": "bfloat16",
        "save_root": "./train_out",
        "patch_size": (1, 2, 2),
        "enable_offload": False,
        # va_libero_cfg.py
        "wan22_pretrained_model_name_or_path": "/path/to/pretrained/model",
        "attn_window": 30,
        "frame_chunk_size": 4,
        "env_type": "none",
        "height": 128,
        "width": 128,
        "action_dim": 30,
        "action_per_frame": 4,
        "obs_cam_keys": ["observation.images.agentview_rgb", "observation.images.eye_in_hand_rgb"],
        "guidance_scale": 5,
        "action_guidance_scale": 1,
        "num_inference_steps": 20,
        "video_exec_step": -1,
        "action_num_inference_steps": 50,
        "snr_shift": 5.0,
        "action_snr_shift": 0.05,
        "used_action_channel_ids": _LIBERO_USED,
        "inverse_used_action_channel_ids": _inverse(_LIBERO_USED),
        "action_norm_method": "quantiles",
        "norm_stat": {
            "q01": [
                -0.6589285731315613,
                -0.84375,
                -0.9375,
                -0.12107142806053162,
                -0.15964286029338837,
                -0.26571428775787354,
                -1.0,
                *[0.0] * 23,
            ],
            "q99": [
                0.8999999761581421,
                0.8544642925262451,
                0.9375,
                0.17142857611179352,
                0.1842857152223587,
                0.34392857551574707,
                1.0,
                *[0.0] * 23,
            ],
        },
    },
)

_DEMO_USED = [*range(0, 5), 28]
DEMO_CFG = UpstreamConfig(
    name="demo",
    path="wan_va/configs/va_demo_cfg.py",
    commit="62abff76a4fcd516b5d89977bca25aec96e90e76",
    values={
        "__name__": "Config: VA demo",
        # shared_config.py (62abff7; enable_offload became False with c479967: not an embodiment key)
        "host": "0.0.0.0",
        "port": 29536,
        "param_dtype": "bfloat16",
        "save_root": "./train_out",
        "patch_size": (1, 2, 2),
        "enable_offload": True,
        # va_demo_cfg.py
        "wan22_pretrained_model_name_or_path": "/path/to/pretrained/model",
        "attn_window": 30,
        "frame_chunk_size": 4,
        "env_type": "none",
        "height": 256,
        "width": 256,
        "action_dim": 30,
        "action_per_frame": 8,
        "obs_cam_keys": ["observation.images.top", "observation.images.wrist"],
        "guidance_scale": 5,
        "action_guidance_scale": 1,
        "num_inference_steps": 5,
        "video_exec_step": -1,
        "action_num_inference_steps": 10,
        "snr_shift": 5.0,
        "action_snr_shift": 1.0,
        "used_action_channel_ids": _DEMO_USED,
        "inverse_used_action_channel_ids": _inverse(_DEMO_USED),
        "action_norm_method": "quantiles",
        "norm_stat": {
            "q01": [
                -90.60303497314453,
                -98.73043060302734,
                -79.9008560180664,
                48.95470428466797,
                -32.794578552246094,
                *[0.0] * 23,
                0.8250824809074402,
                0.0,
            ],
            "q99": [71.735107421875, 65.89081573486328, 92.87967681884766, 100.0, 22.784151077270508, *[0.0] * 23, 100.0, 0.0],
        },
    },
)

# LingBot-VA post-trained on LIBERO-Long: two 128x128 cameras side by side through one VAE stream (an 8x16 latent frame,
# 32 tokens), 4-frame chunks of 4 actions (128 + 16 tokens a chunk, pages of 16), a window of 15 chunks; 7 actions:
# channels 0-5 the end effector's delta pose, channel 6 the gripper (quantiles -1 / 1: denormalized to itself within
# 1e-6), the other 23 unused (zeroed).
LIBERO = embodiment_from_upstream(LIBERO_CFG)
# Upstream's post-training demo: cameras top / wrist at 256x256, 4-frame chunks of 8 actions, 6 actions (channels
# 0-4 the joints, 28 the gripper), 5 video and 10 action steps.
DEMO = embodiment_from_upstream(DEMO_CFG)
