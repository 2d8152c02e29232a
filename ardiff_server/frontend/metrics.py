"""Prometheus metrics for ``GET /metrics`` (own registry; exposition by prometheus_client).

Request outcomes and latencies are counted as they happen; engine state (sessions, KV pages,
steps, restarts, per replica and rank) is read from the engine client at scrape time. With API
keys, sessions, connections and refusals are also counted per key, labelled by its id (``key0``,
...), never the key.

Renamed in 0.2 to the glossary's words (``ardiff_server/engine/__init__.py``); the old names are
still exported as aliases with the same values for one release (``DEPRECATED_ALIASES``), so
dashboards keep working while they move:

=================================  ======================================
old name (alias until 0.3)         name
=================================  ======================================
``ardiff_connections_active``      ``ardiff_connections_open``
``ardiff_sessions_active``         ``ardiff_sessions_open``
``ardiff_kv_blocks_free``          ``ardiff_kv_pages_free``
``ardiff_kv_blocks_total``         ``ardiff_kv_pages_total``
=================================  ======================================

``ardiff_session_endings`` was a gauge; it is a counter (samples ``ardiff_session_endings_total``, so
``rate()`` and ``increase()`` work on it). It has no alias: a gauge of the old name would be a second
family of the same name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from ardiff_policies.safety import CHECKS as SAFETY_CHECKS

OUTCOMES = (
    "ok",
    "reset",
    "bad_request",
    "forbidden",
    "policy_error",
    "capacity",
    "worker_died",
    "timeout",
    "unavailable",
)
CLOSE_REASONS = ("idle", "write_limit")
KEY_LIMITS = ("sessions", "connections")  # what a key was refused: a new session, a new connection
# A failed TLS handshake: a ws:// or http:// request to the TLS port, an old TLS version, a client
# that does not trust this certificate (expired? another name?), anything else.
TLS_FAILURES = ("plaintext", "protocol_version", "certificate", "other")
DEPRECATED_ALIASES = {
    "ardiff_connections_active": "ardiff_connections_open",
    "ardiff_sessions_active": "ardiff_sessions_open",
    "ardiff_kv_blocks_free": "ardiff_kv_pages_free",
    "ardiff_kv_blocks_total": "ardiff_kv_pages_total",
}
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
# Seconds of actions a robot had left when its call's step started (negative: it ran dry before).
SLACK_BUCKETS = (-1.0, -0.5, -0.2, -0.1, -0.05, 0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0)
_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0)


class Metrics:
    def __init__(self, engine: Any) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("ardiff_requests", "Requests by outcome", ["outcome"], registry=r)
        for outcome in OUTCOMES:
            self.requests.labels(outcome)
        self.infer_seconds = Histogram(
            "ardiff_infer_seconds",
            "Policy compute time per infer request (its step and its own encodes beside the batch)",
            registry=r,
            buckets=_BUCKETS,
        )
        self.request_seconds = Histogram(
            "ardiff_request_seconds", "Server time per infer request (queue + compute + codec)", registry=r, buckets=_BUCKETS
        )
        self.queue_seconds = Histogram(
            "ardiff_queue_seconds",
            "Time an infer request waited in the engine behind other robots' steps and encodes (not its own)",
            registry=r,
            buckets=_BUCKETS,
        )
        self.deadline_misses = Counter(
            "ardiff_deadline_misses", "Infer requests whose step started after their deadline (their robot ran out of actions)", registry=r
        )
        self.deadline_slack_seconds = Histogram(
            "ardiff_deadline_slack_seconds",
            "Per infer request with a deadline: the deadline less its step's start (negative: missed)",
            registry=r,
            buckets=SLACK_BUCKETS,
        )
        self.batch_elements = Histogram(
            "ardiff_request_batch_elements",
            'Requests per batched frame ({"batch": [...]}); each is also counted by its outcome in ardiff_requests',
            registry=r,
            buckets=BATCH_BUCKETS,
        )
        self.connections = Gauge("ardiff_connections_open", "Open websocket connections", registry=r)
        self.closed = Counter("ardiff_connections_closed", "Connections the server closed, by reason", ["reason"], registry=r)
        for reason in CLOSE_REASONS:
            self.closed.labels(reason)
        self.key_refusals = Counter(
            "ardiff_key_refusals", "New sessions and connections refused by a key's limit (or a full engine), by key id", ["key", "limit"], registry=r
        )
        # The safety gate (policy.safety): chunks it clamped and chunks it rejected, by the check that did.
        self.safety_clamps = Counter("ardiff_safety_clamps", "Chunks the safety gate clamped, by check", ["check"], registry=r)
        self.safety_rejects = Counter("ardiff_safety_rejects", "Chunks the safety gate rejected (a bad request), by check", ["check"], registry=r)
        for check in SAFETY_CHECKS:
            self.safety_clamps.labels(check)
            self.safety_rejects.labels(check)
        self.tls_handshake_failures = Counter("ardiff_tls_handshake_failures", "TLS handshakes that failed, by kind", ["kind"], registry=r)
        self.tls_reloads = Counter("ardiff_tls_reloads", "Certificate reloads (SIGHUP), by result", ["result"], registry=r)
        engine_collector = EngineCollector(engine)
        r.register(engine_collector)
        r.register(_Aliases([self.connections, engine_collector]))

    content_type = CONTENT_TYPE_LATEST

    def observe_deadline(self, reply: Any) -> None:
        """A served call's slack (``InferReply.deadline_slack_s``), if it had a deadline."""
        if reply.deadline_slack_s is not None:
            self.deadline_slack_seconds.observe(reply.deadline_slack_s)
            if reply.deadline_missed:
                self.deadline_misses.inc()

    def watch_keys(self, key_ids: list[str], sessions: Callable[[], Mapping], connections: Callable[[], Mapping]) -> None:
        """Export per key id: open sessions and connections (read at scrape time) and refusals."""
        for key in key_ids:
            for limit in KEY_LIMITS:
                self.key_refusals.labels(key, limit)
        self.registry.register(_KeyCollector(key_ids, sessions, connections))

    def watch_tls(self) -> None:
        for kind in TLS_FAILURES:
            self.tls_handshake_failures.labels(kind)
        for result in ("ok", "failed"):
            self.tls_reloads.labels(result)

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
        sessions = GaugeMetricFamily("ardiff_sessions_open", "Sessions holding model/KV state in the engine", labels=["replica"])
        placed = GaugeMetricFamily("ardiff_sessions_placed", "Sessions the front end routes to the replica", labels=["replica"])
        steps = GaugeMetricFamily("ardiff_engine_steps", "Policy steps run by the replica's current engine", labels=["replica"])
        kv_free = GaugeMetricFamily("ardiff_kv_pages_free", "Free KV pages", labels=["replica", "rank"])
        kv_total = GaugeMetricFamily("ardiff_kv_pages_total", "KV pages in the pool", labels=["replica", "rank"])
        endings = CounterMetricFamily("ardiff_session_endings", "Sessions ended in the engine, by reason", labels=["replica", "reason"])
        dropped = CounterMetricFamily(
            "ardiff_recording_dropped_calls", "Calls not recorded: the recorder's queue was full (slow decode or disk)", labels=["replica"]
        )
        batches = HistogramMetricFamily(
            "ardiff_batch_size", "Sessions per engine step (a step runs the robots whose requests wait together)", labels=["replica"]
        )
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
            dropped.add_metric([label], first.recording_dropped)
            for reason, count in sorted(first.endings.items()):
                endings.add_metric([label, reason], count)
            if first.batches:
                sizes = first.batches
                cumulative = [(str(b), sum(n for size, n in sizes.items() if size <= b)) for b in BATCH_BUCKETS]
                total = sum(sizes.values())
                batches.add_metric([label], [*cumulative, ("+Inf", total)], sum_value=sum(size * n for size, n in sizes.items()))
            for rank_stats in replica.stats:
                kv_free.add_metric([label, str(rank_stats.rank)], rank_stats.kv_pages_free)
                kv_total.add_metric([label, str(rank_stats.rank)], rank_stats.kv_pages_total)
        yield from (up, state, restarts, restart_s, sessions, placed, steps, kv_free, kv_total, endings, batches, dropped)


class _KeyCollector(Collector):
    def __init__(self, key_ids: list[str], sessions: Callable[[], Mapping], connections: Callable[[], Mapping]) -> None:
        self.key_ids, self.sessions, self.connections = key_ids, sessions, connections

    def collect(self) -> Iterator[Any]:
        sessions = GaugeMetricFamily("ardiff_key_sessions_open", "Sessions a key holds (admitted, not ended), by key id", labels=["key"])
        connections = GaugeMetricFamily("ardiff_key_connections_open", "Open connections authenticated by a key, by key id", labels=["key"])
        held, open_connections = self.sessions(), self.connections()
        for key in self.key_ids:
            sessions.add_metric([key], held.get(key, 0))
            connections.add_metric([key], open_connections.get(key, 0))
        yield from (sessions, connections)


class _Aliases(Collector):
    """The old metric names (``DEPRECATED_ALIASES``), same samples as their new names."""

    def __init__(self, sources: list[Collector]) -> None:
        self.sources = sources

    def collect(self) -> Iterator[Any]:
        renamed = {new: old for old, new in DEPRECATED_ALIASES.items()}
        for family in (f for source in self.sources for f in source.collect()):
            old = renamed.get(family.name)
            if old is None:
                continue
            alias = GaugeMetricFamily(old, f"Deprecated alias of {family.name} (removed in 0.3)", labels=None)
            for sample in family.samples:
                alias.samples.append(sample._replace(name=old))
            yield alias
