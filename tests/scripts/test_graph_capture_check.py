"""scripts/graph_capture_check.py on the CPU: gpu_check's capture-under-a-busy-encoder check, its verdicts.

The real captures need a GPU; here the policy's ``graphs`` is a recorder (every denoise key it is
asked for counts as a capture, the forward runs eagerly), which is enough to check that the new
session does ask for graphs of its own while the encoder thread runs, and how the check judges.
"""

from __future__ import annotations

import threading

import pytest

from ardiff_kv import PagedKVCache
from ardiff_server.engine.core import SessionEngine
from tests.helpers.dreamzero import make_policy, observations
from tests.helpers.scripts import load_script


class RecordingGraphs:
    """Stands in for DenoiseGraphs: records each key's first use (and whether the encoder ran meanwhile); runs eagerly."""

    def __init__(self, fail_while_encoding: threading.Event | None = None) -> None:
        self.graphs: dict = {}
        self.failed = False
        self.fail_while_encoding = fail_while_encoding

    def run(self, key, **_):
        if key not in self.graphs:
            self.graphs[key] = True
            if self.fail_while_encoding is not None and self.fail_while_encoding.is_set():
                self.failed = True  # what the global capture mode did to a capture beside the encoder's work
        return None


def engine_with(tiny_model, graphs) -> SessionEngine:
    policy, _ = make_policy(tiny_model)
    spec = policy.kv_spec()
    cache = PagedKVCache(spec, num_pages=2 * len(policy.branches) * spec.pages_per_branch + 1, max_sessions=2, branches=policy.branches)
    policy.graphs = graphs
    return SessionEngine(policy, cache, max_sessions=2, max_batch=1)


@pytest.fixture(scope="module")
def check():
    return load_script("graph_capture_check")


def test_a_new_sessions_captures_beside_the_busy_encoder_pass(check, tiny_model):
    graphs = RecordingGraphs()
    engine = engine_with(tiny_model, graphs)
    result = check.capture_under_encoder(engine, list(observations(2, seed=3)), tolerance=1e-5)
    assert result["status"] == "ok" and result["ok"], result
    assert result["graphs_captured_during"] > 0 and result["encoder_runs_during"] > 0 and not result["encoder_errors"]
    assert result["max_abs_normalized_vs_held"] <= 1e-5 and not engine.sessions  # both sessions ended


def test_a_capture_that_failed_beside_the_encoder_fails_the_check(check, tiny_model, monkeypatch):
    encoding = threading.Event()
    engine = engine_with(tiny_model, RecordingGraphs(fail_while_encoding=encoding))
    real_prepare = engine.policy.inputs.prepare

    def prepare(*args, **kwargs):
        encoding.set()
        return real_prepare(*args, **kwargs)

    monkeypatch.setattr(engine.policy.inputs, "prepare", prepare)
    result = check.capture_under_encoder(engine, list(observations(2, seed=3)), tolerance=1e-5)
    assert not result["ok"] and "a capture failed: graphs are off" in result["status"] and result["capture_failed"]
