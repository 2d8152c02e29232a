"""Progress of long start-up work: a log line per step, with sizes, rates and the time left.

Loading a 46 GB checkpoint, compiling and warming up take minutes; these lines say how far it is. They are
INFO records of this module's logger, so ``--log-level warning`` keeps start-up quiet. Torch-free.

    weights: shard 2/6 model-00002-of-00006.safetensors (9.31 GiB); 9.80 GiB of 46.20 GiB read in 4.1 s (2.39 GiB/s), ~15 s left
    weights: 46.20 GiB from 6 shard(s) in 19.0 s (2.43 GiB/s)
    warm-up: call 2/6 (4 frames) 812 ms; ~3.2 s left to listening
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path

logger = logging.getLogger(__name__)

GiB = 2**30


def _size(nbytes: float) -> str:
    return f"{nbytes / GiB:.2f} GiB" if nbytes >= 0.1 * GiB else f"{nbytes / 2**20:.1f} MiB"


def _rate(nbytes: float, seconds: float) -> str:
    return _size(nbytes / seconds) + "/s"


class LoadProgress:
    """Bytes read from a set of files (safetensors shards): a line when reading reaches a new shard, one at the end."""

    def __init__(self, what: str, shard_bytes: Mapping[Path, int], clock: Callable[[], float] = time.perf_counter) -> None:
        self.what = what
        self.shard_bytes = dict(shard_bytes)
        self.total = sum(self.shard_bytes.values())
        self.order = {path: i + 1 for i, path in enumerate(sorted(self.shard_bytes))}
        self.clock = clock
        self.started = clock()
        self.read_bytes = 0
        self.seen: set[Path] = set()

    def read(self, shard: Path, nbytes: int) -> None:
        if shard not in self.seen:
            self.seen.add(shard)
            elapsed = self.clock() - self.started
            line = f"{self.what}: shard {self.order.get(shard, len(self.seen))}/{len(self.shard_bytes)} {shard.name} ({_size(self.shard_bytes.get(shard, 0))})"
            if self.read_bytes and elapsed > 0:
                left = max(0.0, self.total - self.read_bytes) / (self.read_bytes / elapsed)
                line += (
                    f"; {_size(self.read_bytes)} of {_size(self.total)} read in {elapsed:.1f} s "
                    f"({_rate(self.read_bytes, elapsed)}), ~{left:.0f} s left"
                )
            logger.info("%s", line)
        self.read_bytes += nbytes

    def finish(self) -> None:
        elapsed = self.clock() - self.started
        rate = f" ({_rate(self.read_bytes, elapsed)})" if elapsed > 0 else ""
        logger.info("%s: %s from %d shard(s) in %.1f s%s", self.what, _size(self.read_bytes), len(self.seen), elapsed, rate)


class StepProgress:
    """A known number of steps (warm-up calls, each compiling its shapes the first time): a line per step with its
    time and the estimated time left (steps left x the mean step so far)."""

    def __init__(self, what: str, steps: int, *, until: str = "listening", clock: Callable[[], float] = time.perf_counter) -> None:
        self.what, self.steps, self.until, self.clock = what, steps, until, clock
        self.done = 0
        self.started = self.last = clock()

    def step(self, label: str = "", *, took_ms: float | None = None) -> None:
        """``took_ms``: the step's own time where the caller measured it (else the time since the last step)."""
        now = self.clock()
        self.done += 1
        took, self.last = (now - self.last if took_ms is None else took_ms / 1000.0), now
        left = (now - self.started) / self.done * (self.steps - self.done)
        detail = f" ({label})" if label else ""
        tail = f"; ~{left:.1f} s left to {self.until}" if self.done < self.steps else f"; {now - self.started:.1f} s in all"
        logger.info("%s: call %d/%d%s %.0f ms%s", self.what, self.done, self.steps, detail, took * 1000.0, tail)


def frames_label(cameras: Mapping[str, object]) -> str:
    """``4 frames 180x320`` for a warm-up call's camera arrays ((T, H, W, 3) each; None: a missing camera)."""
    shapes = sorted({tuple(frames.shape[:3]) for frames in cameras.values() if frames is not None})
    return ", ".join(f"{t} frame{'s' if t != 1 else ''} {h}x{w}" for t, h, w in shapes)
