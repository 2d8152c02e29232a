"""The engine's encoder thread: session-own work (``Policy.prepare`` jobs) beside the batched steps, each job timed.

One worker, jobs in submission order. Per job it notes how long the job ran (the request's own compute,
``encode_ms``) and how long it waited behind earlier requests' jobs (queueing behind other robots); the moments
between, the hand-over to the thread, are neither.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass


@dataclass
class EncodeTiming:
    """One job's times (written on the encoder thread before its future is done)."""

    submitted: float  # time.perf_counter() at submission
    behind_ms: float = 0.0  # waiting for the thread while earlier jobs ran
    run_ms: float = 0.0  # the job itself


class EncoderThread:
    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None  # started with the first job
        self._last_end = 0.0  # when the previous job ended (encoder thread only)

    def submit(self, job: Callable[[], None]) -> tuple[Future, EncodeTiming]:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ardiff-encoder")
        timing = EncodeTiming(time.perf_counter())
        return self._pool.submit(self._run, job, timing), timing

    def _run(self, job: Callable[[], None], timing: EncodeTiming) -> None:
        start = time.perf_counter()
        timing.behind_ms = max(0.0, min(start, self._last_end) - timing.submitted) * 1000.0
        try:
            job()
        finally:
            self._last_end = time.perf_counter()
            timing.run_ms = (self._last_end - start) * 1000.0

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
