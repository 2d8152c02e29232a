"""/metrics (frontend/metrics.py): engine state per replica and rank, and the deprecated aliases."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from ardiff_server.engine.client import ReplicaStatus
from ardiff_server.engine.messages import EngineStats
from ardiff_server.frontend.metrics import DEPRECATED_ALIASES, Metrics


class FakeEngine:
    def replicas(self):
        rank0 = EngineStats(rank=0, session_ids=("a", "b"), steps=7, endings={"reset": 2, "ttl": 1}, kv_pages_total=64, kv_pages_free=40)
        rank1 = EngineStats(rank=1, session_ids=("a", "b"), kv_pages_total=32, kv_pages_free=20)
        return [
            ReplicaStatus(0, ["cuda:0", "cuda:1"], "ready", [11, 12], (rank0, rank1), restarts=1, last_restart_s=2.5, sessions_placed=2),
            ReplicaStatus(1, ["cuda:2", "cuda:3"], "restarting", restarts=3),
        ]


def samples(metrics: Metrics) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def test_engine_state_is_exported_per_replica_and_rank():
    metrics = Metrics(FakeEngine())
    metrics.connections.set(3)
    metrics.requests.labels("ok").inc(5)
    got = samples(metrics)
    assert got[("ardiff_connections_open", ())] == 3
    assert got[("ardiff_requests_total", (("outcome", "ok"),))] == 5
    assert got[("ardiff_worker_up", (("replica", "0"),))] == 1 and got[("ardiff_worker_up", (("replica", "1"),))] == 0
    assert got[("ardiff_worker_state", (("replica", "1"), ("state", "restarting")))] == 1
    assert got[("ardiff_worker_restarts_total", (("replica", "1"),))] == 3
    assert got[("ardiff_sessions_open", (("replica", "0"),))] == 2
    assert got[("ardiff_sessions_placed", (("replica", "0"),))] == 2
    assert got[("ardiff_kv_pages_free", (("rank", "1"), ("replica", "0")))] == 20
    assert got[("ardiff_kv_pages_total", (("rank", "0"), ("replica", "0")))] == 64
    assert got[("ardiff_session_endings_total", (("reason", "reset"), ("replica", "0")))] == 2
    assert ("ardiff_sessions_open", (("replica", "1"),)) not in got  # no stats from a restarting replica


def test_the_old_metric_names_carry_the_same_samples():
    metrics = Metrics(FakeEngine())
    metrics.connections.set(4)
    got = samples(metrics)
    for old, new in DEPRECATED_ALIASES.items():
        new_samples = {labels: v for (name, labels), v in got.items() if name == new}
        old_samples = {labels: v for (name, labels), v in got.items() if name == old}
        assert new_samples and old_samples == new_samples, old


def test_session_endings_are_a_counter():
    """Endings only grow (each replica's engine counts them since its start): a counter, so rate() and
    increase() work on it; the old gauge name stays an alias until 0.3."""
    families = {f.name: f for f in text_string_to_metric_families(Metrics(FakeEngine()).render().decode())}
    assert families["ardiff_session_endings"].type == "counter"
    assert families["ardiff_worker_restarts"].type == "counter"
    assert [s.name for s in families["ardiff_session_endings"].samples] == ["ardiff_session_endings_total"] * 2
