"""attnx's server on Ray Serve: every replica runs ``attnx serve``'s app, and its metrics go to Ray's.

>>> from ray import serve
>>> from attnx.deploy.ray import attnx_app
>>> serve.run(attnx_app({"minilm": "attnx-out/minilm-mha.onnx"}, num_replicas=2), route_prefix="/")

Each replica builds an :class:`attnx.runtime.InferenceServer` (the models, their batchers, the KServe
v2 / OpenAI / TEI / rerank routes) and Ray's proxy hands it HTTP requests through the server's ASGI
app; uvicorn and gRPC are not started in the replica. Keyword arguments other than Ray's are the replica's
:class:`~attnx.runtime.config.ServingConfig` (its fields by name: ``max_batch``, ``device``, ``threads``,
``api_key``, ...; or the layers' values ``batching``, ``limits``: ``ServingConfig.from_parts``).

Metrics. Ray's proxy sends ``GET /metrics`` to one replica or another, so a Prometheus scraping it
would see counters jump between replicas. Each replica therefore copies its attnx metrics into Ray's
own (:mod:`ray.serve.metrics`, tagged ``deployment``, ``replica``, ``application``) every
``metrics_interval_s``; Ray's metrics agent on each node exports them with Ray Serve's, at the port
Prometheus already scrapes for Ray (``ray_`` in front of each name). Counters keep their names
(``ray_attnx_request_success_total``), the queue depth is a gauge (``ray_attnx_queue_depth``), and
each histogram becomes counters of its buckets, count and sum (``ray_attnx_request_latency_seconds_bucket_total``
with ``le``), exact, so ``histogram_quantile`` over ``sum by (le)`` works across replicas.

What does not carry over behind Ray's proxy: gRPC (KServe v2 and TEI's ``tei.v1``; Ray Serve's gRPC
proxy takes only services registered with it), and attnx's HTTP connection limits (request head size
and count, idle heads, descriptors: ``attnx serve``'s uvicorn protocol), which are the proxy's business.
Request bodies, queue limits, timeouts per request and API keys are attnx's app's and still apply.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Mapping

#: Options of ``serve.deployment`` that :func:`attnx_app` passes on.
DEPLOYMENT_OPTIONS = ("num_replicas", "ray_actor_options", "max_ongoing_requests", "autoscaling_config",
                      "health_check_period_s", "graceful_shutdown_timeout_s", "name")


class RayMetrics:
    """Copies one replica's attnx metrics (a prometheus-client registry) into Ray Serve's metrics."""

    def __init__(self, registry):
        self.registry = registry
        self._metrics: dict[str, Any] = {}
        self._last: dict[tuple, float] = {}
        self._lock = threading.Lock()

    def _metric(self, kind: str, name: str, description: str, tag_keys: tuple[str, ...]):
        from ray.serve import metrics

        if name not in self._metrics:
            cls = metrics.Gauge if kind == "gauge" else metrics.Counter
            self._metrics[name] = cls(name, description=description or name, tag_keys=tag_keys)
        return self._metrics[name]

    def sync(self) -> None:
        """Add what each counter and histogram gained since the last call; set each gauge."""
        with self._lock:
            for family in self.registry.collect():
                if family.type not in ("counter", "gauge", "histogram") or not family.name.startswith("attnx_"):
                    continue  # process_* (Ray has its own) and the counters' _created samples
                for sample in family.samples:
                    if sample.name.endswith("_created"):
                        continue
                    name = sample.name[:-len("_total")] if family.type == "counter" else sample.name
                    tags = {k: str(v) for k, v in sample.labels.items()}
                    kind = "gauge" if family.type == "gauge" else "counter"
                    metric = self._metric(kind, name, family.documentation, tuple(sorted(tags)))
                    if kind == "gauge":
                        metric.set(float(sample.value), tags=tags)
                        continue
                    key = (name, tuple(sorted(tags.items())))
                    delta = float(sample.value) - self._last.get(key, 0.0)
                    if delta > 0:
                        metric.inc(delta, tags=tags)
                    self._last[key] = float(sample.value)


def _replica_class():
    from ray import serve

    @serve.ingress()
    class AttnxReplica:
        """One replica: an ``InferenceServer`` whose ASGI app Ray's proxy calls."""

        def __init__(self, models: Mapping[str, Any], server_options: dict, metrics_interval_s: float):
            from attnx.runtime import InferenceServer
            from attnx.runtime.config import ServingConfig

            self.server = InferenceServer(dict(models), ServingConfig.from_parts(port=0, **server_options))
            self.metrics = RayMetrics(self.server.metrics.registry)
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._copy_metrics, args=(metrics_interval_s,),
                                            name="attnx-ray-metrics", daemon=True)
            self._thread.start()

        def __serve_build_asgi_app__(self):
            return self.server.app

        def _copy_metrics(self, interval: float) -> None:
            while not self._stop.wait(interval):
                try:
                    self.metrics.sync()
                except Exception:  # noqa: BLE001 - metrics must never break serving
                    pass

        def __del__(self):
            self._stop.set()

    return AttnxReplica


def attnx_app(models: Mapping[str, str | os.PathLike], *, num_replicas: int | None = 1,
              metrics_interval_s: float = 5.0, **options: Any):
    """A Ray Serve application (``serve.run`` it) of ``models`` (``{name: model file}``, as ``attnx
    serve`` takes them) on ``num_replicas`` replicas. ``options``: :data:`DEPLOYMENT_OPTIONS` go to
    ``serve.deployment`` (default: one CPU per replica), the rest to each replica's serving config."""
    from ray import serve

    deployment = {k: options.pop(k) for k in DEPLOYMENT_OPTIONS if k in options}
    deployment.setdefault("name", "attnx")
    deployment.setdefault("ray_actor_options", {"num_cpus": 1})
    if num_replicas is not None:
        deployment["num_replicas"] = num_replicas
    files = {name: str(path) for name, path in models.items()}
    return serve.deployment(_replica_class(), **deployment).bind(files, options, metrics_interval_s)


def build_app(args: dict[str, str]):
    """``serve run attnx.deploy.ray:build_app models=minilm=attnx-out/minilm-mha.onnx,... replicas=2``."""
    models = dict(item.split("=", 1) for item in args["models"].split(",") if item)
    return attnx_app(models, num_replicas=int(args.get("replicas", 1)))
