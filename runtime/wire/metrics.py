"""Prometheus metrics for the server: distributions (histograms), not only counters.

Each server owns its own ``CollectorRegistry`` so several servers in one process (tests, embedding) do not collide
in the global registry. It also carries the process collector (``process_resident_memory_bytes``, CPU seconds, open
files), so a load test can read the server's memory from ``/metrics``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for the server)

from attnx.runtime.wire.errors import Kind

# Seconds: sub-millisecond to tens of seconds (CPU batches of long sequences are slow).
LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)

#: Failure reasons in ``attnx_request_failures_total{reason=...}``: the kinds of :mod:`attnx.runtime.wire.errors`
#: (``client_gone``: the client left before its answer, not our error).
REASONS = tuple(k.value for k in Kind)


class ServerMetrics:
    """All metrics of one server, in one registry."""

    def __init__(self, registry: CollectorRegistry | None = None):
        if registry is None:
            registry = CollectorRegistry()
            ProcessCollector(registry=registry)
        self.registry = registry
        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, ["model"], buckets=buckets, registry=registry)

        self.request_latency = histogram("attnx_request_latency_seconds",
                                         "Request latency, from body received to response ready.", LATENCY_BUCKETS)
        self.queue_time = histogram("attnx_queue_time_seconds",
                                    "Time a request waited in the batcher queue before its batch started.",
                                    LATENCY_BUCKETS)
        self.compute_time = histogram("attnx_compute_time_seconds", "Time to pad, run and split one batch.",
                                      LATENCY_BUCKETS)
        self.batch_size = histogram("attnx_batch_size", "Rows in each batch the model ran.", BATCH_BUCKETS)
        self.batch_requests = histogram("attnx_batch_requests", "Requests merged into each batch.", BATCH_BUCKETS)
        self.successes = Counter("attnx_request_success", "Requests answered with success.", ["model"],
                                 registry=registry)
        self.failures = Counter("attnx_request_failures", "Requests that failed, by kind (wire/errors.py).",
                                ["model", "reason"], registry=registry)
        self.queue_depth = Gauge("attnx_queue_depth", "Requests waiting in the model's queue (batcher or "
                                 "generation scheduler).", ["model"], registry=registry)

    def observer(self, model: str) -> "ModelObserver":
        """The batcher-side hook for one model."""
        return ModelObserver(self, model)

    def failure(self, model: str, reason: str) -> None:
        self.failures.labels(model=model, reason=reason).inc()

    def success(self, model: str, seconds: float) -> None:
        self.successes.labels(model=model).inc()
        self.request_latency.labels(model=model).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class ModelObserver:
    """Implements the batcher's ``BatchObserver`` for one model label."""

    def __init__(self, metrics: ServerMetrics, model: str):
        self._queue = metrics.queue_time.labels(model=model)
        self._compute = metrics.compute_time.labels(model=model)
        self._rows = metrics.batch_size.labels(model=model)
        self._requests = metrics.batch_requests.labels(model=model)

    def on_batch(self, rows: int, requests: int, queue_seconds: list[float], compute_seconds: float) -> None:
        self._rows.observe(rows)
        self._requests.observe(requests)
        self._compute.observe(compute_seconds)
        for q in queue_seconds:
            self._queue.observe(q)


def histogram_counts(text: str, name: str, model: str | None = None) -> dict[str, float]:
    """Parse ``name_bucket`` lines of a /metrics page into ``{le: cumulative count}`` (for tests, tools)."""
    from prometheus_client.parser import text_string_to_metric_families

    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name != name + "_bucket":
                continue
            if model is not None and sample.labels.get("model") != model:
                continue
            le = sample.labels["le"]
            counts[le] = counts.get(le, 0.0) + sample.value
    return counts
