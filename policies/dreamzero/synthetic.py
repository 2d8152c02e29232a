"""A synthetic DreamZero: the released architecture with random weights made on the device.

``policy.checkpoint: synthetic:droid`` builds GEAR-Dreams/DreamZero-DROID's exact geometry
(Wan2.1-I2V-14B causal DiT: 40 layers, dim 5120, 40 heads x 128, ffn 13824, 880 tokens per
latent frame; UMT5-XXL text encoder; open-CLIP ViT-H/14 image tower; Wan2.1 VAE; the action
register) with no checkpoint and nothing downloaded. It exists to measure the real model's
speed and memory on a GPU (``scripts/gpu_check.py``); its actions are meaningless.

Construction: every module is built on the meta device (as :meth:`DreamZeroModel.load` does),
then filled on the target device by :func:`ardiff_policies.wan.synthetic.materialize` (seeded,
device-side, in the target dtype: the 14B DiT and the 5.7B UMT5 go straight to ~46 GB of bf16 on
the GPU in a second or so).

Spec string: ``synthetic:<preset>[,key=value...]``. Presets:

* ``droid``       the released DreamZero-DROID geometry (use view_size 176x320);
* ``droid_5b``    upstream's Wan2.2-TI2V-5B DreamZero (``wan_flow_matching_action_tf_wan22``): a ``ti2v`` DiT of
  30 layers at dim 3072 (24 heads x 128, ffn 14336) on 48-channel latents without the ``ys`` concat,
  the Wan2.2 VAE (16x), 160x320 views resized to 160x320 -> 50 tokens per latent frame;
* ``tiny_5b``     the 5B at toy widths and full depth with ``builtin:tiny_5b``'s token geometry (18 tokens
  per latent frame, view_size 96x192);
* ``droid-small`` the same token geometry (880 tokens per latent frame, 176x320 views) and depth
  of every component at toy widths;
* ``tiny``        full depth of every component at toy widths and the tiny model's token geometry
  (60 tokens per latent frame, view_size 48x80): a CPU runs it in seconds per call.

Overrides (integers): ``layers dim heads ffn`` (DiT), ``text_layers text_dim text_heads text_ff
text_vocab`` (UMT5), ``clip_layers clip_dim clip_heads clip_mlp`` (CLIP), ``vae_dim vae_res vae_dec_dim``
(VAE base width, residual blocks, decoder width), ``seed``. E.g. ``synthetic:droid,layers=2`` is two of the
forty DiT layers at full width.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ardiff_policies.dreamzero.config import SYNTHETIC_PREFIX
from ardiff_policies.dreamzero.dit import CausalWanModel, DiTConfig
from ardiff_policies.dreamzero.encoders import CLIP_VIT_H_14_CONFIG, ImageEncoder
from ardiff_policies.dreamzero.model import ActionHeadConfig, DreamZeroModel, check_dit_fits_vae
from ardiff_policies.errors import StartRefused
from ardiff_policies.wan.synthetic import materialize
from ardiff_policies.wan.text import UMT5_XXL_ENCODER_CONFIG, TextEncoder
from ardiff_policies.wan.vae import WAN21_VAE_CONFIG, WAN22_VAE_CONFIG, VideoVAE

logger = logging.getLogger(__name__)

# The tiny model's widths (policies/dreamzero/tiny.py), at the released model's depths.
_TOY_TEXT = {"d_model": 32, "d_kv": 8, "num_heads": 4, "d_ff": 64, "num_layers": 24, "vocab_size": 256}
_TOY_CLIP = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 32, "num_attention_heads": 4, "projection_dim": 32}
_TOY_VAE = {"base_dim": 4}
_TOY_DIT = {"dim": 64, "ffn_dim": 128, "num_heads": 4, "text_dim": 32, "clip_dim": 32, "hidden_size": 32}


# DreamZero-DROID's action head (config.json ``action_head_cfg.config``).
DROID_HEAD = ActionHeadConfig(num_frames=33, num_frame_per_block=2, action_horizon=24, max_action_dim=32, max_state_dim=64)
# The 5B's (wan_flow_matching_action_tf_wan22.yaml + droid_training_full_finetune_wan22.sh): the same, resized to 160x320.
DROID_5B_HEAD = replace(DROID_HEAD, target_video_size=(160, 320))
# Wan2.2-TI2V-5B's DiT (docs/WAN22_BACKBONE.md of upstream; the yaml's diffusion_model_cfg).
DROID_5B_DIT = DiTConfig(
    model_type="ti2v",
    dim=3072,
    ffn_dim=14336,
    num_heads=24,
    num_layers=30,
    in_dim=48,
    out_dim=48,
    frame_seqlen=50,
    concat_first_frame_latent=False,
)


@dataclass(frozen=True)
class SyntheticSpec:
    """Everything that shapes a synthetic DreamZero."""

    preset: str
    dit: DiTConfig
    text_encoder: dict[str, Any] = field(default_factory=dict)  # overrides of UMT5_XXL_ENCODER_CONFIG
    image_encoder: dict[str, Any] = field(default_factory=dict)  # overrides of CLIP_VIT_H_14_CONFIG
    vae: dict[str, Any] = field(default_factory=dict)  # overrides of vae_base
    view_size: tuple[int, int] = (176, 320)  # per-view (h, w) that gives dit.frame_seqlen tokens
    seed: int = 0
    head: ActionHeadConfig = DROID_HEAD
    vae_base: dict[str, Any] = field(default_factory=lambda: dict(WAN21_VAE_CONFIG))  # WAN22_VAE_CONFIG for the 5B

    @property
    def text_config(self) -> dict[str, Any]:
        return {**UMT5_XXL_ENCODER_CONFIG, **self.text_encoder}

    @property
    def image_config(self) -> dict[str, Any]:
        return {**CLIP_VIT_H_14_CONFIG, **self.image_encoder}

    @property
    def vae_config(self) -> dict[str, Any]:
        return {**self.vae_base, **self.vae}

    def describe(self) -> str:
        d, t, c, v = self.dit, self.text_config, self.image_config, self.vae_config
        return (
            f"DiT {d.num_layers} x dim {d.dim} ({d.num_heads} heads x {d.head_dim}, ffn {d.ffn_dim}), "
            f"{d.frame_seqlen} tokens/latent frame; UMT5 {t['num_layers']} x {t['d_model']} (vocab {t['vocab_size']}); "
            f"CLIP {c['num_hidden_layers']} x {c['hidden_size']}; {'Wan2.2' if v.get('is_residual') else 'Wan2.1'} VAE base {v['base_dim']}"
        )


PRESETS: dict[str, SyntheticSpec] = {
    "droid": SyntheticSpec("droid", DiTConfig()),
    "droid-small": SyntheticSpec(
        "droid-small", DiTConfig(**_TOY_DIT), text_encoder=dict(_TOY_TEXT), image_encoder=dict(_TOY_CLIP), vae=dict(_TOY_VAE)
    ),
    "tiny": SyntheticSpec(
        "tiny",
        DiTConfig(**_TOY_DIT, frame_seqlen=60),
        text_encoder=dict(_TOY_TEXT),
        image_encoder=dict(_TOY_CLIP),
        vae=dict(_TOY_VAE),
        view_size=(48, 80),
    ),
    "droid_5b": SyntheticSpec("droid_5b", DROID_5B_DIT, view_size=(160, 320), head=DROID_5B_HEAD, vae_base=dict(WAN22_VAE_CONFIG)),
    "tiny_5b": SyntheticSpec(
        "tiny_5b",
        replace(DROID_5B_DIT, **_TOY_DIT, frame_seqlen=18),
        text_encoder=dict(_TOY_TEXT),
        image_encoder=dict(_TOY_CLIP),
        vae={"base_dim": 4, "decoder_base_dim": 8},
        view_size=(96, 192),
        head=replace(DROID_HEAD, target_video_size=(96, 192)),
        vae_base=dict(WAN22_VAE_CONFIG),
    ),
}

_DIT_KEYS = {"layers": "num_layers", "dim": "dim", "heads": "num_heads", "ffn": "ffn_dim"}
_TEXT_KEYS = {"text_layers": "num_layers", "text_dim": "d_model", "text_heads": "num_heads", "text_ff": "d_ff", "text_vocab": "vocab_size"}
_CLIP_KEYS = {"clip_layers": "num_hidden_layers", "clip_dim": "hidden_size", "clip_heads": "num_attention_heads", "clip_mlp": "intermediate_size"}
_VAE_KEYS = {"vae_dim": "base_dim", "vae_res": "num_res_blocks", "vae_dec_dim": "decoder_base_dim"}


def is_synthetic(checkpoint: str) -> bool:
    return checkpoint.startswith(SYNTHETIC_PREFIX)


class SyntheticSpecError(StartRefused, ValueError):
    """A ``synthetic:`` checkpoint string that names no preset or a bad key: a setting, so a worker
    logs it in one line (StartRefused), and it is a ValueError for everyone else."""


def parse_spec(checkpoint: str) -> SyntheticSpec:
    """``synthetic:<preset>[,key=value...]`` -> :class:`SyntheticSpec`. Raises SyntheticSpecError (a ValueError) naming the problem."""
    if not is_synthetic(checkpoint):
        raise SyntheticSpecError(f"not a synthetic checkpoint: {checkpoint!r} (expected {SYNTHETIC_PREFIX}<preset>)")
    name, *items = checkpoint[len(SYNTHETIC_PREFIX) :].split(",")
    if name not in PRESETS:
        raise SyntheticSpecError(f"unknown synthetic preset {name!r} in {checkpoint!r}; known: {sorted(PRESETS)}")
    spec = PRESETS[name]
    groups: dict[str, dict[str, Any]] = {"dit": {}, "text": dict(spec.text_encoder), "image": dict(spec.image_encoder), "vae": dict(spec.vae)}
    tables = {"dit": _DIT_KEYS, "text": _TEXT_KEYS, "image": _CLIP_KEYS, "vae": _VAE_KEYS}
    given: set[str] = set()
    seed = spec.seed
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        try:
            value = int(raw)
        except ValueError:
            value = None
        if not sep or value is None or value < 0:
            raise SyntheticSpecError(f"synthetic checkpoint {checkpoint!r}: expected key=<non-negative int>, got {item!r}")
        given.add(key)
        if key == "seed":
            seed = value
            continue
        group = next((g for g, table in tables.items() if key in table), None)
        if group is None:
            known = sorted([k for table in tables.values() for k in table] + ["seed"])
            raise SyntheticSpecError(f"synthetic checkpoint {checkpoint!r}: unknown key {key!r}; known: {known}")
        groups[group][tables[group][key]] = value
    dit, text = groups["dit"], groups["text"]
    if "dim" in given and "ffn" not in given:  # keep DROID's ffn / dim ratio
        dit["ffn_dim"] = max(64, round(dit["dim"] * 13824 / 5120 / 64) * 64)
    if given & {"text_dim", "text_heads"}:  # UMT5's head width follows d_model / heads
        merged = {**UMT5_XXL_ENCODER_CONFIG, **text}
        text["d_kv"] = merged["d_model"] // merged["num_heads"]
    text_dim = {**UMT5_XXL_ENCODER_CONFIG, **text}["d_model"]
    clip_dim = {**CLIP_VIT_H_14_CONFIG, **groups["image"]}["hidden_size"]
    dit_cfg = replace(spec.dit, **dit, text_dim=text_dim, clip_dim=clip_dim)
    if dit_cfg.dim % dit_cfg.num_heads or (dit_cfg.dim // dit_cfg.num_heads) % 2:
        raise SyntheticSpecError(f"synthetic checkpoint {checkpoint!r}: dim {dit_cfg.dim} must split into {dit_cfg.num_heads} heads of even width")
    return replace(spec, dit=dit_cfg, text_encoder=text, image_encoder=groups["image"], vae=groups["vae"], seed=seed)


# ------------------------------------------------------------------------------ building


def meta_modules(spec: SyntheticSpec) -> tuple[CausalWanModel, TextEncoder, ImageEncoder, VideoVAE]:
    """The four networks on the meta device (no memory): DiT, text encoder, image encoder, VAE."""
    with torch.device("meta"):
        return (
            CausalWanModel(spec.dit),
            TextEncoder.from_config(spec.text_encoder),
            ImageEncoder.from_config(spec.image_encoder),
            VideoVAE.from_config(spec.vae, base=spec.vae_base),
        )


def build_model(
    spec: SyntheticSpec,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    text_encoder_device: torch.device | str | None = None,
    image_encoder_device: torch.device | str | None = None,
) -> DreamZeroModel:
    """The synthetic DreamZero on ``device`` in ``dtype`` (see the module docstring); the text /
    image encoders on their own devices if given."""
    from ardiff_policies.dreamzero.tiny import CORPUS, droid_metadata
    from ardiff_policies.wan.tiny import tiny_tokenizer

    device = torch.device(device)
    start = time.perf_counter()
    dit, text_encoder, image_encoder, vae = meta_modules(spec)
    depths = (spec.dit.num_layers, spec.text_config["num_layers"], spec.image_config["num_hidden_layers"], 1)
    devices = [device, torch.device(text_encoder_device or device), torch.device(image_encoder_device or device), device]
    generators: dict[torch.device, torch.Generator] = {}
    for module, depth, module_device in zip((dit, text_encoder, image_encoder, vae), depths, devices):
        if module_device not in generators:  # one seeded stream per device (a generator lives on one)
            generators[module_device] = torch.Generator(device=module_device).manual_seed(spec.seed)
        materialize(module, device=module_device, dtype=dtype, generator=generators[module_device], depth=depth)
    tokenizer = tiny_tokenizer(CORPUS)  # the tiny word-level tokenizer: its ids are a subset of any vocab here
    if len(tokenizer) > spec.text_config["vocab_size"]:
        raise ValueError(f"text_vocab {spec.text_config['vocab_size']} is smaller than the tokenizer's {len(tokenizer)} ids")
    if image_encoder.dim != spec.dit.clip_dim or image_encoder.num_tokens != spec.dit.num_image_tokens:
        raise ValueError(
            f"image encoder gives {image_encoder.num_tokens} tokens of width {image_encoder.dim}, the DiT expects "
            f"{spec.dit.num_image_tokens} of width {spec.dit.clip_dim}"
        )
    for module_device in generators:
        if module_device.type == "cuda":
            torch.cuda.synchronize(module_device)
    params = sum(p.numel() for m in (dit, text_encoder, image_encoder, vae) for p in m.parameters())
    logger.info(
        "synthetic DreamZero %s: %.2f B parameters on %s (%s) in %.1f s", spec.preset, params / 1e9, device, dtype, time.perf_counter() - start
    )
    check_dit_fits_vae(spec.dit, vae)
    # the cameras' recorded resolution, as a 5B run writes it (DROID's 320 x 180); the 5B is served at its target size
    metadata = droid_metadata((320, 180) if vae.is_wan22 else None)
    return DreamZeroModel(dit, text_encoder, image_encoder, vae, tokenizer, spec.head, metadata)


_resident: tuple | None = None  # the key of the model _cached_model holds


@functools.lru_cache(maxsize=1)
def _cached_model(checkpoint: str, dtype: torch.dtype, device: str, text_device: str, image_device: str) -> DreamZeroModel:
    global _resident
    model = build_model(parse_spec(checkpoint), dtype=dtype, device=device, text_encoder_device=text_device, image_encoder_device=image_device)
    _resident = (checkpoint, dtype, device, text_device, image_device)
    return model


def _key(checkpoint: str, dtype: torch.dtype, device, text_encoder_device, image_encoder_device) -> tuple:
    name = lambda d: str(torch.device(d if d is not None else device))  # noqa: E731
    return checkpoint, dtype, name(device), name(text_encoder_device), name(image_encoder_device)


def synthetic_model(
    checkpoint: str,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    text_encoder_device: torch.device | str | None = None,
    image_encoder_device: torch.device | str | None = None,
) -> DreamZeroModel:
    """The model for a ``synthetic:`` checkpoint. The last one built is kept, so that several
    engines in one process (gpu_check's variants) share one set of weights instead of holding
    two copies of a 46 GB model; call :func:`release_cached_model` to drop it."""
    return _cached_model(*_key(checkpoint, dtype, device, text_encoder_device, image_encoder_device))


def is_resident(
    checkpoint: str,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    text_encoder_device: torch.device | str | None = None,
    image_encoder_device: torch.device | str | None = None,
) -> bool:
    """Whether :func:`synthetic_model` would return the model it keeps (no new weights allocated)."""
    return _resident == _key(checkpoint, dtype, device, text_encoder_device, image_encoder_device)


def release_cached_model() -> None:
    global _resident
    _cached_model.cache_clear()
    _resident = None


def parameter_bytes(model: DreamZeroModel) -> dict[str, int]:
    """Bytes of parameters per component (text, vision, vae, dit)."""
    parts = {"dit": model.dit, "text": model.text_encoder, "vision": model.image_encoder, "vae": model.vae}
    return {name: sum(p.numel() * p.element_size() for p in module.parameters()) for name, module in parts.items()}
