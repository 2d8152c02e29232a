"""A thread's own CUDA stream, for GPU work beside the serving thread's steps (the recording's decode).

On the serving thread's stream such work would queue behind, and in front of, the steps' kernels; on its own stream
it overlaps them. Each thread gets one stream per device; leaving the block waits for it, so what ran there is ready
on every stream. Off CUDA: nothing to do.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

_local = threading.local()


@contextlib.contextmanager
def own_stream(device: torch.device) -> Iterator[None]:
    if device.type != "cuda":
        yield
        return
    streams: dict[torch.device, torch.cuda.Stream] = _local.__dict__.setdefault("streams", {})
    stream = streams.get(device)
    if stream is None:
        stream = streams[device] = torch.cuda.Stream(device)
    with torch.cuda.stream(stream):
        yield
    stream.synchronize()
