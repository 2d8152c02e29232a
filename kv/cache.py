"""The engine-owned KV cache of one rank: storage, the page pool, and admission of sessions.

Admission: a session reserves its worst case (``KVSpec.reservation``: a full window per local branch and, where the
spec pins, a full in-context block in each branch that may pin) when it opens, so a forward never meets an exhausted pool half-way
through, and a demonstration pinned at a reset always finds its pages. When nothing more can
be reserved, :class:`ardiff_kv.pool.CapacityError` tells the engine to evict an idle session first.
Sessions are opened and ended here (:meth:`PagedKVCache.open_session` / :meth:`end_session`):
ending one returns every page and cross-attention slot it holds.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from ardiff_kv.pool import CapacityError, PagePool
from ardiff_kv.session import SessionKV
from ardiff_kv.spec import Branch, KVSpec
from ardiff_kv.storage import PagedStorage

logger = logging.getLogger(__name__)


def kv_budget_bytes(budget_gib: float | None, fraction: float, free_bytes: int, *, most: int | None = None) -> int:
    """Bytes for one rank's KV cache (``engine.kv_budget_gib`` / ``kv_memory_fraction``): the
    configured budget, else ``fraction`` of ``free_bytes``, the memory the device has free once the
    weights are loaded, but no more than ``most`` (what ``engine.max_sessions`` sessions can fill,
    :meth:`PagedKVCache.bytes_for_sessions`): a fraction of a big device never buys pages no session
    could use. The one rule for the engine (``engine/builder.py``, which measures it) and a
    policy's memory plan (which predicts it before loading anything)."""
    if budget_gib is not None:
        return int(budget_gib * 2**30)
    budget = int(max(0, free_bytes) * fraction)
    return budget if most is None else min(budget, most)


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
        max_batch: int = 1,
    ) -> None:
        if not branches or len(set(branches)) != len(branches):
            raise ValueError(f"branches must be a non-empty set of CFG branches, got {branches}")
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        self.spec = spec
        self.branches = tuple(Branch(b) for b in branches)
        self.max_sessions = max_sessions
        self.pool = PagePool(num_pages)
        self.reservation_per_session = spec.reservation_for(self.branches)
        if self.reservation_per_session > self.pool.capacity:
            raise ValueError(
                f"a pool of {self.pool.capacity} pages cannot hold one session "
                f"({self.reservation_per_session} pages for {len(self.branches)} branch(es){self._pinned_note()})"
            )
        # Cross-attention slots for the sessions the pool holds, not for max_sessions: a slot the
        # pages cannot back would never be used (the 14B's cost 0.6 GiB per session and branch).
        # (the undo headroom is no session's: batched calls that may be undone need it free)
        headroom = self.undo_headroom(spec, len(self.branches), max_batch)
        self.session_capacity = max(1, min(max_sessions, (self.pool.capacity - headroom) // self.reservation_per_session))
        self.storage = PagedStorage(
            spec,
            pool_pages=num_pages,
            max_sessions=self.session_capacity,
            branches=self.branches,
            device=torch.device(device),
            attention_backend=attention_backend,
            max_batch=max_batch,
        )
        self._sessions: dict[str, SessionKV] = {}

    @staticmethod
    def pages_for_budget(spec: KVSpec, budget_bytes: int, *, max_sessions: int, num_branches: int, max_batch: int = 1) -> int:
        """Pool pages (null page excluded) a byte budget buys.

        Scratch pages (one region per branch and batch slot) are deducted first; then each session
        the rest holds (at most ``max_sessions``) costs its pages and its cross-attention slots
        (:meth:`sessions_for_budget`). Pages that could not back one more session are not bought:
        without cross slots for it, no session could use them. The pool never drops below what one
        session needs for the branches this rank runs (1 under CFG-parallel, else 2).
        """
        pages = PagedKVCache._pages(spec, budget_bytes, max_sessions=max_sessions, num_branches=num_branches, max_batch=max_batch)
        floor = spec.reservation(num_branches)
        if pages < floor:
            logger.warning(
                "KV budget %.1f MiB gives %d pages; raising to the %d-page floor one session needs",
                budget_bytes / 2**20,
                pages,
                floor,
            )
        return max(pages, floor)

    @staticmethod
    def bytes_for_sessions(spec: KVSpec, *, max_sessions: int, num_branches: int, max_batch: int = 1) -> int:
        """What ``max_sessions`` sessions at their worst case and ``max_batch`` slots of scratch take:
        the most a budget can usefully be."""
        per_session = spec.reservation(num_branches) * spec.page_bytes + num_branches * spec.cross_slot_bytes
        return max_sessions * per_session + PagedKVCache.reserved_pages(spec, num_branches, max_batch) * spec.page_bytes

    @staticmethod
    def undo_headroom(spec: KVSpec, num_branches: int, max_batch: int) -> int:
        """Pool pages kept free beyond the sessions' own so a batched call can be undone member by member
        (``KVSpec.undo_pages`` per batch slot and branch; 0 for DreamZero, whose calls commit only on success,
        and for batches of one: a lone call that fails is not retried)."""
        return max_batch * num_branches * spec.undo_pages if max_batch > 1 else 0

    @staticmethod
    def reserved_pages(spec: KVSpec, num_branches: int, max_batch: int) -> int:
        """Pages of a budget no session holds: the forward's scratch per batch slot and branch, and the undo headroom."""
        return max_batch * num_branches * spec.scratch_pages_per_branch + PagedKVCache.undo_headroom(spec, num_branches, max_batch)

    @staticmethod
    def sessions_for_budget(spec: KVSpec, budget_bytes: int, *, max_sessions: int, num_branches: int, max_batch: int = 1) -> int:
        """Sessions whose worst case (pages and cross-attention slots in every local branch) a
        budget holds after the scratch region, at most ``max_sessions`` (0: not even one)."""
        left = budget_bytes - PagedKVCache.reserved_pages(spec, num_branches, max_batch) * spec.page_bytes
        per_session = spec.reservation(num_branches) * spec.page_bytes + num_branches * spec.cross_slot_bytes
        return max(0, min(max_sessions, left // per_session))

    @staticmethod
    def _pages(spec: KVSpec, budget_bytes: int, *, max_sessions: int, num_branches: int, max_batch: int) -> int:
        sessions = PagedKVCache.sessions_for_budget(spec, budget_bytes, max_sessions=max_sessions, num_branches=num_branches, max_batch=max_batch)
        scratch = max_batch * num_branches * spec.scratch_pages_per_branch
        fixed = sessions * num_branches * spec.cross_slot_bytes + scratch * spec.page_bytes
        pages = max(0, budget_bytes - fixed) // spec.page_bytes
        if sessions < max_sessions:  # the rest cannot back one more session (its cross slots are not paid for)
            pages = min(pages, sessions * spec.reservation(num_branches) + PagedKVCache.undo_headroom(spec, num_branches, max_batch))
        return pages

    @classmethod
    def batch_for_budget(cls, spec: KVSpec, budget_bytes: int, *, max_sessions: int, num_branches: int, max_batch: int) -> int:
        """The most sessions per forward (<= ``max_batch``) whose scratch still leaves a pool that
        holds that many sessions at once: a batch is admitted only if all its members fit, so
        scratch for more would never be used (and each slot costs a forward's worth of pages)."""
        per_session = spec.reservation(num_branches)
        for batch in range(max_batch, 1, -1):
            pages = cls._pages(spec, budget_bytes, max_sessions=max_sessions, num_branches=num_branches, max_batch=batch)
            pages -= cls.undo_headroom(spec, num_branches, batch)
            if min(max_sessions, pages // per_session) >= batch:
                return batch
        return 1

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
        max_batch: int = 1,
    ) -> PagedKVCache:
        max_batch = cls.batch_for_budget(spec, budget_bytes, max_sessions=max_sessions, num_branches=len(branches), max_batch=max_batch)
        pages = cls.pages_for_budget(spec, budget_bytes, max_sessions=max_sessions, num_branches=len(branches), max_batch=max_batch)
        return cls(
            spec,
            num_pages=pages + 1,  # + the null page
            max_sessions=max_sessions,
            branches=branches,
            device=device,
            attention_backend=attention_backend,
            max_batch=max_batch,
        )

    # -- sessions --------------------------------------------------------------------

    @property
    def num_sessions(self) -> int:
        return len(self._sessions)

    def can_open_session(self) -> bool:
        return len(self._sessions) < self.session_capacity

    def open_session(self, session_id: str) -> SessionKV:
        if session_id in self._sessions:
            raise RuntimeError(f"session {session_id!r} already has KV state")
        if not self.can_open_session():
            raise CapacityError(
                f"KV cache at capacity: {len(self._sessions)} sessions open, room for {self.session_capacity} "
                f"({self.pool.capacity} pages, {self.reservation_per_session} reserved per session{self._pinned_note()})"
            )
        session = SessionKV(self.storage, self.pool, session_id)
        self._sessions[session_id] = session
        return session

    def _pinned_note(self) -> str:
        """What of a session's reservation is its pinned block, for the capacity messages."""
        pinned = self.spec.max_pinned_pages
        if not pinned:
            return ""
        pinning = [b for b in self.branches if b in self.spec.pinned_branches]
        if len(pinning) == len(self.branches):
            return f", of which {pinned} per branch for its pinned in-context block"
        return f", of which {pinned} in the {'/'.join(b.name for b in pinning)} branch for its pinned in-context block"

    def end_session(self, session: SessionKV) -> None:
        """The session ended: every page and cross-attention slot it holds goes back. Idempotent."""
        session.free_all()
        if self._sessions.get(session.session_id) is session:
            del self._sessions[session.session_id]

    def stats(self) -> dict[str, int]:
        return {
            "pages_total": self.pool.capacity,
            "pages_free": self.pool.num_free,
            "sessions": len(self._sessions),
            "session_capacity": self.session_capacity,
            "cross_slots_free": self.storage.cross.num_free if self.storage.cross else 0,
        }
