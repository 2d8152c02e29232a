"""Whether this server serves a request's ``continuation`` (``policies/continuation.py``), and if not, why.

A continuation is served by a policy that continues chunks (``PolicyInfo.continuations``) under the dict reply, whose
``chunk_id`` / ``frozen`` tell the robot where the new chunk starts. Anywhere else it is refused by name rather than
served as a plain chunk: a robot splicing at ``executed + delay`` into actions nobody froze would jump at the seam.
``server.reply_format: array`` is refused per request, not at start-up: DreamZero's own client needs the bare array
and asks for no continuation, and the policy has no setting that turns continuations off.
"""

from __future__ import annotations

from typing import Any

from ardiff_policies.info import PolicyInfo


def continuation_refusal(policy_name: str, info: PolicyInfo | None, reply_format: str) -> str | None:
    """The reason after ``bad request: continuation: ``, or None when a continuation is served (or no engine is
    ready to say: the request is then answered as every other one)."""
    if info is None:
        return None
    if not info.continuations:
        return f"policy {policy_name} does not continue chunks (its replies carry no chunk_id/frozen); leave it out"
    if reply_format == "array":
        return "server.reply_format is array, whose bare actions cannot say chunk_id/frozen; serve with --set server.reply_format=dict"
    return None


def describe(refusal: str | None) -> dict[str, Any]:
    """``GET /info``'s ``continuations``."""
    return {"accepted": True} if refusal is None else {"accepted": False, "why": refusal}
