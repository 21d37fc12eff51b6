"""A request that cannot start before its queue deadline is refused at once (issue 26, item 12): 8 MB of
text over gRPC waited 34 s in the queue and ended DEADLINE_EXCEEDED; now it is RESOURCE_EXHAUSTED (413
over HTTP) as soon as the model's own pace shows it cannot fit, without running it. Here the deadline is
5 s, the 600 texts are 19 batches of 32 and one batch must fit in the deadline (a cold model runs a few rows to
learn its pace), so the verdicts hold from a quiet machine to a loaded one."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from attnx.runtime import BatcherConfig
from attnx.runtime.core.pacing import PROBE_TOKENS, Pace
from conftest_runtime import long_text, running_server
from support import exports

#: 600 texts of ~2,000 words: each is cut to 256 tokens; together ~150k tokens, ~8 MB of text.
BIG = [long_text(2000, seed=i % 7) + f" {i}" for i in range(600)]


@pytest.fixture(scope="module")
def minilm(tmp_path_factory):
    return exports.minilm().path


def serve(minilm):
    return running_server({"m": minilm}, grpc_port=0,
                          batching=BatcherConfig(max_batch_size=32, max_queue_delay_ms=5, timeout_ms=5000))


def grpc_text(server, texts):
    client = grpcclient.InferenceServerClient(server.grpc_address)
    item = grpcclient.InferInput("text", [len(texts)], "BYTES")
    item.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=object))
    try:
        return client.infer("m", [item], outputs=[grpcclient.InferRequestedOutput("sentence_embedding")])
    finally:
        client.close()


def test_a_warm_model_refuses_what_cannot_start_in_time_before_running_any_of_it(minilm):
    with serve(minilm) as srv:
        batcher = srv.models["m"].batcher
        grpc_text(srv, BIG[:32])  # one batch of long texts: the pace at this length is known
        before = batcher.stats.requests
        with pytest.raises(Exception) as info:
            grpc_text(srv, BIG)
        assert "RESOURCE_EXHAUSTED" in str(info.value.status()), info.value
        message = info.value.message()
        assert "s of compute" in message and "5 s a request may wait" in message and "\n" not in message
        assert batcher.stats.requests == before  # nothing of it was queued
        r = httpx.post(f"{srv.url}/v2/models/m/infer", timeout=120, json={
            "inputs": [{"name": "text", "datatype": "BYTES", "shape": [len(BIG)], "data": BIG}]})
        assert r.status_code == 413 and "s of compute" in r.json()["error"], r.text[:300]
        assert batcher.stats.requests == before
        small = grpc_text(srv, BIG[:4]).as_numpy("sentence_embedding")  # what fits is served as ever
        assert small.shape == (4, 384)


def test_a_cold_model_runs_a_few_rows_to_learn_its_pace_then_refuses_the_rest(minilm):
    with serve(minilm) as srv:
        batcher = srv.models["m"].batcher
        with pytest.raises(Exception) as info:
            grpc_text(srv, BIG)
        assert "RESOURCE_EXHAUSTED" in str(info.value.status()), info.value
        # the probe (issue 45: PROBE_TOKENS of the 256-token rows, not a whole batch), and nothing after it
        assert batcher.stats.requests == PROBE_TOKENS // 256 == 2


def test_work_queued_ahead_makes_a_request_that_cannot_start_in_time_a_503():
    class Batcher:  # what pacing reads of a batcher
        config = BatcherConfig(max_batch_size=8, timeout_ms=1000)
        pace = Pace()
        name = "m"

        @staticmethod
        def queued_parts():
            return [(1, 100)] * 50  # 5,000 tokens ahead

    from attnx.runtime.core import pacing
    from attnx.runtime.wire.errors import Kind, ProtocolError

    Batcher.pace.observe(8, 100, 0.8)  # 1,000 tokens/s at this length
    Batcher.queued_parts = staticmethod(lambda: [(1, 100)] * 5)  # 0.5 s ahead: fits
    assert pacing.check(Batcher, [(1, 100)], None) is True
    Batcher.queued_parts = staticmethod(lambda: [(1, 100)] * 50)  # 5 s ahead
    with pytest.raises(ProtocolError, match="queued ahead") as info:
        pacing.check(Batcher, [(1, 100)], None)
    assert info.value.kind == Kind.OVERLOADED  # a retry may fit
    with pytest.raises(ProtocolError, match="s of compute") as info:
        pacing.check(Batcher, [(1, 100)] * 40, None)  # 4 s of its own
    assert info.value.kind == Kind.TOO_LARGE  # no retry helps
    assert pacing.check(Batcher, [(1, 1000)], None) is False  # never seen that long: unknown
