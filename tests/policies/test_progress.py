"""Start-up progress lines: weights shard by shard with GiB, GiB/s and time left; warm-up per call with the time left."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from ardiff_policies.progress import LoadProgress, StepProgress, frames_label

GiB = 2**30


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_weights_are_reported_shard_by_shard_with_rates_and_time_left(caplog):
    clock = Clock()
    shards = {Path("model-00001-of-00002.safetensors"): 3 * GiB, Path("model-00002-of-00002.safetensors"): 1 * GiB}
    progress = LoadProgress("weights", shards, clock=clock)
    with caplog.at_level(logging.INFO, logger="ardiff_policies.progress"):
        progress.read(Path("model-00001-of-00002.safetensors"), 1 * GiB)
        clock.now = 1.0
        progress.read(Path("model-00001-of-00002.safetensors"), 2 * GiB)
        clock.now = 2.0
        progress.read(Path("model-00002-of-00002.safetensors"), 1 * GiB)  # 3 GiB in 2 s: 1 GiB left at 1.5 GiB/s
        clock.now = 2.5
        progress.finish()
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "weights: shard 1/2 model-00001-of-00002.safetensors (3.00 GiB)",
        "weights: shard 2/2 model-00002-of-00002.safetensors (1.00 GiB); 3.00 GiB of 4.00 GiB read in 2.0 s (1.50 GiB/s), ~1 s left",
        "weights: 4.00 GiB from 2 shard(s) in 2.5 s (1.60 GiB/s)",
    ]


def test_warm_up_calls_say_their_shapes_and_the_time_left_to_listening(caplog):
    clock = Clock()
    progress = StepProgress("warm-up", 3, clock=clock)
    with caplog.at_level(logging.INFO, logger="ardiff_policies.progress"):
        clock.now = 4.0  # the first call compiles
        progress.step(frames_label({"a": np.zeros((1, 180, 320, 3)), "b": None}))
        clock.now = 5.0
        progress.step(frames_label({"a": np.zeros((4, 180, 320, 3))}))
        clock.now = 5.5
        progress.step()
    assert [r.getMessage() for r in caplog.records] == [
        "warm-up: call 1/3 (1 frame 180x320) 4000 ms; ~8.0 s left to listening",
        "warm-up: call 2/3 (4 frames 180x320) 1000 ms; ~2.5 s left to listening",
        "warm-up: call 3/3 500 ms; 5.5 s in all",
    ]


def test_quiet_under_log_level_warning(caplog):
    with caplog.at_level(logging.WARNING):
        progress = LoadProgress("weights", {Path("a.safetensors"): GiB})
        progress.read(Path("a.safetensors"), GiB)
        progress.finish()
        StepProgress("warm-up", 1).step()
    assert caplog.records == []


def test_loading_a_checkpoint_reports_its_shards(caplog):
    from ardiff_policies.dreamzero.model import DreamZeroModel
    from ardiff_policies.dreamzero.tiny import ensure_tiny_checkpoint

    with caplog.at_level(logging.INFO, logger="ardiff_policies.progress"):
        DreamZeroModel.load(ensure_tiny_checkpoint())
    lines = [r.getMessage() for r in caplog.records if r.name == "ardiff_policies.progress"]
    assert [line.split(" (")[0] for line in lines[:2]] == [
        "weights: shard 1/2 model-00001-of-00002.safetensors",
        "weights: shard 2/2 model-00002-of-00002.safetensors",
    ]
    assert lines[-1].startswith("weights: ") and "from 2 shard(s)" in lines[-1]
