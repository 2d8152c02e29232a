"""Prometheus metrics for ``GET /metrics`` (own registry; exposition by prometheus_client).

Request outcomes and latencies are counted as they happen; engine state (sessions, KV pages,
steps, restarts, per replica and rank) is read from the engine client at scrape time.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

OUTCOMES = (
    "ok", "reset", "bad_request", "forbidden", "policy_error", "capacity", "worker_died", "timeout", "unavailable",
)  # fmt: skip
CLOSE_REASONS = ("idle", "write_limit")
_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0)


class Metrics:
    def __init__(self, engine: Any) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("ardiff_requests", "Requests by outcome", ["outcome"], registry=r)
        for outcome in OUTCOMES:
            self.requests.labels(outcome)
        self.infer_seconds = Histogram("ardiff_infer_seconds", "Policy compute time per infer request", registry=r, buckets=_BUCKETS)
        self.request_seconds = Histogram(
            "ardiff_request_seconds", "Server time per infer request (queue + compute + codec)", registry=r, buckets=_BUCKETS
        )
        self.connections = Gauge("ardiff_connections_active", "Open websocket connections", registry=r)
        self.closed = Counter("ardiff_connections_closed", "Connections the server closed, by reason", ["reason"], registry=r)
        for reason in CLOSE_REASONS:
            self.closed.labels(reason)
        r.register(EngineCollector(engine))

    content_type = CONTENT_TYPE_LATEST

    def render(self) -> bytes:
        return generate_latest(self.registry)


class EngineCollector(Collector):
    """Engine state per replica (and per CFG rank for the KV pool), read at scrape time."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Any]:
        replicas = self.engine.replicas()
        up = GaugeMetricFamily("ardiff_worker_up", "1 when the replica's engine is ready", labels=["replica"])
        state = GaugeMetricFamily("ardiff_worker_state", "1 for the replica's current state", labels=["replica", "state"])
        restarts = CounterMetricFamily("ardiff_worker_restarts", "Engine processes restarted after dying or getting stuck", labels=["replica"])
        restart_s = GaugeMetricFamily("ardiff_worker_restart_seconds", "Duration of the replica's last restart", labels=["replica"])
        sessions = GaugeMetricFamily("ardiff_sessions_active", "Sessions holding model/KV state in the engine", labels=["replica"])
        placed = GaugeMetricFamily("ardiff_sessions_placed", "Sessions the front end routes to the replica", labels=["replica"])
        steps = GaugeMetricFamily("ardiff_engine_steps", "Policy steps run by the replica's current engine", labels=["replica"])
        kv_free = GaugeMetricFamily("ardiff_kv_blocks_free", "Free KV pages", labels=["replica", "rank"])
        kv_total = GaugeMetricFamily("ardiff_kv_blocks_total", "KV pages in the pool", labels=["replica", "rank"])
        endings = GaugeMetricFamily("ardiff_session_endings", "Sessions ended in the engine, by reason", labels=["replica", "reason"])
        for replica in replicas:
            label = str(replica.index)
            up.add_metric([label], 1.0 if replica.state == "ready" else 0.0)
            state.add_metric([label, replica.state], 1.0)
            restarts.add_metric([label], replica.restarts)
            restart_s.add_metric([label], replica.last_restart_s)
            placed.add_metric([label], replica.sessions_placed)
            if not replica.stats:
                continue
            first = replica.stats[0]
            sessions.add_metric([label], first.sessions)
            steps.add_metric([label], first.steps)
            for reason, count in sorted(first.removals.items()):
                endings.add_metric([label, reason], count)
            for rank_stats in replica.stats:
                kv_free.add_metric([label, str(rank_stats.rank)], rank_stats.kv_pages_free)
                kv_total.add_metric([label, str(rank_stats.rank)], rank_stats.kv_pages_total)
        yield from (up, state, restarts, restart_s, sessions, placed, steps, kv_free, kv_total, endings)
