"""A DreamZero session as it was before a call, to put back when the safety gate rejects the call's chunk.

The gate sees the chunk only after the call's KV prefill was committed (and, at a window start, its cross-attention
K/V rewritten), so a rejected call is undone: the KV pages go back to their snapshot (``ardiff_kv.SessionKV``'s
snapshot / rollback), the session's own fields to what they were, and the cross-attention K/V are projected again
from the restored text and image features. The robot's next call then runs as if the rejected one
had never come. Only taken when the gate rejects (``policy.safety.mode: reject``): a snapshot keeps the pages a call
evicts until it is released.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ardiff_policies.dreamzero.session import DreamZeroSession

# The session fields a call changes (DreamZeroSession); ``frames`` is copied, the tensors are replaced, never written.
_FIELDS = ("calls", "prompt", "prompt_embeds", "current_start_frame", "clip_feature", "ys", "first_latent", "chunks", "last_chunk")


@dataclass
class SessionUndo:
    session: DreamZeroSession
    frames: list
    fields: dict[str, Any]

    @classmethod
    def take(cls, session: DreamZeroSession) -> SessionUndo:
        session.kv.snapshot()
        return cls(session, list(session.frames), {name: getattr(session, name) for name in _FIELDS})

    def restore(self, populate_cross: Callable[[DreamZeroSession], None]) -> None:
        """Back to before the call. The call may have rewritten the cross-attention K/V (a window start, a session's
        first call): they are marked unwritten and, for a session that had a window, ``populate_cross`` projects its
        restored text and image features again (a few small projections: rejects are rare)."""
        s = self.session
        s.kv.rollback()
        s.frames = deque(self.frames, maxlen=s.frames.maxlen)
        for name, value in self.fields.items():
            setattr(s, name, value)
        s.prepared = None
        s.kv.invalidate_cross()
        if s.prompt is not None:  # else a fresh session: its next call writes them
            populate_cross(s)

    def release(self) -> None:
        self.session.kv.release()
