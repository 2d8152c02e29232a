"""What a reply says about the chunk it carries, typed (torch-free: the front end reads it).

A policy's step returns it on :class:`ardiff_policies.base.StepResult` and the engine passes it on in
its reply; the front end puts its fields into the reply (docs/spec.md): ``chunk_id``, ``frozen`` and
``continuation`` at the top of a dict reply (:mod:`ardiff_policies.continuation`), and every field that
is set in the reply's ``session`` map. A field a policy does not say is None and never sent.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True, slots=True)
class ChunkInfo:
    # Continuations (a policy with PolicyInfo.continuations: DreamZero).
    chunk_id: int | None = None  # this chunk's id within the session (1, 2, ...): a continuation names it
    frozen: int | None = None  # leading actions equal to the last chunk's, as the robot executes them
    continuation: str | None = None  # a requested continuation: "applied", or why it was served fresh
    # Episode calls (LingBot-VA).
    call: str | None = None  # the kind of call: "infer", "compute_kv_cache", or "commit+infer" (an OpenPI chunk)
    execute_from: int | None = None  # leading actions the robot skips (the first chunk's conditioning frame)

    def __reduce__(self):
        # Pickled as its values in field order, as the engine's messages are (engine/messages.py pickled_by_fields):
        # slots=True dataclasses' own __getstate__ is a Python loop over fields() per reply.
        return (ChunkInfo, (self.chunk_id, self.frozen, self.continuation, self.call, self.execute_from))

    def set_fields(self) -> dict[str, Any]:
        """The fields that are set, by name (the reply's ``session`` map; a recording's ``info``)."""
        return {f.name: value for f in fields(self) if (value := getattr(self, f.name)) is not None}
