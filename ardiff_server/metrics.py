"""Prometheus metrics for ``GET /metrics`` (own registry; exposition by prometheus_client)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

OUTCOMES = ("ok", "reset", "bad_request", "policy_error", "capacity", "worker_died", "timeout")


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("ardiff_requests", "Requests by outcome", ["outcome"], registry=r)
        for outcome in OUTCOMES:
            self.requests.labels(outcome)
        self.infer_seconds = Histogram(
            "ardiff_infer_seconds", "Policy compute time per infer request", registry=r,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0),
        )  # fmt: skip
        self.request_seconds = Histogram(
            "ardiff_request_seconds", "Server time per infer request (queue + compute + codec)", registry=r,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0),
        )  # fmt: skip
        self.sessions_active = Gauge("ardiff_sessions_active", "Sessions holding model/KV state in the engine", registry=r)
        self.connections = Gauge("ardiff_connections_active", "Open websocket connections", registry=r)
        self.kv_free = Gauge("ardiff_kv_blocks_free", "Free KV pages", ["rank"], registry=r)
        self.kv_total = Gauge("ardiff_kv_blocks_total", "KV pages in the pool", ["rank"], registry=r)
        self.session_endings = Gauge("ardiff_session_endings", "Sessions ended in the engine, by reason", ["reason"], registry=r)
        self.engine_steps = Gauge("ardiff_engine_steps", "Policy steps run by the current worker", registry=r)
        self.worker_restarts = Counter("ardiff_worker_restarts", "Worker processes restarted after dying", registry=r)
        self.worker_up = Gauge("ardiff_worker_up", "1 when the inference worker is ready", registry=r)

    def update_engine(self, stats: list[dict]) -> None:
        """Refresh gauges from the stats every worker reply carries (one dict per rank)."""
        if not stats:
            return
        self.sessions_active.set(stats[0]["sessions"])
        self.engine_steps.set(stats[0]["steps"])
        for rank_stats in stats:
            rank = str(rank_stats["rank"])
            self.kv_free.labels(rank).set(rank_stats["kv_pages_free"])
            self.kv_total.labels(rank).set(rank_stats["kv_pages_total"])
        for reason, count in stats[0]["removals"].items():
            self.session_endings.labels(reason).set(count)

    def render(self) -> bytes:
        return generate_latest(self.registry)
