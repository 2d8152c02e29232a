"""The embedded tiny DreamZero: the real architecture at toy width, as a checkpoint on disk.

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
DROID's camera resolution, from which upstream's 5B server (and this one) advertises ``image_resolution``.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from policies.dreamzero.dit import DiTConfig
from policies.dreamzero.upstream_layout import checkpoint_config, checkpoint_layout

TINY_VERSION = 2  # 2: config.json carries every key of the released one
TINY_VIEW_SIZE = (48, 80)
TINY_5B_VERSION = 1
TINY_5B_VIEW_SIZE = (96, 192)
TINY_5B_TARGET_VIDEO = (96, 192)  # target_video_height/width: the 192x384 canvas is resized to it (the 5B: 160x320)

TINY_DIT = DiTConfig(
    frame_seqlen=60, dim=64, ffn_dim=128, text_dim=32, num_heads=4, num_layers=2, hidden_size=32,
    clip_dim=32, max_chunk_size=4, num_frame_per_block=2,
)  # fmt: skip
TINY_TEXT_ENCODER = {"d_model": 32, "d_kv": 8, "num_heads": 4, "d_ff": 64, "num_layers": 2}  # + vocab_size
TINY_IMAGE_ENCODER = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "projection_dim": 32}
TINY_VAE = {"base_dim": 4, "num_res_blocks": 1}

TINY_5B_DIT = DiTConfig(
    model_type="ti2v", in_dim=48, out_dim=48, concat_first_frame_latent=False, frame_seqlen=18, dim=64, ffn_dim=128,
    text_dim=32, num_heads=4, num_layers=2, hidden_size=32, clip_dim=32, max_chunk_size=4, num_frame_per_block=2,
)  # fmt: skip
# The Wan2.2 VAE at toy width (z_dim stays 48: upstream normalizes with its 48 fixed statistics); the decoder at its
# own width, as upstream's (160 / 256).
TINY_5B_VAE = {"is_residual": True, "base_dim": 4, "decoder_base_dim": 8, "num_res_blocks": 1}

# Words the tiny tokenizer knows: the DROID prompt template, the negative prompt, common tasks.
_CORPUS = """
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


def tiny_tokenizer():
    """A word-level tokenizer over the corpus (T5 specials: <pad> 0, </s> 1, <unk> 2)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = sorted({w for w in pre_tokenizers.WhitespaceSplit().pre_tokenize_str(_CORPUS.lower()) for w in [w[0]]})
    pieces: list[str] = []
    for word in words:
        for piece, _ in pre_tokenizers.Whitespace().pre_tokenize_str(word):
            if piece not in pieces:
                pieces.append(piece)
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2} | {p: i + 3 for i, p in enumerate(sorted(pieces))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def _init(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """Plausible random values per kind of tensor, so every path carries real signal."""
    leaf = name.rsplit(".", 1)[-1]
    noise = torch.randn(shape, generator=generator, dtype=torch.float32)
    if leaf == "log_scale":
        return torch.tensor(math.log(1 / 0.07))
    if leaf == "gamma" or (leaf == "weight" and len(shape) == 1 and "norm" in name):
        return 1.0 + 0.1 * noise
    if leaf in ("bias", "b") or len(shape) == 1:
        return 0.02 * noise
    if leaf == "modulation":
        return noise / math.sqrt(shape[-1])
    if ("embedding" in name and leaf != "weight") or "pos_embedding" in name or "cls_embedding" in name:
        return 0.02 * noise
    fan_in = shape[-2] if leaf == "W" else math.prod(shape[1:])
    return noise / math.sqrt(max(fan_in, 1))


def droid_metadata(camera_resolution: tuple[int, int] | None = None) -> dict:
    """DROID-like normalization statistics (relative joint actions, absolute gripper). With ``camera_resolution``
    (width, height), ``modalities.video`` is upstream's ``DatasetModalities`` form (per camera: resolution, channels,
    fps) instead of the camera list."""

    def stats(q01: list[float], q99: list[float]) -> dict:
        mean = [(a + b) / 2 for a, b in zip(q01, q99)]
        std = [(b - a) / 4 for a, b in zip(q01, q99)]
        return {"q01": q01, "q99": q99, "mean": mean, "std": std, "min": [a * 1.2 for a in q01], "max": [b * 1.2 for b in q99]}

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


def write_tiny_checkpoint(out: str | Path, seed: int = 0) -> Path:
    """Write the tiny checkpoint to ``out`` (created). Same bytes for the same seed, every time."""
    return write_checkpoint(out, TINY_DIT, TINY_TEXT_ENCODER, TINY_IMAGE_ENCODER, TINY_VAE, seed=seed)


def write_tiny_5b_checkpoint(out: str | Path, seed: int = 0) -> Path:
    """Write the tiny Wan2.2-5B checkpoint to ``out`` (created). Same bytes for the same seed, every time."""
    return write_checkpoint(
        out, TINY_5B_DIT, TINY_TEXT_ENCODER, TINY_IMAGE_ENCODER, TINY_5B_VAE, seed=seed,
        target_video_size=TINY_5B_TARGET_VIDEO, camera_resolution=(320, 180), version=("ardiff_tiny_5b_version", TINY_5B_VERSION),
    )  # fmt: skip


def write_checkpoint(
    out: str | Path,
    dit_cfg: DiTConfig,
    text_encoder_cfg: dict,
    image_encoder_cfg: dict,
    vae_cfg: dict,
    seed: int = 0,
    *,
    target_video_size: tuple[int, int] | None = None,
    camera_resolution: tuple[int, int] | None = None,
    version: tuple[str, int] = ("ardiff_tiny_version", TINY_VERSION),
) -> Path:
    """Write a random-weight checkpoint of any geometry in the released layout (the tiny
    tokenizer and DROID-like statistics included). ``text_encoder_cfg`` leaves out
    ``vocab_size``: it is sized to the tiny tokenizer. Benchmarks use this for real token
    geometry at small width (scripts/bench_chunk.py). A ``vae_cfg`` with ``is_residual`` writes the
    Wan2.2 VAE (the 5B layout), ``target_video_size`` its resize target (``checkpoint_config``)."""
    out = Path(out)
    (out / "experiment_cfg").mkdir(parents=True, exist_ok=True)
    tokenizer = tiny_tokenizer()
    tokenizer.save_pretrained(out / "tokenizer")
    text_encoder = {**text_encoder_cfg, "vocab_size": 8 * math.ceil(len(tokenizer) / 8)}

    layout = checkpoint_layout(dit_cfg, text_encoder, image_encoder_cfg, vae_cfg)
    generator = torch.Generator().manual_seed(seed)
    tensors = {name: _init(name, shape, generator).contiguous() for name, shape in sorted(layout.items())}
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
    _write_json(out / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})

    # Every key of the released config.json, in its sections (upstream_layout.RELEASED_*_KEYS).
    config = {
        **checkpoint_config(dit_cfg, text_encoder, image_encoder_cfg, vae_cfg, target_video_size=target_video_size),
        version[0]: version[1],
    }
    _write_json(out / "config.json", config)
    _write_json(out / "experiment_cfg" / "metadata.json", droid_metadata(camera_resolution))
    return out


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def _definition_digest(family: str = "14b") -> str:
    """Changes whenever anything that shapes the checkpoint's bytes changes (cache key)."""
    if family == "5b":
        spec = [TINY_5B_VERSION, TINY_5B_DIT.to_dict(), TINY_TEXT_ENCODER, TINY_IMAGE_ENCODER, TINY_5B_VAE,
                TINY_5B_TARGET_VIDEO, _CORPUS, droid_metadata((320, 180))]  # fmt: skip
    else:
        spec = [TINY_VERSION, TINY_DIT.to_dict(), TINY_TEXT_ENCODER, TINY_IMAGE_ENCODER, TINY_VAE, _CORPUS, droid_metadata()]
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:10]


def default_cache_dir(family: str = "14b") -> Path:
    root = os.environ.get("ARDIFF_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ardiff-server"
    if family == "5b":
        return Path(root) / f"tiny-dreamzero-5b-v{TINY_5B_VERSION}-{_definition_digest('5b')}"
    return Path(root) / f"tiny-dreamzero-v{TINY_VERSION}-{_definition_digest()}"


def ensure_tiny_checkpoint(path: str | Path | None = None, family: str = "14b") -> Path:
    """The tiny checkpoint's directory (``family`` "14b": builtin:tiny, "5b": builtin:tiny_5b), generating it on
    first use (safe across processes)."""
    if family not in ("14b", "5b"):
        raise ValueError(f"tiny checkpoint family must be '14b' or '5b', got {family!r}")
    target = Path(path) if path is not None else default_cache_dir(family)
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be writing it right now
        if not (target / "config.json").exists():
            staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
            try:
                (write_tiny_5b_checkpoint if family == "5b" else write_tiny_checkpoint)(staging)
                shutil.rmtree(target, ignore_errors=True)
                staging.rename(target)  # atomic: readers never see a half-written checkpoint
            finally:
                shutil.rmtree(staging, ignore_errors=True)
    return target
