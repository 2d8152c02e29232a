"""CUDA-graph capture of the denoise forward (policies/dreamzero/cuda_graphs.py), on the CPU.

The graphs themselves need a GPU (scripts/gpu_check.py's ``flex+graphs`` variant and its capture
under a busy encoder thread). Here torch.cuda's graph API is replaced by recording fakes, to check
how a capture is asked for: in ``thread_local`` error mode, so the encoder thread's CUDA work on
its own stream cannot invalidate a capture made while serving, and the start-up log says so.
"""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch

from ardiff_kv import PagedLayerInputs
from ardiff_policies.dreamzero import cuda_graphs


class FakeStream:
    def wait_stream(self, other) -> None:
        pass


class FakeGraph:
    def __init__(self) -> None:
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1


@pytest.fixture
def captures(monkeypatch) -> list[dict]:
    """torch.cuda's stream and graph API as fakes; each capture's keyword arguments are recorded."""
    recorded: list[dict] = []

    @contextlib.contextmanager
    def graph(cuda_graph, **kwargs):
        recorded.append({"graph": cuda_graph, **kwargs})
        yield

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "the pool")
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    return recorded


def layer_inputs() -> list[PagedLayerInputs]:
    pool = torch.zeros(2, 4, 1, 8)
    ints = lambda n: torch.zeros(n, dtype=torch.int32)  # noqa: E731
    return [
        PagedLayerInputs(
            pool, pool, torch.zeros(3, dtype=torch.long), torch.zeros(0, dtype=torch.long), ints(2).view(1, 2), ints(2), ints(1), 3, 3, "flex"
        )
    ]


def test_a_denoise_graph_is_captured_in_thread_local_error_mode_and_the_start_up_log_says_so(captures, caplog):
    forwards = []

    def dit(x, timestep, **kwargs):
        forwards.append(x.shape)
        return x * 2, kwargs["action"] * 3

    with caplog.at_level(logging.INFO, logger=cuda_graphs.__name__):
        graphs = cuda_graphs.DenoiseGraphs(dit, warmup_runs=1)
    assert any("capture_error_mode=thread_local" in r.getMessage() for r in caplog.records), caplog.text
    tensors = {
        "x": torch.ones(1, 2, 2, 3, 3),
        "timestep": torch.zeros(1, 2, dtype=torch.long),
        "action": torch.ones(1, 4, 2),
        "timestep_action": torch.zeros(1, 4, dtype=torch.long),
        "state": torch.zeros(1, 1, 5),
    }
    key = ((0, 1, 3),)
    video, action = graphs.run(key, layer_inputs=layer_inputs(), cross_kv=[], current_start_frame=[3], **tensors)
    assert len(captures) == 1 and captures[0]["capture_error_mode"] == "thread_local" and captures[0]["pool"] == "the pool"
    assert len(forwards) == 2  # the warm-up run, then the captured one
    assert torch.equal(video, 2 * tensors["x"]) and torch.equal(action, 3 * tensors["action"])
    graphs.run(key, layer_inputs=layer_inputs(), cross_kv=[], current_start_frame=[3], **tensors)
    assert len(captures) == 1 and captures[0]["graph"].replays == 2 and not graphs.failed  # the same key replays
