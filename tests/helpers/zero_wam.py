"""The Zero-WAM parity tests' shared parts: the upstream references (scripts/record_upstream_zero_wam.py) and upstream's
cache for this server's transformer.

:class:`UpstreamCache` holds the K/V of every token a forward keeps, with upstream's metadata (cache type, CFG half,
frame id, modality: ``tests/helpers/zero_wam_cache.py``), and gives each forward, as the paged attention's per-layer
inputs (pages of one token), exactly the tokens upstream's predicate (``sees``) lets its queries see, plus its own.
Independent of the paged cache's window and eviction (``kv/``, checked against the same predicate by its own tests):
what it checks is the transformer over upstream's cache.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ardiff_kv import PagedLayerInputs
from tests.helpers.zero_wam_cache import Entry, clear_prediction_cache, sees

REFERENCE = Path(__file__).parents[1] / "reference_data" / "upstream_zero_wam_tiny"
ATOL = 1e-5  # float32, max abs error against upstream (its bf16 attention cast neutralised: the recorder's docstring)


def reference_or_skip() -> tuple[dict, dict[str, torch.Tensor]]:
    absent = [REFERENCE.with_suffix(s).name for s in (".json", ".safetensors") if not REFERENCE.with_suffix(s).is_file()]
    if absent:
        pytest.skip(f"no {' / '.join(absent)}: record it with scripts/record_upstream_zero_wam.py (its docstring says how)")
    return json.loads(REFERENCE.with_suffix(".json").read_text()), load_file(REFERENCE.with_suffix(".safetensors"))


class UpstreamCache:
    """Upstream Zero-WAM's attention cache (``icl_model.py``) for :class:`ZeroWAMTransformer`'s ``self_kv``."""

    def __init__(self, num_layers: int, heads: int, head_dim: int, window: int, dtype: torch.dtype = torch.float32, pages: int = 4096, rule=sees):
        self.keys = [torch.zeros(pages, 1, heads, head_dim, dtype=dtype) for _ in range(num_layers)]
        self.values = [torch.zeros(pages, 1, heads, head_dim, dtype=dtype) for _ in range(num_layers)]
        self.window, self.rule = window, rule
        self.free = 1  # page 0: the null page the block tables are padded with
        self.entries: list[tuple[int, Entry]] = []  # (page, what it holds): every cached token

    def inputs(self, rows: list[tuple[str, int, int]], tokens: int) -> tuple[list[PagedLayerInputs], list[list[int]]]:
        """Per-layer inputs of one forward whose rows are (query kind, CFG half, frame id) of ``tokens`` queries each:
        each row reads what upstream lets it see, then its own tokens (written by the forward)."""
        tables, own = [], []
        for kind, seq, frame in rows:
            seen = [page for page, entry in self.entries if self.rule(kind, seq, frame, entry, self.window)]
            mine = list(range(self.free, self.free + tokens))
            self.free += tokens
            tables.append(seen + mine)
            own.append(mine)
        width = max(len(t) for t in tables)
        block_table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        common = {
            "video_slots": torch.tensor([p for pages in own for p in pages], dtype=torch.int64),
            "extra_slots": torch.zeros(0, dtype=torch.int64),
            "block_table": block_table,
            "cu_seqlens_q": torch.arange(len(rows) + 1, dtype=torch.int32) * tokens,
            "seq_lens": torch.tensor([len(t) for t in tables], dtype=torch.int32),
            "max_seqlen_q": tokens,
            "max_seqlen_k": width,
            "backend": "sdpa",
        }
        layers = [PagedLayerInputs(key_cache=k, value_cache=v, **common) for k, v in zip(self.keys, self.values)]
        return layers, own

    def keep(self, own: list[list[int]], entries: list[Entry]) -> None:
        """A forward with ``update_cache``: each row's tokens become cached entries."""
        for pages, entry in zip(own, entries):
            self.entries += [(page, entry) for page in pages]

    def clear_prediction_cache(self, window: int) -> None:
        kept = set(clear_prediction_cache([e for _, e in self.entries], window))
        self.entries = [(page, e) for page, e in self.entries if e in kept]
