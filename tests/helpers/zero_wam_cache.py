"""Upstream Zero-WAM's cache bookkeeping as plain metadata (no K/V): what each entry is and which queries see it.

A test oracle for the paged implementation (docs/zero-wam.md "The cache"): entries carry upstream's cache type (ICL 2,
observation 0, prediction 1), a CFG half (sequence id), a frame id and a modality; the visibility predicate and the
trims are upstream's (``icl_model.py``: ``ICLAttentionBackend.build_self_mask``, ``clear_prediction_cache``), written
out here for metadata only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

OBSERVATION, PREDICTION, ICL = 0, 1, 2
VIDEO, ACTION = "video", "action"


@dataclass(frozen=True)
class Entry:
    kind: str  # VIDEO or ACTION
    cache_type: int
    seq: int
    frame: int
    chunk: int  # which chunk wrote it (-1: the demonstration)


def sees(query_kind: str, query_seq: int, query_frame: int, key: Entry, window: int) -> bool:
    if key.cache_type == ICL:
        return query_kind == VIDEO and key.seq == query_seq
    in_window = window == -1 or abs(query_frame - key.frame) <= window
    return key.seq == query_seq and in_window


def clear_prediction_cache(entries: list[Entry], window: int) -> list[Entry]:
    """Upstream's ``clear_prediction_cache(window)``: the predictions go; with ``window > 0`` only the observations
    within ``window`` frames of the next frame (the newest observed frame + 1) stay; the in-context block always stays."""
    observed = [e.frame for e in entries if e.cache_type == OBSERVATION]
    next_frame = max(observed) + 1 if observed else 0
    return [e for e in entries if e.cache_type == ICL or (e.cache_type == OBSERVATION and (window <= 0 or abs(e.frame - next_frame) <= window))]


@dataclass
class Episode:
    window: int
    cfg: bool
    chunk: int = 0
    entries: list[Entry] = field(default_factory=list)

    @property
    def halves(self) -> tuple[int, ...]:
        return (0, 1) if self.cfg else (0,)

    def reset(self, demonstration: bool) -> None:
        self.chunk, self.entries = 0, []
        if demonstration:
            self.entries.append(Entry(VIDEO, ICL, 0, 0, -1))

    def infer(self) -> None:
        """The trailing t = 0 video forward keeps the predicted chunk (both halves); the action loop writes nothing."""
        for seq in self.halves:
            self.entries.append(Entry(VIDEO, PREDICTION, seq, 2 * self.chunk, self.chunk))

    def compute_kv_cache(self) -> None:
        self.entries = [e for e in self.entries if e.cache_type != PREDICTION]  # clear_prediction_cache(-1)
        for seq in self.halves:
            self.entries.append(Entry(VIDEO, OBSERVATION, seq, 2 * self.chunk, self.chunk))
        self.entries.append(Entry(ACTION, OBSERVATION, 0, 2 * self.chunk + 1, self.chunk))  # the action history: half 0
        self.entries = clear_prediction_cache(self.entries, self.window)
        self.chunk += 1

    def visible(self, query_kind: str, seq: int) -> list[Entry]:
        frame = 2 * self.chunk + (1 if query_kind == ACTION else 0)
        return [e for e in self.entries if sees(query_kind, seq, frame, e, self.window)]
