"""Prometheus metrics of the edge, in a registry of its own (several edges can share a process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
#: A pick among free nodes takes microseconds; a wait in the queue up to ``queue.timeout``.
SCHEDULE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, *LATENCY_BUCKETS)


class EdgeMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "iop_http_requests", "HTTP requests by route and status", ["route", "status"], registry=self.registry
        )
        self.runs = Counter("iop_runs", "Runs by final status", ["status"], registry=self.registry)
        self.retries = Counter(
            "iop_run_retries", "Runs moved to another node after a failure before their first token",
            registry=self.registry,
        )
        self.queued = Gauge("iop_queued_requests", "Requests waiting for a free node", registry=self.registry)
        self.active_runs = Gauge("iop_active_runs", "Runs in flight", registry=self.registry)
        self.connected_nodes = Gauge("iop_connected_nodes", "Registered nodes", registry=self.registry)
        self.schedule_wait = Histogram(
            "iop_schedule_wait_seconds",
            "From a run attempt entering the scheduler to a slot reserved on a node (queueing included)",
            buckets=SCHEDULE_BUCKETS,
            registry=self.registry,
        )
        self.ttft = Histogram(
            "iop_time_to_first_token_seconds",
            "From request to the first generated token",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.request_duration = Histogram(
            "iop_request_duration_seconds",
            "From request to the last byte of the response",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        # Label children bound once, not per request: ``.labels()`` costs a lock and a tuple build.
        self._request_counts: dict[tuple[str, int], Counter] = {}
        self._request_durations: dict[str, Histogram] = {}

    def count_request(self, route: str, status: int) -> None:
        counter = self._request_counts.get((route, status))
        if counter is None:
            counter = self._request_counts[route, status] = self.requests.labels(route=route, status=str(status))
        counter.inc()

    def observe_request(self, route: str, seconds: float) -> None:
        histogram = self._request_durations.get(route)
        if histogram is None:
            histogram = self._request_durations[route] = self.request_duration.labels(route=route)
        histogram.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
