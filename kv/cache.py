"""The engine-owned KV cache: paged self-attention storage, scratch pages, cross-attention slots.

Layout per layer: a K tensor and a V tensor, each ``(num_pages_total, page_size, heads, head_dim)``,
which a block-table kernel reads in place and the sdpa path gathers from.

Page ids ``1 .. num_pages - 1`` belong to the :class:`PagePool` (0 is the null page); the pages
after them are scratch, a fixed region per local CFG branch for K/V that is never committed.

Admission: a session reserves its worst case (``local branches x pages_per_branch``) when it
opens, so a forward never meets an exhausted pool half-way through. When nothing more can
be reserved, :class:`kv.pool.CapacityError` tells the engine to evict an idle session first.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from kv.pool import CapacityError, PagePool
from kv.session import CrossKV, SessionKV
from kv.spec import Branch, KVSpec

logger = logging.getLogger(__name__)


class CrossAttentionSlots:
    """Static per-layer cross-attention K/V, one slot per session branch.

    Written once per session (text) or window (image tokens) and read every denoise step.
    """

    def __init__(self, spec: KVSpec, num_slots: int, device: torch.device) -> None:
        self.spec = spec
        self.num_slots = num_slots
        shape = (num_slots, spec.cross_tokens, spec.num_heads, spec.head_dim)
        self._keys = [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]
        self._values = [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def acquire(self) -> int:
        if not self._free:
            raise CapacityError(f"all {self.num_slots} cross-attention slots are in use")
        return self._free.pop()

    def release(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.num_slots:
            raise RuntimeError(f"cross-attention slot {slot} released twice or never acquired")
        self._free.append(slot)

    def write(
        self,
        slot: int,
        layer: int,
        *,
        text: tuple[torch.Tensor, torch.Tensor] | None,
        image: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> None:
        n_text = self.spec.cross_text_tokens
        for part, span in ((text, slice(0, n_text)), (image, slice(n_text, self.spec.cross_tokens))):
            if part is None:
                continue
            key, value = part
            expected = (span.stop - span.start, self.spec.num_heads, self.spec.head_dim)
            if tuple(key.shape[-3:]) != expected or tuple(value.shape[-3:]) != expected:
                raise ValueError(f"cross K/V of shape {tuple(key.shape)} does not fit the slot {expected}")
            self._keys[layer][slot, span].copy_(key.reshape(expected))
            self._values[layer][slot, span].copy_(value.reshape(expected))

    def read(self, slot: int, layer: int) -> CrossKV:
        n_text = self.spec.cross_text_tokens
        keys, values = self._keys[layer][slot : slot + 1], self._values[layer][slot : slot + 1]
        has_image = self.spec.cross_image_tokens > 0
        return CrossKV(
            text_key=keys[:, :n_text],
            text_value=values[:, :n_text],
            image_key=keys[:, n_text:] if has_image else None,
            image_value=values[:, n_text:] if has_image else None,
        )


class PagedKVCache:
    def __init__(
        self,
        spec: KVSpec,
        *,
        num_pages: int,
        max_sessions: int,
        branches: Sequence[Branch] = (Branch.COND, Branch.UNCOND),
        device: torch.device | str = "cpu",
        attention_backend: str = "auto",
    ) -> None:
        if not branches or len(set(branches)) != len(branches):
            raise ValueError(f"branches must be a non-empty set of CFG branches, got {branches}")
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        self.spec = spec
        self.device = torch.device(device)
        self.branches = tuple(Branch(b) for b in branches)
        self.attention_backend = attention_backend
        self.max_sessions = max_sessions
        self.pool = PagePool(num_pages)
        self._scratch_base = num_pages
        total = num_pages + len(self.branches) * spec.scratch_pages_per_branch
        # Zeros, not empty: padded table entries may be read by a kernel; keep them finite.
        # K and V are separate base tensors per layer (not views of one): the paged op mutates them
        # in place, and torch.compile can only re-inplace a mutation of a whole graph input; a
        # view into a shared base makes inductor copy the whole layer pool around every call.
        # Zeros, not empty: padded table entries may be read by a kernel; keep them finite.
        shape = (total, spec.page_size, spec.num_heads, spec.head_dim)
        self._keys = [torch.zeros(shape, dtype=spec.dtype, device=self.device) for _ in range(spec.num_layers)]
        self._values = [torch.zeros(shape, dtype=spec.dtype, device=self.device) for _ in range(spec.num_layers)]
        self.cross = (
            CrossAttentionSlots(spec, max_sessions * len(self.branches), self.device) if spec.cross_tokens else None
        )
        self._sessions: dict[str, SessionKV] = {}
        self.reservation_per_session = len(self.branches) * spec.pages_per_branch
        if self.reservation_per_session > self.pool.capacity:
            raise ValueError(
                f"a pool of {self.pool.capacity} pages cannot hold one session "
                f"({self.reservation_per_session} pages for {len(self.branches)} branch(es))"
            )

    @staticmethod
    def pages_for_budget(spec: KVSpec, budget_bytes: int, *, max_sessions: int, num_branches: int) -> int:
        """Pool pages (null page excluded) a byte budget buys.

        Cross-attention slots and scratch pages are deducted first; the pool never drops below
        what one session needs for the branches this rank runs (1 under CFG-parallel, else 2).
        """
        fixed = max_sessions * num_branches * spec.cross_slot_bytes + num_branches * spec.scratch_pages_per_branch * spec.page_bytes
        pages = max(0, budget_bytes - fixed) // spec.page_bytes
        floor = num_branches * spec.pages_per_branch
        if pages < floor:
            logger.warning(
                "KV budget %.1f MiB gives %d pages; raising to the %d-page floor one session needs",
                budget_bytes / 2**20, pages, floor,
            )  # fmt: skip
        return max(pages, floor)

    @classmethod
    def from_budget(
        cls,
        spec: KVSpec,
        budget_bytes: int,
        *,
        max_sessions: int,
        branches: Sequence[Branch] = (Branch.COND, Branch.UNCOND),
        device: torch.device | str = "cpu",
        attention_backend: str = "auto",
    ) -> PagedKVCache:
        pages = cls.pages_for_budget(spec, budget_bytes, max_sessions=max_sessions, num_branches=len(branches))
        return cls(
            spec,
            num_pages=pages + 1,  # + the null page
            max_sessions=max_sessions,
            branches=branches,
            device=device,
            attention_backend=attention_backend,
        )

    # -- storage ---------------------------------------------------------------------

    def key_cache(self, layer: int) -> torch.Tensor:
        return self._keys[layer]

    def value_cache(self, layer: int) -> torch.Tensor:
        return self._values[layer]

    def check_local(self, branch: Branch) -> None:
        if branch not in self.branches:
            raise RuntimeError(f"branch {Branch(branch).name} does not run on this rank (local: {self.branches})")

    def scratch_pages(self, branch: Branch) -> list[int]:
        """This branch's scratch region: ``max_new_pages`` video pages, then the extra pages."""
        self.check_local(branch)
        per_branch = self.spec.scratch_pages_per_branch
        start = self._scratch_base + self.branches.index(branch) * per_branch
        return list(range(start, start + per_branch))

    @property
    def storage_bytes(self) -> int:
        cross = 2 * sum(t.numel() * t.element_size() for t in self.cross._keys) if self.cross else 0
        return sum(t.numel() * t.element_size() for t in self._keys + self._values) + cross

    # -- sessions --------------------------------------------------------------------

    @property
    def num_sessions(self) -> int:
        return len(self._sessions)

    @property
    def session_capacity(self) -> int:
        by_pages = self.pool.capacity // self.reservation_per_session
        return min(by_pages, self.max_sessions)

    def can_open_session(self) -> bool:
        return len(self._sessions) < self.session_capacity

    def open_session(self, session_id: str) -> SessionKV:
        if session_id in self._sessions:
            raise RuntimeError(f"session {session_id!r} already has KV state")
        if not self.can_open_session():
            raise CapacityError(
                f"KV cache at capacity: {len(self._sessions)} sessions open, room for {self.session_capacity} "
                f"({self.pool.capacity} pages, {self.reservation_per_session} reserved per session)"
            )
        session = SessionKV(self, session_id)
        self._sessions[session_id] = session
        return session

    def forget_session(self, session: SessionKV) -> None:
        """Called by :meth:`SessionKV.close` once its pages are back in the pool."""
        self._sessions.pop(session.session_id, None)

    def stats(self) -> dict[str, int]:
        return {
            "pages_total": self.pool.capacity,
            "pages_free": self.pool.num_free,
            "sessions": len(self._sessions),
            "session_capacity": self.session_capacity,
            "cross_slots_free": self.cross.num_free if self.cross else 0,
        }
