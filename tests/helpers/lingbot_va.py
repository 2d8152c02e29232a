"""Inputs of the LingBot-VA parity tests, drawn as scripts/record_upstream_lingbot_va.py draws them."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

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
