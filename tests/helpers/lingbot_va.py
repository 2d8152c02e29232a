"""The LingBot-VA tests' shared parts: the parity inputs, drawn as scripts/record_upstream_lingbot_va.py draws them, and a
KV cache for the tiny policy."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from ardiff_kv import PagedKVCache

REFERENCE = Path(__file__).parents[1] / "reference_data" / "upstream_lingbot_va_tiny"
ATOL = 1e-5  # float32, max abs error against upstream


def load_reference() -> tuple[dict, dict[str, torch.Tensor]]:
    return json.loads(REFERENCE.with_suffix(".json").read_text()), load_file(REFERENCE.with_suffix(".safetensors"))


def randn(shape, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)


def text_embeddings(meta: dict, dim: int) -> torch.Tensor:
    """(2, tokens, dim): the prompt and the negative prompt, zeros past their lengths (upstream's padding)."""
    text = randn((2, meta["text_tokens"], dim), 7)
    for row, length in enumerate(meta["prompt_tokens"]):
        text[row, length:] = 0
    return text


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()


def make_cache(policy, sessions: int = 2) -> PagedKVCache:
    """A pool for ``sessions`` sessions of both branches, batched together, with the headroom a batch's undo keeps."""
    spec = policy.kv_spec()
    return PagedKVCache(
        spec,
        num_pages=sessions * 2 * spec.pages_per_branch + PagedKVCache.undo_headroom(spec, 2, sessions) + 1,
        max_sessions=sessions,
        attention_backend="sdpa",
        max_batch=sessions,
    )


def cameras(engine, frames: int, seed: int) -> dict[str, np.ndarray]:
    """Random uint8 frames for every camera of the engine's LingBot-VA policy, ``frames`` per camera, at its sizes."""
    rng = np.random.default_rng(seed)
    policy = engine.policy
    return {name: rng.integers(0, 256, (frames, h, w, 3), dtype=np.uint8) for name, (h, w) in zip(policy.cameras, policy.schema.resolutions)}
