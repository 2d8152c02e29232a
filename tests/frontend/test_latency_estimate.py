"""The server's estimate of a session's next call (``frontend/latency.py``): the reply's ``next_call_p90_ms``."""

from __future__ import annotations

import numpy as np
import pytest

from ardiff_server.frontend.latency import ServiceTimes


def test_the_estimate_is_the_p90_of_the_recent_calls_at_that_batch_size():
    times = ServiceTimes(window=10, min_samples=2)
    assert times.estimate(1) is None  # nothing answered yet
    for seconds in [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]:
        times.record(1, seconds)
    assert times.estimate(1) == pytest.approx(np.percentile([0.1 * k for k in range(1, 11)], 90)) == pytest.approx(0.91)
    for seconds in [2.0, 2.0, 4.0]:  # another load: three robots in one forward take longer
        times.record(3, seconds)
    assert times.estimate(3) == pytest.approx(np.percentile([2.0, 2.0, 4.0], 90))
    # the batch of one's history is its own: the slower batch's calls are not in it (only in the window of all sizes)
    assert times.estimate(1) == pytest.approx(0.91)


def test_a_window_forgets_old_load_and_a_rare_size_falls_back_to_every_size():
    times = ServiceTimes(window=4, min_samples=3)
    for seconds in [5.0, 5.0, 5.0, 5.0, 0.2, 0.2, 0.2, 0.2]:  # the server was slow, then the load went
        times.record(2, seconds)
    assert times.estimate(2) == pytest.approx(0.2)
    times.record(4, 1.0)  # one call at b = 4: too few to stand alone, so the recent calls at any size
    assert times.estimate(4) == pytest.approx(np.percentile([0.2, 0.2, 0.2, 1.0], 90))
    with pytest.raises(ValueError, match="min_samples"):
        ServiceTimes(window=4, min_samples=5)
