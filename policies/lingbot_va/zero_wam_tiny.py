"""The tiny Zero-WAM: the released architecture at toy width, as a checkpoint on disk.

:func:`write_tiny_zero_wam_checkpoint` writes a checkpoint in the released layout
(``robbyant-research/zero-wam-*``: ``transformer/`` holding ``WanICLTransformer3DModel``'s config and
state dict, including what serving drops: the ``patch_embedding`` Conv3d, the multi-chunk prediction
heads, the cross-attention aliases; ``vae/``, ``text_encoder/``, ``tokenizer/`` as the tiny LingBot-VA's,
:mod:`ardiff_policies.lingbot_va.tiny`) with seeded random weights. :func:`ensure_tiny_zero_wam_checkpoint`
caches it under ``~/.cache/ardiff-server`` keyed by a digest of what shapes its bytes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from ardiff_policies.lingbot_va import tiny
from ardiff_policies.lingbot_va.embodiments import ZERO_WAM_ROBOTWIN
from ardiff_policies.lingbot_va.zero_wam_checkpoint import ZeroWAMConfig
from ardiff_policies.lingbot_va.zero_wam_demonstration import DemonstrationGeometry
from ardiff_policies.lingbot_va.zero_wam_model import CROSS_ALIASES, ZeroWAMTransformer, alias_tensors, dropped_tensors
from ardiff_policies.wan.tiny import cache_root, ensure_generated, init_tensor, write_json

TINY_ZERO_WAM_VERSION = 2
TINY_ZERO_WAM_SEED = 36
# LingBot-VA's tiny sizes (so the text encoder and VAE are the same), the action expert's feed-forward at another
# width than the video's (so a swap of the two is caught), one MCP head reading both layers, a window of two chunks.
TINY_ZERO_WAM = ZeroWAMConfig(
    base=dataclasses.replace(tiny.TINY_TRANSFORMER),
    action_inner_dim=tiny.TINY_TRANSFORMER.dim,
    action_ffn_dim=144,
    attn_window=4,
    num_mcp_modules=1,
    mcp_blocks_per_group=1,
    mcp_hidden_collect_layers=(0, 1),
)

# Zero-WAM's RoboTwin at toy size: three 32x64 cameras side by side (a 2x12 latent frame, 6 tokens), 2-frame chunks of
# 16 actions (pages of gcd(12, 32) = 4 tokens: a chunk's video 3 pages, its actions 8), 2 video and 2 action steps;
# the window is the tiny transformer's (4 frame ids: two chunks).
TINY_ZERO_WAM_EMBODIMENT = dataclasses.replace(
    ZERO_WAM_ROBOTWIN, height=32, width=64, attn_window=TINY_ZERO_WAM.attn_window, num_inference_steps=2, action_num_inference_steps=2
)
# Demonstrations at toy size: 4x4 latent frames (4 tokens, one page), at most 4 of them.
TINY_DEMONSTRATIONS = DemonstrationGeometry(latent_size=(4, 4), max_frames=4)
# builtin:tiny's demonstration root: id -> (latent frames, whether the file carries its own text)
TINY_DEMONSTRATION_IDS = {"tiny/wave": (2, True), "tiny/stack_blocks/episode0": (3, False)}
TINY_DEMONSTRATION_SEED = 37


def tiny_zero_wam_state(cfg: ZeroWAMConfig, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """A released-layout state dict: the served parameters, then what upstream holds besides (seeded draws)."""
    with torch.device("meta"):
        served = {name: tuple(p.shape) for name, p in ZeroWAMTransformer(cfg).state_dict().items()}
    state = {}
    for name, shape in sorted((served | dropped_tensors(cfg)).items()):
        state[name] = init_tensor(name.replace("scale_shift_table", "modulation"), shape, generator).contiguous()
    for alias in sorted(alias_tensors(served | dropped_tensors(cfg))):
        head, _, tail = alias.partition("attn2.")
        name, _, leaf = tail.partition(".")
        state[alias] = state[f"{head}attn2.{CROSS_ALIASES[name]}.{leaf}"].clone()
    return state


def write_tiny_zero_wam_checkpoint(out: str | Path, cfg: ZeroWAMConfig = TINY_ZERO_WAM, seed: int = TINY_ZERO_WAM_SEED) -> Path:
    """Write the tiny checkpoint to ``out`` (created). Same bytes for the same inputs and library versions."""
    out = Path(out)
    tiny.write_tiny_checkpoint(out)  # vae / text_encoder / tokenizer: the tiny LingBot-VA's
    shutil.rmtree(out / "transformer")
    (out / "transformer").mkdir()
    write_json(out / "transformer" / "config.json", cfg.to_dict())
    generator = torch.Generator().manual_seed(seed)
    save_file(tiny_zero_wam_state(cfg, generator), out / "transformer" / "diffusion_pytorch_model.safetensors", metadata={"format": "pt"})
    return out


def definition_digest() -> str:
    spec = [TINY_ZERO_WAM_VERSION, TINY_ZERO_WAM_SEED, TINY_ZERO_WAM.to_dict(), tiny.definition_digest()]
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:10]


def default_cache_dir() -> Path:
    return cache_root() / f"tiny-zero-wam-v{TINY_ZERO_WAM_VERSION}-{definition_digest()}"


def ensure_tiny_zero_wam_checkpoint(path: str | Path | None = None) -> Path:
    """The tiny checkpoint's directory, generated on first use (safe across processes)."""
    target = Path(path) if path is not None else default_cache_dir()
    return ensure_generated(target, "transformer/config.json", write_tiny_zero_wam_checkpoint)


def write_tiny_demonstrations(out: str | Path, cfg: ZeroWAMConfig = TINY_ZERO_WAM) -> Path:
    """``builtin:tiny``'s demonstration root: a ``.pth`` per id in upstream's layout (``latent`` (1, 48, F, 4, 4),
    optionally ``text_emb`` (T, text_dim)), seeded draws."""
    out = Path(out)
    generator = torch.Generator().manual_seed(TINY_DEMONSTRATION_SEED)
    h, w = TINY_DEMONSTRATIONS.latent_size
    for demo_id, (frames, with_text) in sorted(TINY_DEMONSTRATION_IDS.items()):
        item = {"latent": torch.randn(1, 48, frames, h, w, generator=generator)}
        if with_text:
            item["text_emb"] = torch.randn(7, cfg.base.text_dim, generator=generator)
        path = out / f"{demo_id}.pth"
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(item, path)
    return out


def ensure_tiny_demonstrations(path: str | Path | None = None) -> Path:
    """``builtin:tiny``'s demonstration root, generated on first use."""
    target = Path(path) if path is not None else cache_root() / f"tiny-zero-wam-demonstrations-v{TINY_ZERO_WAM_VERSION}-{definition_digest()}"
    return ensure_generated(target, f"{next(iter(sorted(TINY_DEMONSTRATION_IDS)))}.pth", write_tiny_demonstrations)
