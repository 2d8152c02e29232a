"""Requests waiting for an engine: control requests first, then inference in arrival order.

Per-session order is the front end's business (it never sends a session's next request before
the previous one is answered), so serving ends and detaches ahead of queued inference of other
sessions is safe, and it is what keeps a reset from waiting behind other robots. Inference
requests are taken in batches (``engine.max_batch``): whatever is queued, never waiting for a
batch to fill unless ``engine.batch_wait_ms`` says so. Torch-free: the worker's reader thread
and the in-process client both fill one.
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
        ((request, queued_ms),) = self.get_batch(1)
        return request, queued_ms

    def get_batch(self, max_batch: int, wait_s: float = 0.0) -> list[tuple[Request, float]]:
        """The next work, each request with how long it waited here (ms): one control request if
        any is queued, else up to ``max_batch`` inference requests in arrival order. With ``wait_s``
        a partial batch waits that long for more inference (a control request ends the wait)."""
        with self._ready:
            while not self._control and not self._infer:
                self._ready.wait()
            if not self._control and wait_s > 0 and len(self._infer) < max_batch:
                deadline = time.monotonic() + wait_s
                while not self._control and len(self._infer) < max_batch and (left := deadline - time.monotonic()) > 0:
                    self._ready.wait(left)
            if self._control:
                taken = [self._control.popleft()]
            else:
                taken = [self._infer.popleft() for _ in range(min(max_batch, len(self._infer)))]
        now = time.monotonic()
        return [(request, (now - arrived) * 1000.0) for request, arrived in taken]

    def put_back(self, items: list[tuple[Request, float]]) -> None:
        """Return inference requests the engine could not take this time to the head of the queue,
        in order, keeping their arrival times (``items`` as :meth:`get_batch` returned them)."""
        if not items:
            return
        now = time.monotonic()
        with self._ready:
            self._infer.extendleft((request, now - queued_ms / 1000.0) for request, queued_ms in reversed(items))
            self._ready.notify()

    def empty(self) -> bool:
        with self._ready:
            return not self._control and not self._infer
