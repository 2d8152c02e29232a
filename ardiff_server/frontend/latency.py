"""The server's estimate of a session's next call's latency at the current load: the reply's
``server_timing.next_call_p90_ms``, so that a robot asks for its next chunk as late as is safe
(``ardiff_client.async_runner``, asking ``adaptive``) instead of at a fixed half chunk.

A call's *service time* is its frame's arrival to its reply: its decode, its wait behind other robots' work, its
(batched) step, its encodes and the trips to the engine and back; what its robot waits, less the network. The
estimate after a call that ran in a batch of b sessions is the 90th percentile of the last ``window`` service times
of calls at b: the load now, since how many robots share a forward sets the step's time, and the queue in front
of a call is in each of its times. With fewer than ``min_samples`` calls at b yet (a load the server has not
seen for long), it is the percentile of the last ``window`` calls at any size.

Why here, fed by the reply helper both protocols share (``replies.py``): the front end alone sees a whole service
time, on one clock, for every protocol and every replica behind it; an engine sees only its own part (not the
decode, not the trip), and a Ray replica not even its peers' load. Why a high percentile and not the mean: a robot
that asks at the mean stands still on every call slower than it, and a percentile of a recent window follows the
load as robots come and go.
"""

from __future__ import annotations

from collections import defaultdict, deque

import numpy as np

PERCENTILE = 90.0


class ServiceTimes:
    """Recent service times per batch size, and the estimate a reply carries (see the module docstring)."""

    def __init__(self, *, window: int = 64, min_samples: int = 8, percentile: float = PERCENTILE) -> None:
        if window < 1 or not 1 <= min_samples <= window:
            raise ValueError(f"expected window >= 1 and 1 <= min_samples <= window, got window={window}, min_samples={min_samples}")
        self.window, self.min_samples, self.percentile = window, min_samples, percentile
        self._by_batch: defaultdict[int, deque[float]] = defaultdict(lambda: deque(maxlen=window))
        self._all: deque[float] = deque(maxlen=window)

    def record(self, batch_size: int, seconds: float) -> None:
        """One call answered: it ran in a batch of ``batch_size`` and took ``seconds`` from arrival to reply."""
        self._by_batch[batch_size].append(seconds)
        self._all.append(seconds)

    def estimate(self, batch_size: int) -> float | None:
        """The expected service time of the next call of a session whose last call ran at ``batch_size``,
        in seconds; None before any call was answered."""
        recent = self._by_batch.get(batch_size)
        if recent is None or len(recent) < self.min_samples:
            recent = self._all
        if not recent:
            return None
        return float(np.percentile(np.fromiter(recent, dtype=np.float64), self.percentile))
