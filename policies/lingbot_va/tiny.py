"""The tiny LingBot-VA: the released architecture at toy width, as a checkpoint on disk.

:func:`write_tiny_checkpoint` deterministically writes a checkpoint in the released layout
(``robbyant/lingbot-va-*``: diffusers-style ``transformer/``, ``vae/``, ``text_encoder/``,
``tokenizer/`` directories, each loadable by its library's ``from_pretrained``), with random
weights from a seeded generator. :func:`ensure_tiny_checkpoint` caches it under
``~/.cache/ardiff-server`` (``$ARDIFF_CACHE_DIR``), keyed by a digest of everything that shapes its
bytes. Nothing is downloaded and no weights are committed.

Geometry: a 2-layer, width-96 (4 heads x 24) transformer over the Wan2.2 VAE's 48 latent channels
and 30 action channels; UMT5 at width 32 (``text_dim``); the Wan2.2 VAE at toy width (z_dim 48,
16x spatial, 4x temporal: its latent statistics are the real ones).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from ardiff_policies.lingbot_va.checkpoint import TransformerConfig
from ardiff_policies.lingbot_va.embodiments import ROBOTWIN
from ardiff_policies.lingbot_va.model import LingBotVATransformer
from ardiff_policies.lingbot_va.upstream_configs import LIBERO
from ardiff_policies.wan.text import TextEncoder
from ardiff_policies.wan.tiny import TINY_TEXT_ENCODER, cache_root, ensure_generated, init_tensor, tiny_tokenizer, write_json
from ardiff_policies.wan.vae import WAN22_VAE_CONFIG, VideoVAE

TINY_VERSION = 1
TINY_SEED = 27
TINY_TRANSFORMER = TransformerConfig(
    num_attention_heads=4,
    attention_head_dim=24,
    text_dim=TINY_TEXT_ENCODER["d_model"],
    freq_dim=32,
    ffn_dim=192,
    num_layers=2,
)
TINY_VAE = {"base_dim": 4, "decoder_base_dim": 8, "num_res_blocks": 1}
# RoboTwin's embodiment at toy size and few steps: the T layout (64x96 high camera, 32x48 wrists -> a 6x6 latent
# frame, 9 tokens), 2-frame chunks of 16 actions (pages of gcd(18, 32) = 2 tokens), a window of two chunks, 2 video
# and 2 action steps.
TINY_EMBODIMENT = dataclasses.replace(ROBOTWIN, height=64, width=96, attn_window=4, num_inference_steps=2, action_num_inference_steps=2)
# LIBERO's embodiment (upstream_configs.LIBERO: two cameras side by side, 4-frame chunks of 4 actions, channels 0-6, its
# quantiles and shifts) at toy size: 64x64 cameras -> a 4x8 latent frame (8 tokens), 32 + 16 tokens a chunk (pages of
# 16), a window of two chunks, 2 video and 2 action steps. The same tiny checkpoint: the embodiment is not in it.
TINY_LIBERO_EMBODIMENT = dataclasses.replace(LIBERO, height=64, width=64, attn_window=4, num_inference_steps=2, action_num_inference_steps=2)

# Words of the tiny tokenizer: RoboTwin-style instructions.
CORPUS = """
grab the medium-sized white mug rotate it place on table and hook onto smooth dark gray rack
pick up put move open close push pull stack lift press click ring bell beat block hammer
bottle bowl cup plate cube shoe box drawer microwave laptop red green blue yellow left right
arm with both arms into in of to from a an
"""


def _fill(module: torch.nn.Module, generator: torch.Generator) -> None:
    """Replace every parameter by a seeded draw of its kind (sorted names: the same bytes every time)."""
    with torch.no_grad():
        for name, param in sorted(module.named_parameters()):
            param.copy_(init_tensor(name, tuple(param.shape), generator))


def _transformer_state(cfg: TransformerConfig, generator: torch.Generator) -> dict[str, torch.Tensor]:
    model = LingBotVATransformer(cfg)
    state = {}
    for name, param in sorted(model.state_dict().items()):
        state[name] = init_tensor(name.replace("scale_shift_table", "modulation"), tuple(param.shape), generator).contiguous()
    # upstream's state dict also holds the action embedder's never-used copy of the text projection
    for name in ("linear_1.weight", "linear_1.bias", "linear_2.weight", "linear_2.bias"):
        src = state[f"condition_embedder.text_embedder.{name}"]
        state[f"condition_embedder_action.text_embedder.{name}"] = src.clone()
    return state


def write_tiny_checkpoint(out: str | Path, cfg: TransformerConfig = TINY_TRANSFORMER, seed: int = TINY_SEED) -> Path:
    """Write the tiny checkpoint to ``out`` (created). Same bytes for the same inputs and library versions."""
    out = Path(out)
    generator = torch.Generator().manual_seed(seed)

    (out / "transformer").mkdir(parents=True, exist_ok=True)
    write_json(out / "transformer" / "config.json", cfg.to_dict())
    save_file(_transformer_state(cfg, generator), out / "transformer" / "diffusion_pytorch_model.safetensors", metadata={"format": "pt"})

    tokenizer = tiny_tokenizer(CORPUS)
    tokenizer.save_pretrained(out / "tokenizer")

    text_encoder = TextEncoder.from_config({**TINY_TEXT_ENCODER, "vocab_size": 8 * math.ceil(len(tokenizer) / 8)}).model
    if text_encoder.config.d_model != cfg.text_dim:
        raise ValueError(f"text encoder width {text_encoder.config.d_model} != transformer text_dim {cfg.text_dim}")
    _fill(text_encoder, generator)
    text_encoder.save_pretrained(out / "text_encoder")

    vae = VideoVAE.from_config(TINY_VAE, base=WAN22_VAE_CONFIG).model
    _fill(vae, generator)
    vae.save_pretrained(out / "vae")
    return out


def definition_digest() -> str:
    """Changes whenever anything that shapes the checkpoint's bytes changes (the cache key)."""
    import diffusers
    import transformers

    spec = [
        TINY_VERSION,
        TINY_SEED,
        TINY_TRANSFORMER.to_dict(),
        TINY_TEXT_ENCODER,
        TINY_VAE,
        CORPUS,
        diffusers.__version__,
        transformers.__version__,
        torch.__version__.split("+")[0],
    ]
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:10]


def default_cache_dir() -> Path:
    return cache_root() / f"tiny-lingbot-va-v{TINY_VERSION}-{definition_digest()}"


def ensure_tiny_checkpoint(path: str | Path | None = None) -> Path:
    """The tiny checkpoint's directory, generated on first use (safe across processes)."""
    target = Path(path) if path is not None else default_cache_dir()
    return ensure_generated(target, "transformer/config.json", write_tiny_checkpoint)
