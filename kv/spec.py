"""What a model needs from the paged KV cache, in pages.

A page holds the K/V of one latent frame (``page_size`` tokens) for every layer. All sizes
the cache derives (pool floor, scratch, block-table width, cross-attention slots) come from
this one description, so a model states its geometry once.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch


class Branch(enum.IntEnum):
    """Classifier-free-guidance branch: each has its own K/V for the same frames."""

    COND = 0  # the real prompt (positive)
    UNCOND = 1  # the negative prompt


class EntryKind(enum.Enum):
    """What a cached page holds; a session's pages of one branch are, in position order, its in-context block,
    then its observations, then its predictions (``SessionKV``, ``BranchKV.entries``).

    Upstream Zero-WAM's cache types (``ICL_CACHE_TYPE`` 2 / ``OBSERVATION_CACHE_TYPE`` 0 / ``PREDICTION_CACHE_TYPE``
    1); LingBot-VA's ``update_cache`` 2 / 1 are observation / prediction."""

    # Pinned: a per-episode block (Zero-WAM's demonstration) the window never evicts. Written before any other entry,
    # freed when the window restarts without ``keep_pinned`` or the session ends.
    IN_CONTEXT = "in-context"
    # What the robot saw and did (committed): the window evicts the oldest first.
    OBSERVATION = "observation"
    # The model's own predicted chunk (provisional): later forwards see it until the observation replaces it.
    PREDICTION = "prediction"


class CrossKV(NamedTuple):
    """One layer's cached cross-attention K/V, each (1, tokens, heads, head_dim) views."""

    text_key: torch.Tensor
    text_value: torch.Tensor
    image_key: torch.Tensor | None
    image_value: torch.Tensor | None


@dataclass(frozen=True)
class KVSpec:
    num_layers: int
    num_heads: int
    head_dim: int
    page_size: int  # tokens per page: one latent frame (DreamZero-DROID: 880)
    window_pages: int  # pages attention may see, sink included (DreamZero: local_attn_size = 9)
    max_new_pages: int  # most video pages one forward adds (the in-flight chunk; DreamZero: 2)
    max_extra_tokens: int = 0  # uncached tokens attended after the video (action/state register)
    chunk_pages: int = 1  # eviction unit: a chunk is never half-evicted
    sink_chunks: int = 0  # leading chunks that are never evicted
    reset_at_boundary: bool = False  # window full -> drop everything past the sink
    # LingBot-VA's window: before every forward (a denoising step's too), the oldest pages are freed until the
    # held pages plus the forward's new ones fit in ``window_pages``; attention sees every page held (window.pages_to_fit)
    evict_to_fit: bool = False
    # Zero-WAM's frame-id window: the window counts the pages the branch holds, not the forward's own, so every
    # forward sees the newest ``window_pages`` held pages and its own (upstream's |query frame - key frame| <= W,
    # which leaves an action query the oldest chunk's actions but not its video: docs/zero-wam.md).
    window_of_history: bool = False
    # Pages a call may write beyond the window while it can still be undone (LingBot-VA's member-by-member retry
    # keeps what it evicts until the batch succeeded): the pool keeps them free per batch slot and branch.
    undo_pages: int = 0
    # Most in-context pages one branch of a session may pin (Zero-WAM: the longest demonstration's latent frames).
    # They sit before the window and outside it: the block table is wider by this much, and every session's
    # reservation counts a full pinned block per branch (admission, the memory plan), as it counts a full window.
    max_pinned_pages: int = 0
    cross_text_tokens: int = 0  # text tokens cached once per session for cross-attention
    cross_image_tokens: int = 0  # image tokens (I2V) cached once per window
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_heads", "head_dim", "page_size", "window_pages", "max_new_pages", "chunk_pages"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVSpec.{name} must be positive, got {getattr(self, name)}")
        for name in ("max_extra_tokens", "sink_chunks", "undo_pages", "max_pinned_pages", "cross_text_tokens", "cross_image_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"KVSpec.{name} must be >= 0, got {getattr(self, name)}")
        if self.max_new_pages > self.window_pages:
            raise ValueError(f"KVSpec: a forward's new pages ({self.max_new_pages}) must fit in the window ({self.window_pages})")
        if self.window_pages % self.chunk_pages:
            raise ValueError(f"KVSpec: window_pages ({self.window_pages}) must be a whole number of chunks ({self.chunk_pages} pages)")
        if self.evict_to_fit and (self.sink_chunks or self.reset_at_boundary):
            raise ValueError("KVSpec: evict_to_fit frees the oldest pages one forward at a time; it has no sink and no window reset")
        if self.window_of_history and (self.evict_to_fit or self.reset_at_boundary or self.sink_chunks):
            raise ValueError("KVSpec: window_of_history is a sliding chunk window (no evict_to_fit, sink or window reset)")
        if self.sink_pages >= self.window_pages:
            raise ValueError(f"KVSpec: sink ({self.sink_pages} pages) must be smaller than the window ({self.window_pages})")

    @property
    def sink_pages(self) -> int:
        return self.sink_chunks * self.chunk_pages

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def token_bytes(self) -> int:
        """K and V of one token, all layers."""
        return 2 * self.num_layers * self.num_heads * self.head_dim * self.itemsize

    @property
    def page_bytes(self) -> int:
        return self.page_size * self.token_bytes

    @property
    def extra_pages(self) -> int:
        return math.ceil(self.max_extra_tokens / self.page_size)

    @property
    def scratch_pages_per_branch(self) -> int:
        """Pages for uncommitted denoise-step video K/V plus the action/state register."""
        return self.max_new_pages + self.extra_pages

    @property
    def window_pages_per_branch(self) -> int:
        """Worst case a branch's window holds during a forward.

        A full window, plus the part of a chunk that is still partly visible (chunks are never
        half-evicted), plus the in-flight chunk. With ``evict_to_fit`` the in-flight pages are
        inside the window: the window itself.
        """
        if self.evict_to_fit:
            return self.window_pages
        return self.window_pages + self.chunk_pages - 1 + self.max_new_pages

    @property
    def pages_per_branch(self) -> int:
        """Worst case a branch holds: a full pinned block (``max_pinned_pages``) and a full window. What a session
        reserves per branch at admission and what the memory plans count."""
        return self.max_pinned_pages + self.window_pages_per_branch

    @property
    def block_table_width(self) -> int:
        """Fixed width so that shapes never change as the window fills (compile / CUDA graphs): the pinned
        block, the window (and the forward's own pages when the window counts history only), the extra tokens."""
        own = self.max_new_pages if self.window_of_history else 0
        return self.max_pinned_pages + self.window_pages + own + max(1, self.extra_pages)

    @property
    def cross_tokens(self) -> int:
        return self.cross_text_tokens + self.cross_image_tokens

    @property
    def cross_slot_bytes(self) -> int:
        """Cross-attention K/V of one session branch, all layers."""
        return self.cross_tokens * self.token_bytes
