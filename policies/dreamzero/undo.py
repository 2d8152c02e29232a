"""A DreamZero session as it was before a call, to put back when the safety gate rejects the call's chunk.

The gate sees the chunk only after the call's KV prefill was committed (and, at a window start, its cross-attention
K/V rewritten), so a rejected call is undone: the KV pages go back to their snapshot (``ardiff_kv.SessionKV``'s
snapshot / rollback), the session's own fields to what they were, and cross-attention K/V the call rewrote are
projected again from the restored text and image features. The robot's next call then runs as if the rejected one
had never come. Only taken when the gate rejects (``policy.safety.mode: reject``): a snapshot keeps the pages a call
evicts until it is released.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ardiff_policies.dreamzero.policy import DreamZeroSession

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

    def restore(self, *, window_start: bool, populate_cross: Callable[[DreamZeroSession], None]) -> None:
        """Back to before the call. A call that started a window (a prompt change, a window restart) rewrote the
        cross-attention K/V: ``populate_cross`` projects the restored session's text and image features again."""
        s = self.session
        s.kv.rollback()
        s.frames = deque(self.frames, maxlen=s.frames.maxlen)
        for name, value in self.fields.items():
            setattr(s, name, value)
        s.prepared = None
        if window_start and s.prompt is not None:  # a session's first call leaves nothing to restore
            s.kv.invalidate_cross()
            populate_cross(s)

    def release(self) -> None:
        self.session.kv.release()
