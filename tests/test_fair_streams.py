"""Issue 45: one client's many rows cannot starve another's one row. The batcher lets sources take turns (a
neighbour's row anchors the very next batch, whatever is queued), and a tei.v1 ``EmbedStream`` is one source with
a window on its bytes in flight, so a small ``/v1/embeddings`` beside a stream of long texts is answered while the
stream is still running, and the stream still gives every answer, in order. Counted in answers, not seconds."""

from __future__ import annotations

import importlib
import shutil
import sys
import threading

import grpc
import httpx
import numpy as np
import pytest

from attnx.runtime import BatcherConfig, DynamicBatcher, load
from attnx.runtime.core.batcher import SOURCE
from conftest_runtime import EXPORT_KW, GatedSession, assert_outputs_equal, long_text, request, running_server
from support import exports


@pytest.fixture(scope="module")
def maw_session(exported):
    return load(exported("maw", **EXPORT_KW).path, device="cpu")


def test_a_neighbours_row_anchors_the_next_batch_ahead_of_a_sources_queue(maw_session):
    gated = GatedSession(maw_session)
    done: list[str] = []
    config = BatcherConfig(max_batch_size=4, max_queue_delay_ms=0)
    with DynamicBatcher(gated, config) as batcher:
        stream, neighbour = object(), object()
        token = SOURCE.set(stream)
        try:
            first = batcher.submit(request(maw_session, rows=1, length=8, seed=0))
            assert gated.running.acquire(timeout=30)  # the worker is inside the stream's first run
            rows = [batcher.submit(request(maw_session, rows=1, length=8, seed=i)) for i in range(1, 13)]
        finally:
            SOURCE.reset(token)
        token = SOURCE.set(neighbour)
        try:
            mine = batcher.submit(request(maw_session, rows=1, length=8, seed=99))
        finally:
            SOURCE.reset(token)
        for name, fut in [("stream", f) for f in [first, *rows]] + [("neighbour", mine)]:
            fut.add_done_callback(lambda _, n=name: done.append(n))
        gated.gate.set()
        for fut in [first, *rows, mine]:
            fut.result(timeout=60)
    # the run going when it came, then its own batch (which up to 3 of the stream's rows may join): before, the
    # oldest went first and the neighbour's row came after all 13 of the stream's
    assert done.index("neighbour") <= 1 + 3, done
    assert len(done) == 14


def test_a_batch_built_around_a_later_request_takes_each_request_once(maw_session):
    """The anchor is not the oldest here, and everything queued fits in its batch: each request is in it once and
    every caller gets its own rows (a request taken twice killed the worker)."""
    gated = GatedSession(maw_session)
    feeds = [request(maw_session, rows=1, length=6 + i % 3, seed=i) for i in range(6)]
    with DynamicBatcher(gated, BatcherConfig(max_batch_size=32, max_queue_delay_ms=0)) as batcher:
        futures = []
        for i, f in enumerate(feeds):
            token = SOURCE.set("stream" if i < 5 else "neighbour")
            try:
                futures.append(batcher.submit(f))
            finally:
                SOURCE.reset(token)
            if i == 0:
                assert gated.running.acquire(timeout=30)
        gated.gate.set()
        for fut, f in zip(futures, feeds):
            assert_outputs_equal(fut.result(timeout=60), maw_session.run(f))
        assert batcher.stats.batches == 2 and batcher.stats.rows == 6


def test_one_source_is_served_oldest_first_as_before(maw_session):
    gated = GatedSession(maw_session)
    order: list[int] = []
    with DynamicBatcher(gated, BatcherConfig(max_batch_size=1, max_queue_delay_ms=0)) as batcher:
        futures = [batcher.submit(request(maw_session, rows=1, length=4 + i, seed=i)) for i in range(6)]
        for i, fut in enumerate(futures):
            fut.add_done_callback(lambda _, i=i: order.append(i))
        gated.gate.set()
        for fut in futures:
            fut.result(timeout=60)
    assert order == list(range(6))


@pytest.fixture(scope="module")
def stubs(tmp_path_factory):
    from grpc_tools import protoc

    from attnx.runtime.apis.tei_grpc import PROTO

    out = tmp_path_factory.mktemp("tei-stubs-fair")
    shutil.copyfile(PROTO, out / "tei.proto")
    assert protoc.main(["protoc", f"-I{out}", f"--python_out={out}", f"--grpc_python_out={out}", "tei.proto"]) == 0
    sys.path.insert(0, str(out))
    try:
        return importlib.import_module("tei_pb2"), importlib.import_module("tei_pb2_grpc")
    finally:
        sys.path.remove(str(out))


def test_a_stream_of_long_texts_does_not_starve_a_neighbour_and_still_completes(stubs):
    pb, rpc = stubs
    texts = [long_text(2000, seed=i % 3) for i in range(24)]  # ~12 KB each: cut to 256 tokens
    with running_server({"minilm": exports.minilm().path}, grpc_port=0) as server, \
            grpc.insecure_channel(server.grpc_address) as channel:
        embed = rpc.EmbedStub(channel)
        alone = [np.array(embed.Embed(pb.EmbedRequest(inputs=t, truncate=True)).embeddings, np.float32)
                 for t in texts[:3]]
        received, at_neighbour, answers = [], [], []

        def neighbour():
            r = httpx.post(f"{server.url}/v1/embeddings", json={"model": "minilm", "input": "a tiny neighbour"},
                           timeout=120)
            answers.append(r.status_code)
            at_neighbour.append(len(received))

        sender = threading.Thread(target=neighbour)
        for answer in embed.EmbedStream(iter(pb.EmbedRequest(inputs=t, truncate=True) for t in texts),
                                      timeout=600):
            received.append(np.array(answer.embeddings, np.float32))
            if len(received) == 2:
                sender.start()  # the stream is running: all its messages sent, 22 answers still to come
        sender.join(120)
    assert answers == [200]
    # answered with the stream in flight: after the row then running and at most a few more; before, the 64-message
    # window put every one of the 22 left ahead of it
    assert at_neighbour[0] <= 2 + 4, at_neighbour
    assert len(received) == len(texts)
    for i, got in enumerate(received):
        np.testing.assert_allclose(got, alone[i % 3], atol=1e-5)
