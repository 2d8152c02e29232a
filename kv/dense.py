"""Upstream DreamZero KV semantics, kept as the reference the paged path is tested against.

Per layer a contiguous ``(1, tokens, heads, head_dim)`` K and V. Every forward concatenates
the new keys onto the cache and keeps the last ``window_tokens``
(``cat(cache, new)[-window:]``); a forward with ``update=True`` (a prefill) then replaces the
cache with that result, others (denoise steps) leave it untouched. Extra tokens (the
action/state register) are appended after the window and never cached. Every forward copies
the whole window; that copy traffic is what the paged cache avoids (see scripts/bench_kv.py).

A pinned prefix (upstream Zero-WAM's in-context block, kept for the whole episode): a forward with
``pin=True`` appends its keys to the prefix, which the window never slices; every forward attends to
the prefix first (``attend_pinned=False``: not), then its window.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class DenseKVCache:
    def __init__(self, num_layers: int, window_tokens: int) -> None:
        self.num_layers = num_layers
        self.window_tokens = window_tokens
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.pinned_keys: list[torch.Tensor | None] = [None] * num_layers
        self.pinned_values: list[torch.Tensor | None] = [None] * num_layers

    @property
    def num_tokens(self) -> int:
        return 0 if self.keys[0] is None else self.keys[0].shape[1]

    def layers(self, *, update: bool, pin: bool = False, attend_pinned: bool = True) -> list[DenseLayerKV]:
        """Per-layer handles for one forward; ``update`` makes it a prefill that rewrites the cache, ``pin`` one
        that appends to the pinned prefix (it sees the prefix and itself only)."""
        return [DenseLayerKV(self, i, update, pin=pin, attend_pinned=attend_pinned) for i in range(self.num_layers)]

    def reset(self) -> None:
        self.keys = [None] * self.num_layers
        self.values = [None] * self.num_layers
        self.pinned_keys = [None] * self.num_layers
        self.pinned_values = [None] * self.num_layers


class DenseLayerKV:
    def __init__(self, cache: DenseKVCache, layer: int, update: bool, *, pin: bool = False, attend_pinned: bool = True) -> None:
        self.cache = cache
        self.layer = layer
        self.update = update
        self.pin = pin
        self.attend_pinned = attend_pinned

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        extra_key: torch.Tensor | None,
        extra_value: torch.Tensor | None,
        scale: float,
    ) -> torch.Tensor:
        """All tensors (1, L, heads, head_dim); ``query`` covers video then extra tokens."""
        cache, i = self.cache, self.layer
        pinned_k, pinned_v = cache.pinned_keys[i], cache.pinned_values[i]
        if self.pin:
            window_k = key if pinned_k is None else torch.cat([pinned_k, key], dim=1)
            window_v = value if pinned_v is None else torch.cat([pinned_v, value], dim=1)
            all_k, all_v = window_k, window_v
        else:
            cached_k, cached_v = cache.keys[i], cache.values[i]
            window_k = key if cached_k is None else torch.cat([cached_k, key], dim=1)
            window_v = value if cached_v is None else torch.cat([cached_v, value], dim=1)
            window_k = window_k[:, -cache.window_tokens :]
            window_v = window_v[:, -cache.window_tokens :]
            all_k, all_v = window_k, window_v
            if pinned_k is not None and self.attend_pinned:
                all_k, all_v = torch.cat([pinned_k, window_k], dim=1), torch.cat([pinned_v, window_v], dim=1)
        if extra_key is not None:
            all_k = torch.cat([all_k, extra_key], dim=1)
            all_v = torch.cat([all_v, extra_value], dim=1)
        out = F.scaled_dot_product_attention(query.transpose(1, 2), all_k.transpose(1, 2), all_v.transpose(1, 2), scale=scale).transpose(1, 2)
        if self.pin:
            cache.pinned_keys[i], cache.pinned_values[i] = window_k.clone(), window_v.clone()
        elif self.update:
            cache.keys[i] = window_k.clone()
            cache.values[i] = window_v.clone()
        return out
