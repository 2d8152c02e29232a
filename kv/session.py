"""Per-session KV state: both CFG branches' page rings, forward contexts, cross-attention K/V.

Life of a branch forward::

    ctx = session.begin_forward(Branch.COND, num_video_tokens=2 * page, commit=True, extra_tokens=25)
    layer_inputs = ctx.prepare(device)        # allocates pages now (lazily), builds the block table
    model(..., self_kv=layer_inputs)          # each layer writes its K/V into the pages and attends
    session.complete(Branch.COND)             # on success: commit the chunk (and evict old chunks)
    session.abort(Branch.COND)                # on failure: free the chunk's pages
    session.restart_window()                  # a fresh window (prompt change, window full)
    cache.end_session(session)                # the session ended: every page back to the pool

Prefill forwards (``commit=True``) write into pages the branch will own; denoise forwards
(``commit=False``) write into the rank's scratch pages, which are reused every forward and
never committed. Extra (action/state) tokens always go to scratch.

Typed entries (``begin_forward(..., commit=True, entry=EntryKind.X)``, :class:`~ardiff_kv.spec.EntryKind`). A branch's
pages are, in position order, three runs, never interleaved, each page's kind its run (``BranchKV.entries``):

* **in-context** (``IN_CONTEXT``, pinned): a per-episode prefix (Zero-WAM's demonstration) written before any other
  entry, in one or more forwards of up to ``KVSpec.max_pinned_pages``. The window never counts, evicts or drops it;
  a forward sees it unless it asks not to (``attend_pinned=False``: Zero-WAM's action queries). It goes back to the
  pool when the window restarts (unless ``keep_pinned``) and when the session ends.
* **observation** (``OBSERVATION``, the default: committed): what the robot saw and did; the window evicts it.
* **prediction** (``PREDICTION``, provisional): K/V written by a *prediction* (LingBot-VA and Zero-WAM keep their
  predicted chunk's K/V until the robot's real frames arrive). A tail after the observations: later forwards see
  it; :meth:`SessionKV.drop_predictions` discards it (the pages go back to the pool), and so does an observation
  forward before it writes (the observation replaces the prediction); the observations are never copied or moved.

Upstream Zero-WAM's window (``KVSpec.frame_window``): every forward names its frame id, sees the held pages written
within the window of it (``BranchKV.frames``), and the episode trims after each observation (:meth:`SessionKV.trim_window`):
both counted in frame ids, so a branch that holds video only keeps as many chunks as one that holds video and actions.

Upstream LingBot-VA's ``update_cache`` 0 / 1 / 2 are ``commit=False`` / prediction / observation (``provisional=True``
spells the prediction, ``drop_provisional`` the drop, in its words); upstream Zero-WAM's cache types 2 / 0 / 1 are
in-context / observation / prediction, its ``clear_prediction_cache`` is ``drop_predictions``.

A call that may have to be undone (a batched call retried member by member): ``snapshot()`` before it,
then ``rollback()`` (back to the snapshot's entries of every kind and lengths; pages allocated since, pinned ones
included, go back to the pool) or ``release()`` (keep what the call did). While a snapshot is held, a page it holds is never handed
back to the pool, only set aside (eviction, a dropped prediction, a restarted window), so a rollback finds its K/V intact; the call
can hold up to the pages it writes more than the window (:meth:`SessionKV.snapshot`).

Several sequences (sessions x branches) in one forward: :func:`prepare_batch` lays their block
table rows, slots and lengths side by side; each sequence attends only to its own pages and
its own new tokens. The ``slot``-th session of a batch writes into its own scratch region
(``begin_forward(..., scratch_slot=slot)``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ardiff_kv.attention import PagedLayerInputs
from ardiff_kv.pool import PagePool
from ardiff_kv.spec import Branch, CrossKV, EntryKind
from ardiff_kv.storage import PagedStorage
from ardiff_kv.window import pages_to_evict, pages_to_fit, visible_pages

logger = logging.getLogger(__name__)

_POSITION_ORDER = (EntryKind.IN_CONTEXT, EntryKind.OBSERVATION, EntryKind.PREDICTION)  # a branch's runs of pages


class ForwardContext:
    """One branch forward. Allocation is deferred to :meth:`prepare`, so building contexts for
    both branches costs nothing for a branch this rank never runs."""

    def __init__(
        self,
        session: SessionKV,
        branch: Branch,
        *,
        num_video_tokens: int,
        commit: bool,
        extra_tokens: int,
        scratch_slot: int = 0,
        entry: EntryKind = EntryKind.OBSERVATION,
        attend_pinned: bool = True,
        frame: int | None = None,
    ) -> None:
        spec = session.storage.spec
        entry = EntryKind(entry)
        if spec.frame_window and entry is not EntryKind.IN_CONTEXT and (isinstance(frame, bool) or not isinstance(frame, int)):
            raise ValueError(f"a forward under KVSpec.frame_window needs its frame id (frame=), got {frame!r}")
        if entry is not EntryKind.OBSERVATION and not commit:
            raise ValueError(f"a forward writing {entry.value} entries keeps its pages: it needs commit=True")
        if num_video_tokens <= 0 or num_video_tokens % spec.page_size:
            raise ValueError(
                f"a forward must bring whole frames: num_video_tokens={num_video_tokens} is not a positive multiple of the page size {spec.page_size}"
            )
        pages = num_video_tokens // spec.page_size
        if entry is EntryKind.IN_CONTEXT:
            session._check_pin(branch, pages)
        elif pages > spec.max_new_pages:
            raise ValueError(f"a forward of {pages} frames exceeds max_new_pages={spec.max_new_pages}")
        if entry is EntryKind.PREDICTION and commit:
            session._check_prediction(branch, pages)
        if entry is EntryKind.OBSERVATION and commit and spec.frame_window:
            session._check_observation(branch, pages)
        if not 0 <= extra_tokens <= spec.max_extra_tokens:
            raise ValueError(f"extra_tokens={extra_tokens} outside [0, {spec.max_extra_tokens}]")
        self.session = session
        self.branch = branch
        self.num_video_tokens = num_video_tokens
        self.commit = commit
        self.entry = entry
        self.attend_pinned = attend_pinned
        self.frame = frame
        self.extra_tokens = extra_tokens
        self.scratch_slot = scratch_slot
        self.new_pages: list[int] = []  # pages this forward allocated (commit forwards only)
        self.layer_inputs: list[PagedLayerInputs] | None = None
        self._sequence: _Sequence | None = None

    @property
    def provisional(self) -> bool:
        """It writes prediction entries (upstream LingBot-VA's word)."""
        return self.commit and self.entry is EntryKind.PREDICTION

    @property
    def prepared(self) -> bool:
        """Its pages are allocated and laid out (a forward may have written them)."""
        return self._sequence is not None

    @property
    def num_new_pages(self) -> int:
        return self.num_video_tokens // self.session.storage.spec.page_size

    @property
    def query_len(self) -> int:
        return self.num_video_tokens + self.extra_tokens

    def prepare(self, device: torch.device | str | None = None) -> list[PagedLayerInputs]:
        """Allocate the current chunk's pages and build the block-table metadata all layers share
        (a forward of this one sequence). Host-side work done once per forward, outside any
        compiled region. Idempotent."""
        if self.layer_inputs is None:
            self.layer_inputs = prepare_batch([self], device)
        return self.layer_inputs

    def _plan(self) -> _Sequence:
        """Allocate (once) and lay out this sequence: its block-table row, slots and key length."""
        if self._sequence is not None:
            return self._sequence
        storage = self.session.storage
        spec = storage.spec
        branch_kv = self.session.branch(self.branch)
        scratch = storage.scratch_pages(self.branch, self.scratch_slot)
        pinning = self.commit and self.entry is EntryKind.IN_CONTEXT
        # the branch may have changed since begin_forward
        if pinning:
            self.session._check_pin(self.branch, self.num_new_pages)
        elif self.provisional:
            self.session._check_prediction(self.branch, self.num_new_pages)
        if self.commit and self.entry is EntryKind.OBSERVATION:
            self.session.drop_predictions(self.branch)  # the observation replaces the prediction
            if spec.frame_window:
                self.session._check_observation(self.branch, self.num_new_pages)
        if spec.evict_to_fit and not pinning:  # pinned pages are outside the window
            self.session._evict_to_fit(self.branch, self.num_new_pages)
        if self.commit:
            self.new_pages = self.session.pool.allocate(self.num_new_pages)
            video_pages = self.new_pages
        else:
            video_pages = scratch[: self.num_new_pages]
        extra_pages = scratch[spec.max_new_pages : spec.max_new_pages + -(-self.extra_tokens // spec.page_size)]
        if pinning:  # the block so far and its new pages (no window entry exists yet: _check_pin)
            visible = branch_kv.pinned + video_pages
        else:
            held = branch_kv.resident + branch_kv.provisional
            if spec.frame_window:  # upstream Zero-WAM's predicate, by the frame id each held page was written at
                window = [p for p in held if abs(branch_kv.frames[p] - self.frame) <= spec.frame_window] + video_pages
            else:
                window = visible_pages(held, video_pages, window_pages=spec.window_pages, sink_pages=spec.sink_pages)
            visible = (branch_kv.pinned if self.attend_pinned else []) + window
        table = visible + extra_pages
        table += [0] * (spec.block_table_width - len(table))
        self._sequence = _Sequence(
            table=table,
            video_slots=_slots(video_pages, self.num_video_tokens, spec.page_size),
            extra_slots=_slots(extra_pages, self.extra_tokens, spec.page_size),
            seq_len=len(visible) * spec.page_size + self.extra_tokens,
        )
        return self._sequence


@dataclass(frozen=True)
class _Sequence:
    table: list[int]
    video_slots: torch.Tensor  # host int64
    extra_slots: torch.Tensor
    seq_len: int


def prepare_batch(contexts: list[ForwardContext], device: torch.device | str | None = None) -> list[PagedLayerInputs]:
    """Per-layer inputs of ONE forward over several sequences (each a session branch's forward
    context, in the order their tokens are stacked): the block table has a row per sequence, the
    slots of all sequences are concatenated, and ``cu_seqlens_q`` / ``seq_lens`` say where each
    sequence's queries and keys end. Every context must run against the same storage and have
    the same query length (one tensor batch). Allocates each context's pages now."""
    if not contexts:
        raise ValueError("a forward needs at least one sequence")
    storage = contexts[0].session.storage
    if any(ctx.session.storage is not storage for ctx in contexts):
        raise ValueError("a batched forward runs against one cache")
    query_len = contexts[0].query_len
    if any(ctx.query_len != query_len for ctx in contexts):
        raise ValueError(f"a batched forward needs equal query lengths, got {[ctx.query_len for ctx in contexts]}")
    spec = storage.spec
    device = torch.device(device) if device is not None else storage.device
    plans = [ctx._plan() for ctx in contexts]
    video_slots = torch.cat([p.video_slots for p in plans]).to(device)
    extra_slots = torch.cat([p.extra_slots for p in plans]).to(device)
    block_table = torch.tensor([p.table for p in plans], dtype=torch.int32, device=device)
    cu_seqlens_q = torch.arange(len(plans) + 1, dtype=torch.int32, device=device) * query_len
    seq_lens = torch.tensor([p.seq_len for p in plans], dtype=torch.int32, device=device)
    # max_seqlen_k is the padded capacity, not the real length, so it is the same for every
    # forward of this geometry (a constant for torch.compile / CUDA graphs).
    max_seqlen_k = spec.block_table_width * spec.page_size
    layer_inputs = [
        PagedLayerInputs(
            key_cache=storage.key_cache(i),
            value_cache=storage.value_cache(i),
            video_slots=video_slots,
            extra_slots=extra_slots,
            block_table=block_table,
            cu_seqlens_q=cu_seqlens_q,
            seq_lens=seq_lens,
            max_seqlen_q=query_len,
            max_seqlen_k=max_seqlen_k,
            backend=storage.attention_backend,
        )
        for i in range(spec.num_layers)
    ]
    for ctx in contexts:
        ctx.layer_inputs = layer_inputs
    return layer_inputs


def _slots(pages: list[int], num_tokens: int, page_size: int) -> torch.Tensor:
    """Flat pool slots (page * page_size + offset) of the first ``num_tokens`` tokens of ``pages`` (host)."""
    if num_tokens == 0:
        return torch.empty(0, dtype=torch.long)
    page_ids = torch.tensor(pages, dtype=torch.long)
    offsets = torch.arange(num_tokens, dtype=torch.long)
    return page_ids[offsets // page_size] * page_size + offsets % page_size


class Entry(NamedTuple):
    """One cached page and what it holds."""

    page: int
    kind: EntryKind


@dataclass
class BranchKV:
    """One CFG branch of one session: its entries are three runs of pages, in position order."""

    pinned: list[int] = field(default_factory=list)  # in-context pages, in write order: never evicted by the window
    resident: list[int] = field(default_factory=list)  # observation (committed) pages, oldest first (sink first)
    provisional: list[int] = field(default_factory=list)  # prediction pages after them, oldest first
    committed_tokens: int = 0  # advances once per committed chunk, never per denoise step
    evicted_pages: int = 0
    frames: dict[int, int] = field(default_factory=dict)  # page -> the frame id it was written at (KVSpec.frame_window)
    pending: ForwardContext | None = None
    cross_slot: int | None = None
    cross_text_ready: bool = False
    cross_image_ready: bool = False

    def pages(self, kind: EntryKind) -> list[int]:
        """The pages holding entries of ``kind``, in position order (the branch's own list: do not mutate)."""
        return {EntryKind.IN_CONTEXT: self.pinned, EntryKind.OBSERVATION: self.resident, EntryKind.PREDICTION: self.provisional}[kind]

    @property
    def entries(self) -> list[Entry]:
        """Every page the branch holds with its kind, in position order: in-context, observations, predictions."""
        return [Entry(page, kind) for kind in _POSITION_ORDER for page in self.pages(kind)]

    @property
    def held(self) -> list[int]:
        return self.pinned + self.resident + self.provisional


class BranchSnapshot(NamedTuple):
    pinned: tuple[int, ...]
    resident: tuple[int, ...]
    provisional: tuple[int, ...]
    committed_tokens: int
    evicted_pages: int
    frames: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class KVSnapshot:
    """A session's page bookkeeping at one moment (:meth:`SessionKV.snapshot`): per branch its pages of every entry
    kind, committed tokens and evicted-page count. Page ids only: no K/V is copied."""

    branches: dict[Branch, BranchSnapshot]

    @property
    def pages(self) -> set[int]:
        return {page for b in self.branches.values() for page in (*b.pinned, *b.resident, *b.provisional)}


class SessionKV:
    """Everything one robot session holds in the cache, for both CFG branches. Opened and ended
    by :class:`~ardiff_kv.cache.PagedKVCache` (``open_session`` / ``end_session``)."""

    def __init__(self, storage: PagedStorage, pool: PagePool, session_id: str) -> None:
        self.storage = storage
        self.pool = pool
        self.session_id = session_id
        self._branches = {branch: BranchKV() for branch in Branch}
        self.ended = False
        self._snapshot: KVSnapshot | None = None
        self._snapshot_pages: set[int] = set()
        self._set_aside: list[int] = []  # the snapshot's pages the call freed: back to the pool on release()

    def branch(self, branch: Branch) -> BranchKV:
        return self._branches[branch]

    @property
    def pages_held(self) -> int:
        """Managed pages this session owns right now (resident plus an in-flight chunk)."""
        total = len(self._set_aside)
        for state in self._branches.values():
            total += len(state.held)
            if state.pending is not None:
                total += len(state.pending.new_pages)
        return total

    # -- snapshot / rollback --------------------------------------------------------

    def snapshot(self) -> KVSnapshot:
        """Remember the page bookkeeping of every branch before a call that may be undone (no forward in
        flight). Until :meth:`rollback` or :meth:`release`, the snapshot's pages stay out of the pool even when the
        call evicts or drops them, so the session may hold up to the pages the call writes beyond its window: the
        caller makes sure the pool has them free."""
        self._check_open()
        if self._snapshot is not None:
            raise RuntimeError(f"session {self.session_id!r}: a snapshot is already held; rollback() or release() it first")
        if any(state.pending is not None and state.pending.prepared for state in self._branches.values()):
            raise RuntimeError(f"session {self.session_id!r}: snapshot() during a forward")
        self._snapshot = KVSnapshot(
            {
                branch: BranchSnapshot(
                    tuple(state.pinned),
                    tuple(state.resident),
                    tuple(state.provisional),
                    state.committed_tokens,
                    state.evicted_pages,
                    tuple(state.frames.items()),
                )
                for branch, state in self._branches.items()
            }
        )
        self._snapshot_pages = self._snapshot.pages
        self._set_aside = []
        return self._snapshot

    def rollback(self) -> None:
        """Undo everything since :meth:`snapshot`: an in-flight forward is aborted, pages allocated since go back
        to the pool, and every branch holds exactly the snapshot's pages again (their K/V untouched)."""
        snap = self._require_snapshot()
        for branch in self._branches:
            self.abort(branch)
        held = [page for state in self._branches.values() for page in state.held]
        newer = [page for page in held if page not in self._snapshot_pages]
        for branch, was in snap.branches.items():
            state = self._branches[branch]
            state.pinned, state.resident, state.provisional = list(was.pinned), list(was.resident), list(was.provisional)
            state.committed_tokens, state.evicted_pages = was.committed_tokens, was.evicted_pages
            state.frames = dict(was.frames)
        self._end_snapshot()
        self.pool.free(newer)

    def release(self) -> None:
        """Keep what the call did: the snapshot's pages it evicted or dropped go back to the pool now."""
        self._require_snapshot()
        set_aside = self._set_aside
        self._end_snapshot()
        self.pool.free(set_aside)

    @property
    def has_snapshot(self) -> bool:
        return self._snapshot is not None

    def _require_snapshot(self) -> KVSnapshot:
        if self._snapshot is None:
            raise RuntimeError(f"session {self.session_id!r}: no snapshot held")
        return self._snapshot

    def _end_snapshot(self) -> None:
        self._snapshot, self._snapshot_pages, self._set_aside = None, set(), []

    def _free(self, pages: list[int]) -> None:
        """Pages this session stops holding: to the pool, or set aside while a snapshot holds them."""
        for state in self._branches.values():
            for page in pages:
                state.frames.pop(page, None)
        if self._snapshot is None:
            self.pool.free(pages)
            return
        self._set_aside.extend(p for p in pages if p in self._snapshot_pages)
        self.pool.free([p for p in pages if p not in self._snapshot_pages])

    # -- self-attention ---------------------------------------------------------------

    def begin_forward(
        self,
        branch: Branch,
        *,
        num_video_tokens: int,
        commit: bool,
        extra_tokens: int = 0,
        scratch_slot: int = 0,
        entry: EntryKind = EntryKind.OBSERVATION,
        provisional: bool = False,
        attend_pinned: bool = True,
        frame: int | None = None,
    ) -> ForwardContext:
        """A forward of ``branch``: ``commit=False`` writes scratch (a denoise step), ``commit=True`` keeps its pages as
        ``entry`` entries (``provisional=True``: upstream LingBot-VA's spelling of ``entry=EntryKind.PREDICTION``).
        ``attend_pinned=False``: its queries do not see the in-context block. ``frame``: its frame id, which a
        ``KVSpec.frame_window`` needs for every forward but a pin."""
        self._check_open()
        if provisional:
            if entry not in (EntryKind.OBSERVATION, EntryKind.PREDICTION):
                raise ValueError(f"provisional=True writes prediction entries, not {EntryKind(entry).value} ones")
            entry = EntryKind.PREDICTION
        self.storage.check_local(branch)
        state = self._branches[branch]
        if state.pending is not None and state.pending.commit and state.pending.prepared:
            raise RuntimeError(
                f"session {self.session_id!r} {branch.name}: a new forward replaces one whose chunk was never "
                "committed; call complete() or abort() first"
            )
        state.pending = ForwardContext(
            self,
            branch,
            num_video_tokens=num_video_tokens,
            commit=commit,
            extra_tokens=extra_tokens,
            scratch_slot=scratch_slot,
            entry=entry,
            attend_pinned=attend_pinned,
            frame=frame,
        )
        return state.pending

    def complete(self, branch: Branch) -> None:
        """The forward succeeded: commit its chunk (if it was a prefill) and evict old chunks."""
        state = self._branches[branch]
        ctx = state.pending
        if ctx is None:
            return
        state.pending = None
        if not ctx.commit:
            return
        if not ctx.prepared:
            raise RuntimeError(f"session {self.session_id!r} {branch.name}: complete() of a forward that never ran")
        spec = self.storage.spec
        if spec.frame_window and ctx.entry is not EntryKind.IN_CONTEXT:
            state.frames.update(dict.fromkeys(ctx.new_pages, ctx.frame))
        if ctx.entry is not EntryKind.OBSERVATION:
            state.pages(ctx.entry).extend(ctx.new_pages)
            return
        state.resident.extend(ctx.new_pages)
        state.committed_tokens += ctx.num_video_tokens
        if spec.evict_to_fit or spec.frame_window:
            return  # the next forward frees what it needs (_evict_to_fit); the episode trims (trim_window)
        evict = pages_to_evict(
            len(state.resident),
            window_pages=spec.window_pages,
            chunk_pages=spec.chunk_pages,
            sink_chunks=spec.sink_chunks,
            reset_at_boundary=spec.reset_at_boundary,
        )
        if evict:
            sink = spec.sink_pages
            victims = state.resident[sink : sink + evict]
            del state.resident[sink : sink + evict]
            state.evicted_pages += evict
            self._free(victims)

    def drop_predictions(self, branch: Branch | None = None) -> int:
        """Discard the prediction entries (one branch, or both): their pages go back to the pool (set aside while a
        snapshot holds them); in-context and observation entries are untouched. Upstream Zero-WAM's
        ``clear_prediction_cache``, LingBot-VA's ``clear_pred_cache``. Returns the number of pages freed."""
        self._check_open()
        freed = 0
        for b in (branch,) if branch is not None else tuple(self._branches):
            state = self._branches[b]
            if state.provisional:
                pages, state.provisional = state.provisional, []
                self._free(pages)
                freed += len(pages)
        return freed

    drop_provisional = drop_predictions  # upstream LingBot-VA's word for predictions: provisional pages

    def trim_window(self, next_frame: int) -> int:
        """``KVSpec.frame_window``: every branch's observation pages written at a frame more than ``frame_window``
        from ``next_frame`` go back to the pool (set aside while a snapshot holds them), predictions too: upstream
        Zero-WAM's ``clean_window_cache`` after a chunk's observation (``clear_prediction_cache(attn_window)``, which
        keeps in-context entries and the observations within the window of the newest observed frame + 1).
        Returns the number of pages freed."""
        self._check_open()
        spec = self.storage.spec
        if not spec.frame_window:
            raise ValueError("trim_window() needs KVSpec.frame_window (other windows evict by themselves)")
        freed = self.drop_predictions()
        for branch, state in self._branches.items():
            old = [p for p in state.resident if abs(state.frames[p] - next_frame) > spec.frame_window]
            if old:
                state.resident = [p for p in state.resident if abs(state.frames[p] - next_frame) <= spec.frame_window]
                state.evicted_pages += len(old)
                self._free(old)
                freed += len(old)
            if len(state.resident) > spec.window_pages_of(branch):
                raise RuntimeError(
                    f"session {self.session_id!r} {branch.name}: {len(state.resident)} observation pages within "
                    f"{spec.frame_window} frame ids of {next_frame}, more than the {spec.window_pages_of(branch)} the spec reserves"
                )
        return freed

    def _check_pin(self, branch: Branch, new_pages: int) -> None:
        """An in-context write of ``new_pages``: the block is a prefix (no other entry yet) within max_pinned_pages."""
        limit = self.storage.spec.max_pinned_pages
        state = self._branches[branch]
        if not limit:
            raise ValueError("in-context entries need KVSpec.max_pinned_pages > 0: this cache pins nothing")
        if branch not in self.storage.spec.pinned_branches:
            raise ValueError(f"the {Branch(branch).name} branch pins nothing (KVSpec.pinned_branches)")
        if state.resident or state.provisional:
            raise ValueError(
                f"session {self.session_id!r} {Branch(branch).name}: in-context entries are the window's prefix; "
                f"write them before any observation or prediction (restart the window first)"
            )
        if len(state.pinned) + new_pages > limit:
            raise ValueError(
                f"session {self.session_id!r} {Branch(branch).name}: a pinned block of {len(state.pinned) + new_pages} pages "
                f"exceeds KVSpec.max_pinned_pages={limit}"
            )

    def _evict_to_fit(self, branch: Branch, new_pages: int) -> None:
        """Free the oldest pages until the branch's pages plus ``new_pages`` fit in the window
        (``KVSpec.evict_to_fit``): committed first, then provisional."""
        state = self._branches[branch]
        from_resident, from_provisional = pages_to_fit(
            len(state.resident), len(state.provisional), new_pages, window_pages=self.storage.spec.window_pages
        )
        victims = state.resident[:from_resident] + state.provisional[:from_provisional]
        if victims:
            del state.resident[:from_resident]
            del state.provisional[:from_provisional]
            state.evicted_pages += len(victims)
            self._free(victims)

    def abort(self, branch: Branch) -> None:
        """The forward failed: free the pages it allocated; nothing is committed."""
        state = self._branches[branch]
        ctx = state.pending
        state.pending = None
        if ctx is not None and ctx.new_pages:
            self.pool.free(ctx.new_pages)
            ctx.new_pages = []

    # -- cross-attention --------------------------------------------------------------

    def write_cross(
        self,
        branch: Branch,
        layer: int,
        *,
        text: tuple[torch.Tensor, torch.Tensor] | None = None,
        image: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """Store one layer's projected cross-attention K/V ((1, tokens, heads, head_dim) each)."""
        self._check_open()
        self.storage.check_local(branch)
        state = self._branches[branch]
        if state.cross_slot is None:
            state.cross_slot = self.storage.cross.acquire()
        self.storage.cross.write(state.cross_slot, layer, text=text, image=image)

    def mark_cross_ready(self, branch: Branch, *, text: bool = False, image: bool = False) -> None:
        state = self._branches[branch]
        state.cross_text_ready |= text
        state.cross_image_ready |= image

    def invalidate_cross(self) -> None:
        """Every branch's cross-attention K/V must be written again (a rolled-back call rewrote them: a rollback
        restores pages, not the cross-attention slot)."""
        for state in self._branches.values():
            state.cross_text_ready = state.cross_image_ready = False

    def cross_ready(self, branch: Branch) -> tuple[bool, bool]:
        state = self._branches[branch]
        return state.cross_text_ready, state.cross_image_ready

    def cross_kv(self, branch: Branch) -> list[CrossKV]:
        """Per-layer cached cross K/V. Reading before it was written is a bug: raise loudly."""
        state = self._branches[branch]
        needs_image = self.storage.spec.cross_image_tokens > 0
        if state.cross_slot is None or not state.cross_text_ready or (needs_image and not state.cross_image_ready):
            raise RuntimeError(
                f"session {self.session_id!r} {branch.name}: cross-attention K/V read before it was populated "
                f"(text={state.cross_text_ready}, image={state.cross_image_ready})"
            )
        return [self.storage.cross.read(state.cross_slot, layer) for layer in range(self.storage.spec.num_layers)]

    # -- lifecycle ----------------------------------------------------------------------

    def _check_prediction(self, branch: Branch, new_pages: int) -> None:
        """A prediction of ``new_pages``: within the branch's reservation. An evict-to-fit window makes room itself;
        a chunk window evicts only after an observation, so predictions stacked without one are refused."""
        spec = self.storage.spec
        state = self._branches[branch]
        if spec.evict_to_fit or len(state.resident) + len(state.provisional) + new_pages <= spec.window_pages_for(branch):
            return
        raise ValueError(
            f"session {self.session_id!r} {Branch(branch).name}: a prediction of {new_pages} pages on top of "
            f"{len(state.provisional)} predicted and {len(state.resident)} observed exceeds the window's reservation "
            f"({spec.window_pages_for(branch)} pages); drop_predictions() first"
        )

    def _check_observation(self, branch: Branch, new_pages: int) -> None:
        """An observation of ``new_pages`` under ``KVSpec.frame_window`` (which never evicts by itself): within the
        branch's reservation, else the episode did not trim its window."""
        spec = self.storage.spec
        state = self._branches[branch]
        if len(state.resident) + new_pages <= spec.window_pages_for(branch):
            return
        raise ValueError(
            f"session {self.session_id!r} {Branch(branch).name}: an observation of {new_pages} pages on top of "
            f"{len(state.resident)} observed exceeds the window's reservation ({spec.window_pages_for(branch)} pages); trim_window() first"
        )

    def restart_window(self, *, keep_cross_text: bool = False, keep_pinned: bool = False) -> None:
        """Start a fresh window: free every page; the image conditioning must be re-populated.

        ``keep_cross_text``: a window reset inside a session keeps the prompt, so its text K/V
        stay valid; a session reset (new prompt, explicit reset) drops them too. ``keep_pinned``: the
        in-context block stays (a window reset inside an episode); an episode reset frees it with the rest.
        """
        self._check_open()
        for branch, state in self._branches.items():
            self.abort(branch)
            self._free(state.resident + state.provisional + ([] if keep_pinned else state.pinned))
            state.resident, state.provisional = [], []
            state.frames = {}
            if not keep_pinned:
                state.pinned = []
            state.committed_tokens = 0
            state.evicted_pages = 0
            state.cross_image_ready = False
            if not keep_cross_text:
                state.cross_text_ready = False

    def free_all(self) -> None:
        """Return every page and cross-attention slot this session owns (the cache's
        ``end_session`` calls this). Idempotent."""
        if self.ended:
            return
        set_aside = self._set_aside
        self._end_snapshot()
        self.pool.free(set_aside)
        for branch, state in self._branches.items():
            self.abort(branch)
            self.pool.free(state.held)
            state.pinned, state.resident, state.provisional = [], [], []
            state.frames = {}
            if state.cross_slot is not None:
                self.storage.cross.release(state.cross_slot)
                state.cross_slot = None
        self.ended = True

    def _check_open(self) -> None:
        if self.ended:
            raise RuntimeError(f"session {self.session_id!r} was ended; its KV can no longer be used")
