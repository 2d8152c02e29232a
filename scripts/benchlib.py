"""Shared by the benchmarks: how much CPU other processes used while we measured."""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path


class ForeignLoad:
    """CPU other processes burn while we measure (Linux /proc/stat). On a small shared machine a
    neighbour that takes a core stalls every parallel op at its thread barrier, which inflates
    many-small-op paths far more than others: a run with foreign load is not a clean comparison."""

    def __init__(self) -> None:
        self.start = self._sample()

    @staticmethod
    def _sample() -> tuple[float, float, float] | None:
        try:
            ticks = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        except (OSError, ValueError):
            return None
        busy = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # all but idle + iowait
        own = sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN) for f in ("ru_utime", "ru_stime"))
        return time.monotonic(), busy, own

    def cores(self) -> float | None:
        """Average number of cores other processes kept busy since construction."""
        end = self._sample()
        if self.start is None or end is None or end[0] <= self.start[0]:
            return None
        return max(0.0, (end[1] - self.start[1]) - (end[2] - self.start[2])) / (end[0] - self.start[0])


def contended(foreign_cores: float | None, threads: int) -> bool:
    """True when neighbours left fewer free cores than we run threads (with some slack)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return foreign_cores is not None and foreign_cores > max(0, cores - threads) + 0.2
