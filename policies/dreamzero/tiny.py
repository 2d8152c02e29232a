"""The embedded tiny DreamZeros: the real architecture at toy width, as checkpoints on disk.

``write_tiny_checkpoint`` deterministically writes a checkpoint in exactly the released
``GEAR-Dreams/DreamZero-DROID`` layout (upstream tensor names, sharded safetensors with an
index, ``config.json``, ``experiment_cfg/metadata.json`` with DROID-like q01/q99 statistics)
plus a small word-level tokenizer. The server loads it through the same loader as the real
model, so protocol, sessions, KV paging, CFG and normalization all run for real on a CPU;
only the actions are meaningless. Nothing is downloaded and no weights are committed.

Geometry: 48x80 views -> a 96x160 canvas -> 12x20 latents -> 60 tokens per latent frame;
a 2-layer, width-64 DiT; 9-frame window, 2-frame chunks, 24 actions.

``builtin:tiny_5b`` is the same on upstream's Wan2.2-TI2V-5B architecture (``wan_flow_matching_action_tf_wan22``):
a ``ti2v`` DiT on 48-channel latents without the ``ys`` concat, the Wan2.2 VAE (``WanVideoVAE38``: 2x2 patchify,
residual blocks, 16x), the stitched video resized to ``target_video_height/width`` first. 96x192 views -> a
192x384 canvas -> resized to 96x192 -> 6x12 latents -> 18 tokens per latent frame. Its metadata.json records
DROID's camera resolution (180x320), which upstream's 5B server replaces by the target size: it (and this one)
advertises ``image_resolution`` 96x192 and resizes every received frame to it first.

Besides DROID, post-trained-style checkpoints of upstream's other embodiments with the 14B tiny
geometry (``builtin:tiny_agibot``, ``builtin:tiny_yam``): their own weights (another seed),
upstream's metadata.json layout for the tag (modalities with shapes and camera resolutions, all
six statistics per key; AgiBot's waist has a locked joint, q01 == q99) and an
``experiment_cfg/conf.yaml`` with the parts of upstream's resolved training config the server
reads, as a training run writes them. :data:`TINY_VARIANTS` lists every embedded checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors.torch import save_file

from ardiff_policies.dreamzero.dit import DiTConfig
from ardiff_policies.dreamzero.upstream_layout import checkpoint_config, checkpoint_layout
from ardiff_policies.wan.tiny import TINY_TEXT_ENCODER, cache_root, ensure_generated, init_tensor, tiny_tokenizer, write_json

TINY_VERSION = 2  # 2: config.json carries every key of the released one
TINY_VIEW_SIZE = (48, 80)
TINY_5B_VERSION = 1
TINY_5B_VIEW_SIZE = (96, 192)
TINY_5B_TARGET_VIDEO = (96, 192)  # target_video_height/width: the 192x384 canvas is resized to it (the 5B: 160x320)

TINY_DIT = DiTConfig(
    frame_seqlen=60,
    dim=64,
    ffn_dim=128,
    text_dim=32,
    num_heads=4,
    num_layers=2,
    hidden_size=32,
    clip_dim=32,
    max_chunk_size=4,
    num_frame_per_block=2,
)
TINY_IMAGE_ENCODER = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "projection_dim": 32}
TINY_VAE = {"base_dim": 4, "num_res_blocks": 1}

# The tiny 14B's widths with the 5B's TI2V input (48 latent channels, no first-frame concat, its 18-token frames).
TINY_5B_DIT = replace(TINY_DIT, model_type="ti2v", in_dim=48, out_dim=48, concat_first_frame_latent=False, frame_seqlen=18)
# The Wan2.2 VAE at toy width (z_dim stays 48: upstream normalizes with its 48 fixed statistics); the decoder at its
# own width, as upstream's (160 / 256).
TINY_5B_VAE = {"is_residual": True, "base_dim": 4, "decoder_base_dim": 8, "num_res_blocks": 1}

# Words the tiny tokenizer knows: the DROID prompt template, the negative prompt, common tasks.
CORPUS = """
a multi-view video shows that robot the is split into three views: top view shows camera from
robot's wrist, bottom-left left exterior and bottom-right right during training one of two
bottom views may be black screen (dropped view). perform default behavior.
vibrant colors, overexposed, static, blurry details, text, subtitles, style, artwork, painting,
image, still, grayscale, dull, worst quality, low quality, jpeg artifacts, ugly, mutilated,
extra fingers, bad hands, bad face, deformed, disfigured, mutated limbs, fused fingers,
stagnant cluttered background, legs, many people in walking backwards.
pick up put place move open close push pull turn on off stack fold wipe pour grab drop lift
cup mug bowl plate spoon fork block cube marker pen towel cloth drawer door lid box bottle can
red green blue yellow white orange purple table shelf basket sink counter to into onto in on
of with and it warm up
"""


def _stats(q01: list[float], q99: list[float]) -> dict:
    mean = [(a + b) / 2 for a, b in zip(q01, q99)]
    std = [(b - a) / 4 for a, b in zip(q01, q99)]
    return {"q01": q01, "q99": q99, "mean": mean, "std": std, "min": [a * 1.2 for a in q01], "max": [b * 1.2 for b in q99]}


def droid_metadata(camera_resolution: tuple[int, int] | None = None) -> dict:
    """DROID-like normalization statistics (relative joint actions, absolute gripper). With ``camera_resolution``
    (width, height), ``modalities.video`` is upstream's ``DatasetModalities`` form (per camera: resolution, channels,
    fps) instead of the camera list."""
    stats = _stats

    joints_abs = ([-2.4, -1.2, -2.3, -2.9, -2.4, 0.4, -2.6], [2.4, 1.5, 2.3, -0.5, 2.4, 3.6, 2.6])
    joints_rel = ([-0.35, -0.3, -0.35, -0.4, -0.4, -0.4, -0.5], [0.35, 0.3, 0.35, 0.4, 0.4, 0.4, 0.5])
    return {
        "oxe_droid": {
            "statistics": {
                "state": {"joint_position": stats(*joints_abs), "gripper_position": stats([0.0], [0.98])},
                "action": {"joint_position": stats(*joints_rel), "gripper_position": stats([0.0], [1.0])},
            },
            "modalities": {"video": _cameras(camera_resolution)},
            "embodiment_tag": "oxe_droid",
        }
    }


def _cameras(resolution: tuple[int, int] | None) -> list[str] | dict[str, dict]:
    names = ["exterior_image_1_left", "exterior_image_2_left", "wrist_image_left"]
    if resolution is None:
        return names
    return {name: {"resolution": list(resolution), "channels": 3, "fps": 15.0} for name in names}


# ------------------------------------------------------------------ other embodiments (post-trained style)

TINY_CAMERA_RESOLUTION = (96, 160)  # (height, width) in metadata.json: 95 % crop -> 91x152 -> 48x80 views


def _embodiment_metadata(tag: str, cameras: list[str], state: dict, action: dict) -> dict:
    """``metadata.json[tag]`` in upstream's DatasetMetadata layout. ``state`` / ``action``: key -> (q01, q99, absolute)."""
    h, w = TINY_CAMERA_RESOLUTION

    def modality(table: dict) -> dict:
        return {k: {"absolute": absolute, "rotation_type": None, "shape": [len(q01)], "continuous": True} for k, (q01, _, absolute) in table.items()}

    return {
        tag: {
            "statistics": {
                "state": {k: _stats(list(q01), list(q99)) for k, (q01, q99, _) in state.items()},
                "action": {k: _stats(list(q01), list(q99)) for k, (q01, q99, _) in action.items()},
            },
            "modalities": {
                "video": {c: {"resolution": [w, h], "channels": 3, "fps": 30.0} for c in cameras},
                "state": modality(state),
                "action": modality(action),
            },
            "embodiment_tag": tag,
        }
    }


def agibot_metadata() -> dict:
    """AgiBot: 3 cameras, 6 state keys (20 dims), 7 action keys (22 dims); all but the base velocity relative."""
    arm_abs = ([-2.9, -2.0, -2.9, -2.6, -2.9, -1.6, -2.9], [2.9, 2.0, 2.9, 0.1, 2.9, 1.6, 2.9])
    arm_rel = ([-0.3, -0.25, -0.3, -0.35, -0.3, -0.2, -0.4], [0.3, 0.25, 0.3, 0.35, 0.3, 0.2, 0.4])
    state = {
        "left_arm_joint_position": (*arm_abs, True),
        "right_arm_joint_position": (*arm_abs, True),
        "left_effector_position": ([0.0], [1.0], True),
        "right_effector_position": ([0.0], [1.0], True),
        "head_position": ([-0.5, -0.3], [0.5, 0.4], True),
        "waist_position": ([0.2, 0.0], [0.2, 0.6], True),  # the first waist joint is locked: q01 == q99
    }
    action = {
        "left_arm_joint_position": (*arm_rel, False),
        "right_arm_joint_position": (*arm_rel, False),
        "left_effector_position": ([-0.5], [0.5], False),
        "right_effector_position": ([-0.5], [0.5], False),
        "head_position": ([-0.05, -0.05], [0.05, 0.05], False),
        "waist_position": ([0.0, -0.04], [0.0, 0.04], False),
        "robot_velocity": ([-0.3, -0.6], [0.3, 0.6], True),
    }
    return _embodiment_metadata("agibot", ["top_head", "hand_left", "hand_right"], state, action)


def yam_metadata() -> dict:
    """YAM: 3 cameras, bimanual 6 joints + gripper per arm (14 dims), every action key relative."""
    joints_abs = ([-2.6, -0.1, -0.1, -1.6, -1.6, -2.0], [2.6, 3.1, 3.1, 1.6, 1.6, 2.0])
    joints_rel = ([-0.2, -0.2, -0.25, -0.3, -0.3, -0.35], [0.2, 0.2, 0.25, 0.3, 0.3, 0.35])
    state = {
        "left_joint_pos": (*joints_abs, True),
        "left_gripper_pos": ([0.0], [1.0], True),
        "right_joint_pos": (*joints_abs, True),
        "right_gripper_pos": ([0.0], [1.0], True),
    }
    action = {
        "left_joint_pos": (*joints_rel, False),
        "left_gripper_pos": ([-0.9], [0.9], False),
        "right_joint_pos": (*joints_rel, False),
        "right_gripper_pos": ([-0.9], [0.9], False),
    }
    return _embodiment_metadata("yam", ["top_camera-images-rgb", "left_camera-images-rgb", "right_camera-images-rgb"], state, action)


# Upstream's video eval_delta_indices per tag (base_48_wan_fine_aug_relative.yaml): AgiBot's clients send 4 frames.
VIDEO_EVAL_DELTA_INDICES = {"agibot": [-3, -2, -1, 0], "yam": [0], "oxe_droid": [0]}


def run_config(tag: str, language_key: str, view_size: tuple[int, int] = TINY_VIEW_SIZE) -> dict:
    """The parts of a training run's resolved ``experiment_cfg/conf.yaml`` the server reads, as upstream writes them
    (``groot/vla/configs/data/dreamzero/<tag>_relative.yaml`` over ``base_48_wan_fine_aug_relative.yaml``, the
    DreamZero transform config, the training script's 176x320 resize replaced by the tiny view size). It is part
    of the tiny checkpoints' cache key (``_definition_digest``): a change here regenerates them."""
    from ardiff_policies.dreamzero.embodiments import BUILTIN_MODALITIES, DEFAULT_INSTRUCTION, PROJECTOR_INDEX

    mod = BUILTIN_MODALITIES[tag]
    video = [f"video.{c}" for c in mod.cameras]
    state = [f"state.{k}" for k in mod.states]
    action = [f"action.{k}" for k in mod.actions]
    return {
        "relative_action": True,
        "relative_action_per_horizon": False,
        "relative_action_keys": list(mod.relative_action_keys),
        "max_state_dim": 64,
        "action_horizon": 24,
        "state_horizon": 1,
        "num_frames": 33,
        "image_resolution_height": view_size[0],
        "image_resolution_width": view_size[1],
        "embodiment_tag_to_projector_index": dict(PROJECTOR_INDEX),
        "modality_configs": {
            tag: {
                "video": {
                    "_target_": "groot.vla.data.dataset.ModalityConfig",
                    "delta_indices": list(range(25)),
                    "eval_delta_indices": VIDEO_EVAL_DELTA_INDICES[tag],
                    "modality_keys": video,
                },
                "state": {"_target_": "groot.vla.data.dataset.ModalityConfig", "delta_indices": [0], "modality_keys": state},
                "action": {"_target_": "groot.vla.data.dataset.ModalityConfig", "delta_indices": list(range(24)), "modality_keys": action},
                "language": {"_target_": "groot.vla.data.dataset.ModalityConfig", "delta_indices": [0], "modality_keys": [language_key]},
            }
        },
        "transforms": {
            tag: {
                "_target_": "groot.vla.data.transform.ComposedModalityTransform",
                "transforms": [
                    {"_target_": "groot.vla.data.transform.VideoToTensor", "apply_to": video},
                    {"_target_": "groot.vla.data.transform.VideoCrop", "apply_to": video, "scale": 0.95, "mode": "random"},
                    {
                        "_target_": "groot.vla.data.transform.VideoResize",
                        "apply_to": video,
                        "height": view_size[0],
                        "width": view_size[1],
                        "interpolation": "linear",
                    },
                    {
                        "_target_": "groot.vla.data.transform.VideoColorJitter",
                        "apply_to": video,
                        "brightness": 0.3,
                        "contrast": 0.4,
                        "saturation": 0.5,
                        "hue": 0.08,
                    },
                    {"_target_": "groot.vla.data.transform.VideoToNumpy", "apply_to": video},
                    {"_target_": "groot.vla.data.transform.StateActionToTensor", "apply_to": state},
                    {
                        "_target_": "groot.vla.data.transform.StateActionTransform",
                        "apply_to": state,
                        "normalization_modes": dict.fromkeys(state, "q99"),
                    },
                    {"_target_": "groot.vla.data.transform.StateActionToTensor", "apply_to": action},
                    {
                        "_target_": "groot.vla.data.transform.StateActionTransform",
                        "apply_to": action,
                        "normalization_modes": dict.fromkeys(action, "q99"),
                    },
                    {
                        "_target_": "groot.vla.data.transform.ConcatTransform",
                        "video_concat_order": video,
                        "state_concat_order": state,
                        "action_concat_order": action,
                    },
                    {
                        "_target_": "groot.vla.model.dreamzero.transform.dreamzero_cotrain.DreamTransform",
                        "default_instruction": DEFAULT_INSTRUCTION,
                        "language_dropout_prob": 0.0,
                        "always_use_default_instruction": False,
                        "max_state_dim": 64,
                        "max_action_dim": 32,
                        "max_length": 512,
                        "state_horizon": 1,
                        "action_horizon": 24,
                        "embodiment_tag_mapping": dict(PROJECTOR_INDEX),
                        "tokenizer_path": "google/umt5-xxl",
                    },
                ],
            }
        },
    }


@dataclass(frozen=True)
class TinyVariant:
    """One embedded tiny checkpoint: its weights' seed, its metadata.json, its run config, its tokenizer's words."""

    name: str
    seed: int
    metadata: Callable[[], dict]
    run_config: Callable[[], dict] | None = None
    extra_words: str = ""
    wan22: bool = False  # the Wan2.2-5B architecture (TINY_5B_*), else the 14B's (TINY_*)


def _template_words() -> str:
    from ardiff_policies.dreamzero.embodiments import DEFAULT_INSTRUCTION, HEAD_HANDS_TEMPLATE, YAM_TEMPLATE

    return " ".join(t.replace("{task}", "") for t in (HEAD_HANDS_TEMPLATE, YAM_TEMPLATE, DEFAULT_INSTRUCTION)) + " fold the towel shirt"


TINY_VARIANTS: dict[str, TinyVariant] = {
    "tiny": TinyVariant("tiny", 0, droid_metadata),
    "tiny_5b": TinyVariant("tiny_5b", 0, lambda: droid_metadata((320, 180)), wan22=True),
    "tiny_agibot": TinyVariant("tiny_agibot", 1, agibot_metadata, lambda: run_config("agibot", "annotation.language.action_text"), "agibot"),
    "tiny_yam": TinyVariant("tiny_yam", 2, yam_metadata, lambda: run_config("yam", "annotation.task"), "yam"),
}


def write_tiny_checkpoint(out: str | Path, seed: int | None = None, variant: str = "tiny") -> Path:
    """Write a tiny checkpoint to ``out`` (created). Same bytes for the same variant and seed, every time."""
    spec = TINY_VARIANTS[variant]
    corpus = CORPUS + (_template_words() if spec.extra_words else "")
    if spec.wan22:
        dit, vae, target, version = TINY_5B_DIT, TINY_5B_VAE, TINY_5B_TARGET_VIDEO, ("ardiff_tiny_5b_version", TINY_5B_VERSION)
    else:
        dit, vae, target, version = TINY_DIT, TINY_VAE, None, ("ardiff_tiny_version", TINY_VERSION)
    return write_checkpoint(
        out,
        dit,
        TINY_TEXT_ENCODER,
        TINY_IMAGE_ENCODER,
        vae,
        seed=spec.seed if seed is None else seed,
        metadata=spec.metadata(),
        run_config=spec.run_config() if spec.run_config else None,
        corpus=corpus,
        target_video_size=target,
        version=version,
    )


def write_checkpoint(
    out: str | Path,
    dit_cfg: DiTConfig,
    text_encoder_cfg: dict,
    image_encoder_cfg: dict,
    vae_cfg: dict,
    seed: int = 0,
    *,
    target_video_size: tuple[int, int] | None = None,
    version: tuple[str, int] = ("ardiff_tiny_version", TINY_VERSION),
    metadata: dict | None = None,
    run_config: dict | None = None,
    corpus: str = CORPUS,
) -> Path:
    """Write a random-weight checkpoint of any geometry in the released layout (the tiny
    tokenizer and DROID-like statistics included, unless ``metadata`` is given; ``run_config``
    is written as ``experiment_cfg/conf.yaml``). ``text_encoder_cfg`` leaves out
    ``vocab_size``: it is sized to the tiny tokenizer. Benchmarks use this for real token
    geometry at small width (scripts/bench_chunk.py). A ``vae_cfg`` with ``is_residual`` writes the
    Wan2.2 VAE (the 5B layout), ``target_video_size`` its resize target (``checkpoint_config``)."""
    out = Path(out)
    (out / "experiment_cfg").mkdir(parents=True, exist_ok=True)
    tokenizer = tiny_tokenizer(corpus)
    tokenizer.save_pretrained(out / "tokenizer")
    text_encoder = {**text_encoder_cfg, "vocab_size": 8 * math.ceil(len(tokenizer) / 8)}

    layout = checkpoint_layout(dit_cfg, text_encoder, image_encoder_cfg, vae_cfg)
    generator = torch.Generator().manual_seed(seed)
    tensors = {name: init_tensor(name, shape, generator).contiguous() for name, shape in sorted(layout.items())}
    # Two shards, like the released checkpoint: the DiT, and the frozen encoders.
    shards = {
        "model-00001-of-00002.safetensors": {k: v for k, v in tensors.items() if k.startswith("action_head.model.")},
        "model-00002-of-00002.safetensors": {k: v for k, v in tensors.items() if not k.startswith("action_head.model.")},
    }
    weight_map = {}
    for shard, part in shards.items():
        save_file(part, out / shard, metadata={"format": "pt"})
        weight_map |= {name: shard for name in part}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    write_json(out / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})

    # Every key of the released config.json, in its sections (upstream_layout.RELEASED_*_KEYS).
    config = {
        **checkpoint_config(dit_cfg, text_encoder, image_encoder_cfg, vae_cfg, target_video_size=target_video_size),
        version[0]: version[1],
    }
    write_json(out / "config.json", config)
    write_json(out / "experiment_cfg" / "metadata.json", droid_metadata() if metadata is None else metadata)
    if run_config is not None:
        import yaml

        (out / "experiment_cfg" / "conf.yaml").write_text(yaml.safe_dump(run_config, sort_keys=False))
    return out


def _definition_digest(variant: str = "tiny") -> str:
    """Changes whenever anything that shapes the checkpoint's bytes changes (cache key)."""
    if TINY_VARIANTS[variant].wan22:
        spec = [
            TINY_5B_VERSION,
            TINY_5B_DIT.to_dict(),
            TINY_TEXT_ENCODER,
            TINY_IMAGE_ENCODER,
            TINY_5B_VAE,
            TINY_5B_TARGET_VIDEO,
            CORPUS,
            droid_metadata((320, 180)),
        ]
        return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:10]
    spec = [TINY_VERSION, TINY_DIT.to_dict(), TINY_TEXT_ENCODER, TINY_IMAGE_ENCODER, TINY_VAE, CORPUS, droid_metadata()]
    if variant != "tiny":  # (the DROID checkpoint keeps the digest it always had)
        v = TINY_VARIANTS[variant]
        spec += [v.name, v.seed, v.metadata(), v.run_config() if v.run_config else None, _template_words()]
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:10]


def default_cache_dir(variant: str = "tiny") -> Path:
    if variant == "tiny_5b":
        return cache_root() / f"tiny-dreamzero-5b-v{TINY_5B_VERSION}-{_definition_digest(variant)}"
    name = "tiny-dreamzero" if variant == "tiny" else f"{variant.replace('_', '-')}-dreamzero"
    return cache_root() / f"{name}-v{TINY_VERSION}-{_definition_digest(variant)}"


def ensure_tiny_checkpoint(path: str | Path | None = None, variant: str = "tiny") -> Path:
    """A tiny checkpoint's directory (``variant``: a key of :data:`TINY_VARIANTS`; builtin:<variant>), generating it
    on first use (safe across processes)."""
    if variant not in TINY_VARIANTS:
        raise ValueError(f"unknown tiny checkpoint {variant!r}; built in: {sorted(TINY_VARIANTS)}")
    target = Path(path) if path is not None else default_cache_dir(variant)
    return ensure_generated(target, "config.json", lambda out: write_tiny_checkpoint(out, variant=variant))
