"""Requests waiting for an engine: control requests first, then inference in arrival order.

Per-session order is the front end's business (it never sends a session's next request before
the previous one is answered), so serving ends and detaches ahead of queued inference of other
sessions is safe, and it is what keeps a reset from waiting behind other robots. Torch-free:
the worker's reader thread and the in-process client both fill one.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from ardiff_server.engine.messages import CONTROL, Request


class RequestInbox:
    def __init__(self) -> None:
        self._control: deque[tuple[Request, float]] = deque()
        self._infer: deque[tuple[Request, float]] = deque()
        self._ready = threading.Condition()

    def put(self, request: Request) -> None:
        with self._ready:
            (self._control if isinstance(request, CONTROL) else self._infer).append((request, time.monotonic()))
            self._ready.notify()

    def get(self) -> tuple[Request, float]:
        """The next request and how long it waited here, in ms (behind other sessions' steps)."""
        with self._ready:
            while not self._control and not self._infer:
                self._ready.wait()
            request, arrived = (self._control or self._infer).popleft()
        return request, (time.monotonic() - arrived) * 1000.0

    def empty(self) -> bool:
        with self._ready:
            return not self._control and not self._infer
