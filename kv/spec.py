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
    # Zero-WAM's window, in frame ids (upstream's ``attn_window``): every forward outside the pinned block names its
    # frame id (``begin_forward(..., frame=)``: a chunk's video 2c, its actions 2c + 1) and sees the held entries
    # whose frame is within ``frame_window`` of its own, and its own tokens (upstream's |query - key frame| <= W: an
    # action query misses the oldest chunk's video, not its actions). Nothing is evicted after a commit: the episode
    # trims (:meth:`SessionKV.trim_window`, upstream's ``clean_window_cache``), by frame ids too, so a branch holding
    # video only (the unconditional half) keeps as many chunks as one holding video and actions. 0: not used.
    # ``window_pages`` is then the most observation pages a branch holds after a trim (its reservation's base).
    frame_window: int = 0
    # Pages a call may write beyond the window while it can still be undone (LingBot-VA's member-by-member retry
    # keeps what it evicts until the batch succeeded): the pool keeps them free per batch slot and branch.
    undo_pages: int = 0
    # Most in-context pages one branch of a session may pin (Zero-WAM: the longest demonstration's latent frames).
    # They sit before the window and outside it: the block table is wider by this much, and every session's
    # reservation counts a full pinned block per branch (admission, the memory plan), as it counts a full window.
    max_pinned_pages: int = 0
    # The branches that may pin (Zero-WAM's demonstration is the conditional half's only): the others reserve no
    # pinned pages and refuse a pin by name.
    pinned_branches: tuple[Branch, ...] = (Branch.COND, Branch.UNCOND)
    # The unconditional branch's ``window_pages`` when it holds less (Zero-WAM: video only, no action history); 0: the
    # same as the conditional one's. Its reservation is counted from it (admission, the memory plans).
    uncond_window_pages: int = 0
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
        if self.window_pages % self.chunk_pages and not self.frame_window:  # a frame window trims by frame ids
            raise ValueError(f"KVSpec: window_pages ({self.window_pages}) must be a whole number of chunks ({self.chunk_pages} pages)")
        if self.evict_to_fit and (self.sink_chunks or self.reset_at_boundary):
            raise ValueError("KVSpec: evict_to_fit frees the oldest pages one forward at a time; it has no sink and no window reset")
        if self.frame_window < 0:
            raise ValueError(f"KVSpec.frame_window must be >= 0 (0: no frame-id window), got {self.frame_window}")
        if self.frame_window and (self.evict_to_fit or self.reset_at_boundary or self.sink_chunks):
            raise ValueError("KVSpec: frame_window slides by frame ids (no evict_to_fit, sink or window reset)")
        if not 0 <= self.uncond_window_pages <= self.window_pages:
            raise ValueError(f"KVSpec.uncond_window_pages must be in [0, window_pages={self.window_pages}], got {self.uncond_window_pages}")
        if any(not isinstance(b, Branch) for b in self.pinned_branches) or len(set(self.pinned_branches)) != len(self.pinned_branches):
            raise ValueError(f"KVSpec.pinned_branches must be distinct Branch values, got {self.pinned_branches}")
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

    def window_pages_of(self, branch: Branch) -> int:
        """``window_pages`` of one branch (the unconditional one's may be smaller: ``uncond_window_pages``)."""
        return self.uncond_window_pages if branch == Branch.UNCOND and self.uncond_window_pages else self.window_pages

    def window_pages_for(self, branch: Branch) -> int:
        """Worst case a branch's window holds during a forward.

        A full window, plus the part of a chunk that is still partly visible (chunks are never
        half-evicted), plus the in-flight chunk. With ``evict_to_fit`` the in-flight pages are
        inside the window: the window itself. With ``frame_window`` the same bound: a full window, then a chunk's
        observation (``chunk_pages``) written before the trim, or predictions of up to ``max_new_pages``
        stacked on the chunk's first (a repeated infer before the commit, as upstream keeps them).
        """
        window = self.window_pages_of(branch)
        if self.evict_to_fit:
            return window
        return window + self.chunk_pages - 1 + self.max_new_pages

    @property
    def window_pages_per_branch(self) -> int:
        """:meth:`window_pages_for` the larger branch (the conditional one)."""
        return self.window_pages_for(Branch.COND)

    def pages_for(self, branch: Branch) -> int:
        """Worst case one branch holds: a full pinned block where it may pin and a full window. What a session
        reserves for the branch at admission and what the memory plans count."""
        pinned = self.max_pinned_pages if branch in self.pinned_branches else 0
        return pinned + self.window_pages_for(branch)

    @property
    def pages_per_branch(self) -> int:
        """The larger branch's :meth:`pages_for` (the conditional one: a full pinned block and a full window)."""
        return max(self.pages_for(b) for b in Branch)

    def reservation(self, num_branches: int) -> int:
        """Pages a session reserves on a rank running ``num_branches`` branches: both branches' own worst cases,
        or for one branch the larger (a CFG-parallel rank runs either)."""
        if num_branches == len(Branch):
            return sum(self.pages_for(b) for b in Branch)
        if num_branches == 1:
            return self.pages_per_branch
        raise ValueError(f"a rank runs 1 or {len(Branch)} branches, not {num_branches}")

    def reservation_for(self, branches) -> int:
        """Pages a session reserves for exactly these branches."""
        return sum(self.pages_for(Branch(b)) for b in branches)

    @property
    def block_table_width(self) -> int:
        """Fixed width so that shapes never change as the window fills (compile / CUDA graphs): the pinned
        block, the window (with ``frame_window``: its worst case, the forward's own pages included), the extra tokens."""
        window = self.window_pages_per_branch if self.frame_window else self.window_pages
        return self.max_pinned_pages + window + max(1, self.extra_pages)

    @property
    def cross_tokens(self) -> int:
        return self.cross_text_tokens + self.cross_image_tokens

    @property
    def cross_slot_bytes(self) -> int:
        """Cross-attention K/V of one session branch, all layers."""
        return self.cross_tokens * self.token_bytes
