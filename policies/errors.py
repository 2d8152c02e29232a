"""Errors a policy raises at start-up (torch-free: the front end's preflight raises some of them too)."""

from __future__ import annotations


class StartRefused(RuntimeError):
    """A policy refuses to start on this machine (e.g. its memory plan does not fit a device).
    The message is one line naming the problem and the fix: workers log it without a traceback."""
