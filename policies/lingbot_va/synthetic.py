"""A synthetic LingBot-VA: the released architecture with random weights made on the device (no checkpoint, nothing
downloaded), to measure the real model's speed and memory on a GPU (``scripts/gpu_check.py --family lingbot_va``).
Its actions are meaningless.

``policy.checkpoint: synthetic:<preset>[,layers=N][,seed=N]``:

* ``released``: upstream's ``WanTransformer3DModel`` at the released 5B's sizes (30 layers, 24 heads x 128, FFN 14336,
  48 latent and 30 action channels, text width 4096), UMT5-XXL, the Wan2.2 VAE;
* ``tiny``: ``builtin:tiny``'s sizes (a CPU runs it in a fraction of a second per chunk).

The ``zero_wam`` policy takes the same presets (:func:`synthetic_zero_wam_policy`): Zero-WAM's transformer at these
sizes with its action expert (``scripts/gpu_check.py --family zero_wam``).

``layers=N`` keeps N of the transformer's blocks. Every network is built on the meta device, then each tensor is
allocated on the device in the engine dtype and filled by a seeded device-side generator (DreamZero's
``materialize``: weights ~ N(0, 1/fan_in), norm gains 1, small biases). The tokenizer is the tiny word-level one
(its ids are a subset of UMT5's vocabulary).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ardiff_policies.lingbot_va.checkpoint import TransformerConfig
from ardiff_policies.lingbot_va.config import SYNTHETIC_PREFIX, SYNTHETIC_PRESETS
from ardiff_policies.lingbot_va.embodiments import Embodiment
from ardiff_policies.lingbot_va.episode import LingBotVAEpisodes
from ardiff_policies.lingbot_va.model import LingBotVATransformer
from ardiff_policies.lingbot_va.tiny import CORPUS, TINY_TRANSFORMER, TINY_VAE
from ardiff_policies.lingbot_va.zero_wam_checkpoint import ZeroWAMConfig
from ardiff_policies.wan.synthetic import materialize
from ardiff_policies.wan.text import UMT5_XXL_ENCODER_CONFIG, TextEncoder
from ardiff_policies.wan.tiny import TINY_TEXT_ENCODER, tiny_tokenizer
from ardiff_policies.wan.vae import WAN22_VAE_CONFIG


@dataclasses.dataclass(frozen=True)
class SyntheticSpec:
    preset: str
    transformer: TransformerConfig
    text: dict
    vae: dict
    seed: int = 0


def parse_spec(checkpoint: str) -> SyntheticSpec:
    """``synthetic:<preset>[,layers=N][,seed=N]``; ValueError naming what is wrong."""
    preset, *options = checkpoint.removeprefix(SYNTHETIC_PREFIX).split(",")
    if preset not in SYNTHETIC_PRESETS:
        raise ValueError(f"policy.checkpoint: unknown synthetic preset {preset!r}; presets: {', '.join(SYNTHETIC_PRESETS)}")
    if preset == "released":
        spec = SyntheticSpec(preset, TransformerConfig(), dict(UMT5_XXL_ENCODER_CONFIG), dict(WAN22_VAE_CONFIG))
    else:
        vocab = 8 * math.ceil(len(tiny_tokenizer(CORPUS)) / 8)
        spec = SyntheticSpec(
            preset, TINY_TRANSFORMER, {**UMT5_XXL_ENCODER_CONFIG, **TINY_TEXT_ENCODER, "vocab_size": vocab}, {**WAN22_VAE_CONFIG, **TINY_VAE}
        )
    for option in options:
        key, _, value = option.partition("=")
        if key not in ("layers", "seed") or not value.isdigit():
            raise ValueError(f"policy.checkpoint: synthetic option {option!r}: expected layers=<n> or seed=<n>")
        if key == "layers":
            if not 1 <= int(value) <= spec.transformer.num_layers:
                raise ValueError(f"policy.checkpoint: layers={value}: expected 1 to {spec.transformer.num_layers}")
            spec = dataclasses.replace(spec, transformer=dataclasses.replace(spec.transformer, num_layers=int(value)))
        else:
            spec = dataclasses.replace(spec, seed=int(value))
    return spec


def synthetic_policy(checkpoint: str, embodiment: Embodiment, *, device: str = "cpu", dtype: torch.dtype = torch.float32) -> LingBotVAEpisodes:
    spec = parse_spec(checkpoint)
    transformer, vae, text, tokenizer = _materialize(spec, lambda: LingBotVATransformer(spec.transformer), device, dtype)
    return LingBotVAEpisodes(transformer, vae, text, tokenizer, embodiment, device=device, dtype=dtype)


def zero_wam_config(spec: SyntheticSpec) -> ZeroWAMConfig:
    """Zero-WAM's transformer at the preset's shared sizes: the released one's action expert (``released``) or the
    tiny checkpoint's; without the multi-chunk heads, which serving never loads."""
    from ardiff_policies.lingbot_va.zero_wam_tiny import TINY_ZERO_WAM

    released = ZeroWAMConfig() if spec.preset == "released" else TINY_ZERO_WAM
    return dataclasses.replace(released, base=spec.transformer, enable_mcp=False)


def synthetic_zero_wam_policy(checkpoint: str, embodiment: Embodiment, *, device: str = "cpu", dtype: torch.dtype = torch.float32, **options):
    """A synthetic Zero-WAM (``policy.checkpoint: synthetic:<preset>`` of the ``zero_wam`` policy): its transformer with
    LingBot-VA's shared sizes and the action expert's, UMT5 and the VAE as :func:`synthetic_policy`'s; ``options``: the
    episode logic's keywords (demonstrations, guidance defaults)."""
    from ardiff_policies.lingbot_va.zero_wam_episode import ZeroWAMEpisodes
    from ardiff_policies.lingbot_va.zero_wam_model import ZeroWAMTransformer

    spec = parse_spec(checkpoint)
    cfg = zero_wam_config(spec)
    transformer, vae, text, tokenizer = _materialize(spec, lambda: ZeroWAMTransformer(cfg), device, dtype)
    return ZeroWAMEpisodes(transformer, vae, text, tokenizer, embodiment, device=device, dtype=dtype, **options)


def _materialize(spec: SyntheticSpec, transformer_on_meta, device: str, dtype: torch.dtype):
    """The transformer ``transformer_on_meta()`` builds, UMT5 and the VAE, each made on the device from a seeded
    generator; the tiny tokenizer."""
    from diffusers import AutoencoderKLWan
    from transformers import UMT5Config, UMT5EncoderModel

    target = torch.device(device)
    generator = torch.Generator(device=target).manual_seed(spec.seed)
    with torch.device("meta"):
        transformer = transformer_on_meta()
        text = UMT5EncoderModel(UMT5Config(**spec.text))
        vae = AutoencoderKLWan(**spec.vae)
    materialize(transformer, device=target, dtype=dtype, generator=generator, depth=spec.transformer.num_layers)
    materialize(text, device=target, dtype=dtype, generator=generator, depth=spec.text["num_layers"])
    materialize(vae, device=target, dtype=dtype, generator=generator, depth=1)
    return transformer, vae, TextEncoder(text).to(target).eval(), tiny_tokenizer(CORPUS)
