"""attnx on Ray Serve (:mod:`attnx.deploy.ray`): the real all-MiniLM-L6-v2 on two replicas behind Ray's proxy.

One local Ray cluster for the module, kept on loopback and offline: ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``
makes every Ray process take 127.0.0.1 as its node address (Ray's local-only mode; without it the
agents take the machine's outward address even with ``_node_ip_address``), the proxy listens on
127.0.0.1, and ``RAY_USAGE_STATS_ENABLED=0`` stops Ray's usage report. The unmodified openai client gets
sentence-transformers' embeddings through Ray's proxy, and the replicas' attnx metrics add up in
Ray's metrics export, per replica.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import urllib.request

import numpy as np
import pytest


TEXTS = ["A man is eating food.", "A man is riding a white horse on an enclosed ground.",
         "Das ist ein Satz, und noch einer."]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_cluster():
    settings = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0",
                "RAY_metrics_report_interval_ms": "1000"}
    before = {key: os.environ.get(key) for key in settings}
    os.environ.update(settings)  # read by ray.init and inherited by the processes it starts
    import ray
    from ray import serve

    metrics_port, http_port = free_port(), free_port()
    ray.init(num_cpus=2, include_dashboard=False, _metrics_export_port=metrics_port, configure_logging=False,
             log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": http_port})
        yield {"http": f"http://127.0.0.1:{http_port}", "metrics": f"http://127.0.0.1:{metrics_port}/metrics"}
    finally:
        serve.shutdown()
        ray.shutdown()
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture(scope="module")
def served(ray_cluster, minilm_export):
    from ray import serve

    from attnx.deploy.ray import attnx_app

    app = attnx_app({"minilm": minilm_export("mha").path}, num_replicas=2, metrics_interval_s=0.5,
                    ray_actor_options={"num_cpus": 0.5})
    serve.run(app, name="attnx", route_prefix="/", blocking=False)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        status = serve.status().applications.get("attnx")
        if status is not None and status.status == "RUNNING":
            break
        if status is not None and status.status in ("DEPLOY_FAILED", "UNHEALTHY"):
            pytest.fail(f"the Ray Serve application failed: {status.message}")
        time.sleep(1)
    else:
        pytest.fail("the Ray Serve application did not start in 300 s")
    return ray_cluster


def test_two_replicas_answer_the_openai_client_with_sentence_transformers_embeddings(served, st_minilm):
    from openai import OpenAI
    from ray import serve
    replicas = serve.status().applications["attnx"].deployments["attnx"].replica_states
    assert replicas.get("RUNNING") == 2
    client = OpenAI(base_url=f"{served['http']}/v1", api_key="unused", max_retries=0)
    reference = st_minilm.encode(TEXTS, normalize_embeddings=True)
    answers, errors = [None] * 16, []

    def call(i):
        try:
            answers[i] = client.embeddings.create(model="minilm", input=TEXTS)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(answers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    for answer in answers:
        got = np.array([d.embedding for d in answer.data], dtype=np.float32)
        cos = (got * reference).sum(axis=1) / np.linalg.norm(got, axis=1) / np.linalg.norm(reference, axis=1)
        assert cos.min() >= 0.9999 and np.abs(got - reference).max() <= 1e-5

    # Each replica's attnx counters reach Ray's metrics export, tagged with the replica: they add up.
    deadline, counts = time.monotonic() + 90, {}
    while time.monotonic() < deadline:
        counts = _successes(served["metrics"])
        if sum(counts.values()) >= len(answers):
            break
        time.sleep(1)
    assert sum(counts.values()) == len(answers) and len(counts) == 2, counts


def _successes(url: str) -> dict[str, float]:
    """``{replica: ray_attnx_request_success_total}`` of the minilm model, from Ray's metrics export."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "ray_attnx_request_success_total" and sample.labels.get("model") == "minilm":
                assert sample.labels["deployment"] == "attnx" and sample.labels["application"] == "attnx"
                counts[sample.labels["replica"]] = counts.get(sample.labels["replica"], 0.0) + sample.value
    return counts
