"""The dynamic batcher: padding/masking, rows, limits, timeouts, draining — each caller gets its own result."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from attnx.runtime import (
    BatcherClosedError,
    BatcherConfig,
    DynamicBatcher,
    InputError,
    QueueFullError,
    RequestTimeoutError,
    load,
)
from attnx.runtime.core.layout import BatchLayout
from conftest_runtime import EXPORT_KW, GatedSession, assert_outputs_equal, request

PAD_ANYTHING = dict(max_length_ratio=None)


@pytest.fixture(scope="module")
def maw_session(exported):
    return load(exported("maw", **EXPORT_KW).path, device="cpu")


@pytest.fixture(scope="module")
def smal_session(exported):
    return load(exported("smal", **EXPORT_KW).path, device="cpu")


def submit_together(batcher, requests, **kwargs):
    """Submit from one thread (they all land in the queue before the window closes), then collect."""
    futures = [batcher.submit(r, **kwargs) for r in requests]
    return [f.result(timeout=60) for f in futures]


# --- layout: merge and split ------------------------------------------------------------


def test_merge_pads_with_zeros_and_split_cuts_back(maw_session):
    layout = BatchLayout.of(maw_session)
    assert layout.can_batch and layout.can_pad
    a = layout.prepare(maw_session.check_feeds(request(maw_session, rows=2, length=3, seed=1)))
    b = layout.prepare(maw_session.check_feeds(request(maw_session, rows=1, length=5, seed=2)))
    merged, longest = layout.merge([a, b])
    assert longest == 5
    assert merged["hidden_states"].shape == (3, 5, maw_session.input("hidden_states").shape[2])
    np.testing.assert_array_equal(merged["attention_mask"], [[1, 1, 1, 0, 0], [1, 1, 1, 0, 0], [1] * 5])
    np.testing.assert_array_equal(merged["hidden_states"][:2, :3], a.feeds["hidden_states"])
    assert not merged["hidden_states"][:2, 3:].any()
    fake_out = {"output": merged["hidden_states"] * 2, "maw_depth": np.array([7, 8, 9])}
    parts = layout.split(fake_out, [a, b])
    np.testing.assert_array_equal(parts[0]["output"], a.feeds["hidden_states"] * 2)
    np.testing.assert_array_equal(parts[1]["output"], b.feeds["hidden_states"] * 2)
    np.testing.assert_array_equal(parts[0]["maw_depth"], [7, 8])
    np.testing.assert_array_equal(parts[1]["maw_depth"], [9])


# --- batching is real and exact ----------------------------------------------------------


@pytest.mark.parametrize("variant", ["maw", "smal"])
def test_variable_lengths_share_one_batch_and_each_caller_gets_its_own_result(variant, maw_session, smal_session):
    session = maw_session if variant == "maw" else smal_session
    lengths = [3, 17, 9, 40, 1, 26]
    requests = [request(session, rows=1 + i % 2, length=L, seed=100 + i) for i, L in enumerate(lengths)]
    alone = [session.run(r) for r in requests]
    config = BatcherConfig(max_batch_size=32, max_queue_delay_ms=200, **PAD_ANYTHING)
    with DynamicBatcher(session, config) as batcher:
        results = submit_together(batcher, requests)
        assert batcher.stats.batches == 1
        assert batcher.stats.largest_batch == sum(1 + i % 2 for i in range(len(lengths)))
    for got, want, L in zip(results, alone, lengths):
        assert got["output"].shape[1] == L  # un-padded
        assert_outputs_equal(got, want, atol=1e-5)


def test_omitted_mask_batches_with_explicit_masks(maw_session):
    explicit = request(maw_session, rows=1, length=12, seed=1)
    implicit = request(maw_session, rows=1, length=5, seed=2, with_mask=False)
    want = [maw_session.run(explicit), maw_session.run(implicit)]
    with DynamicBatcher(maw_session, BatcherConfig(max_queue_delay_ms=200, **PAD_ANYTHING)) as batcher:
        got = submit_together(batcher, [explicit, implicit])
        assert batcher.stats.batches == 1
    for g, w in zip(got, want):
        assert_outputs_equal(g, w)


def test_max_batch_size_counts_rows(maw_session):
    requests = [request(maw_session, rows=2, length=6, seed=i) for i in range(5)]
    alone = [maw_session.run(r) for r in requests]
    with DynamicBatcher(maw_session, BatcherConfig(max_batch_size=4, max_queue_delay_ms=100)) as batcher:
        got = submit_together(batcher, requests)
        assert batcher.stats.largest_batch == 4
        assert set(batcher.stats.batch_sizes) <= {2, 4}
        assert batcher.stats.rows == 10
        with pytest.raises(InputError, match="more than the max batch size"):
            batcher.submit(request(maw_session, rows=5, length=3, seed=9))
    for g, w in zip(got, alone):
        assert_outputs_equal(g, w)


def test_length_ratio_and_token_cap_keep_far_lengths_apart(maw_session):
    requests = [request(maw_session, rows=1, length=L, seed=L) for L in (16, 64, 60, 15)]
    with DynamicBatcher(maw_session, BatcherConfig(max_queue_delay_ms=200, max_length_ratio=1.5)) as batcher:
        got = submit_together(batcher, requests)
        assert sorted(batcher.stats.batch_sizes.items()) == [(2, 2)]  # {16, 15} and {64, 60}
    for g, r in zip(got, requests):
        assert_outputs_equal(g, maw_session.run(r))
    config = BatcherConfig(max_queue_delay_ms=200, max_length_ratio=None, max_batch_tokens=64)
    with DynamicBatcher(maw_session, config) as batcher:
        submit_together(batcher, [request(maw_session, rows=1, length=16, seed=i) for i in range(6)])
        assert batcher.stats.largest_batch == 4  # 4 x 16 tokens fill the cap


def test_inputs_of_one_request_must_agree_on_rows(smal_session):
    feeds = request(smal_session, rows=2, length=4, seed=1)
    feeds["self_state"] = feeds["self_state"][:1]
    with DynamicBatcher(smal_session) as batcher, pytest.raises(InputError, match="disagrees"):
        batcher.submit(feeds)


# --- limits -----------------------------------------------------------------------------


def test_full_queue_refuses_at_once_and_queued_requests_still_complete(maw_session):
    gated = GatedSession(maw_session)
    config = BatcherConfig(max_batch_size=1, max_queue_size=3, max_queue_delay_ms=0)
    requests = [request(maw_session, rows=1, length=4 + i, seed=i) for i in range(5)]
    with DynamicBatcher(gated, config) as batcher:
        first = batcher.submit(requests[0])
        assert gated.running.acquire(timeout=10)  # the worker is inside the first run
        queued = [batcher.submit(r) for r in requests[1:4]]
        started = time.perf_counter()
        with pytest.raises(QueueFullError, match="queue full"):
            batcher.submit(requests[4])
        assert time.perf_counter() - started < 0.1  # refused now, not after waiting
        assert batcher.stats.rejected_full == 1
        gated.gate.set()
        for fut, r in zip([first, *queued], requests):
            assert_outputs_equal(fut.result(timeout=30), maw_session.run(r))


def test_request_that_waits_past_its_timeout_fails_and_others_are_unaffected(maw_session):
    gated = GatedSession(maw_session)
    config = BatcherConfig(max_batch_size=1, max_queue_delay_ms=0, timeout_ms=5000)
    a, b = request(maw_session, rows=1, length=5, seed=1), request(maw_session, rows=1, length=6, seed=2)
    with DynamicBatcher(gated, config) as batcher:
        fa = batcher.submit(a)
        assert gated.running.acquire(timeout=10)
        fb = batcher.submit(b, timeout_ms=50)  # the caller's own, shorter timeout
        time.sleep(0.2)
        gated.gate.set()
        assert_outputs_equal(fa.result(timeout=30), maw_session.run(a))
        with pytest.raises(RequestTimeoutError, match="timed out"):
            fb.result(timeout=30)
        assert batcher.stats.timed_out == 1
        assert_outputs_equal(batcher.infer(b), maw_session.run(b))  # the batcher still works


def test_a_failed_batch_is_retried_alone_so_a_transient_failure_loses_nothing(maw_session):
    gated = GatedSession(maw_session)
    gated.fail_next = RuntimeError("device lost")
    requests = [request(maw_session, rows=1, length=5 + i, seed=i) for i in range(3)]
    with DynamicBatcher(gated, BatcherConfig(max_queue_delay_ms=200, **PAD_ANYTHING)) as batcher:
        futures = [batcher.submit(r) for r in requests]
        gated.gate.set()
        for f, r in zip(futures, requests):
            assert_outputs_equal(f.result(timeout=30), maw_session.run(r))
        assert gated.runs == 1 + len(requests) and batcher.stats.failed == 0


def test_a_persistent_model_failure_reaches_every_caller_and_the_worker_survives(maw_session):
    gated = GatedSession(maw_session)
    requests = [request(maw_session, rows=1, length=5 + i, seed=i) for i in range(3)]
    broken = [True]
    original = gated._run

    def run(feeds, names):
        if broken[0]:
            gated.runs += 1
            raise RuntimeError("device lost")
        return original(feeds, names)

    gated._run = run
    gated.gate.set()
    with DynamicBatcher(gated, BatcherConfig(max_queue_delay_ms=200, **PAD_ANYTHING)) as batcher:
        futures = [batcher.submit(r) for r in requests]
        for f in futures:
            with pytest.raises(RuntimeError, match="device lost"):
                f.result(timeout=30)
        assert batcher.stats.failed == 3
        broken[0] = False
        assert_outputs_equal(batcher.infer(requests[0]), maw_session.run(requests[0]))


def test_close_drains_queued_requests_then_refuses(maw_session):
    gated = GatedSession(maw_session)
    requests = [request(maw_session, rows=1, length=3 + i, seed=i) for i in range(4)]
    batcher = DynamicBatcher(gated, BatcherConfig(max_batch_size=1, max_queue_delay_ms=0))
    futures = [batcher.submit(r) for r in requests]
    closer = threading.Thread(target=batcher.close)
    closer.start()
    time.sleep(0.1)
    assert closer.is_alive()  # waiting for the queue to drain
    with pytest.raises(BatcherClosedError):
        batcher.submit(requests[0])
    gated.gate.set()
    closer.join(30)
    assert not closer.is_alive()
    for f, r in zip(futures, requests):
        assert_outputs_equal(f.result(timeout=1), maw_session.run(r))


def test_close_without_drain_fails_queued_requests(maw_session):
    gated = GatedSession(maw_session)
    batcher = DynamicBatcher(gated, BatcherConfig(max_batch_size=1, max_queue_delay_ms=0))
    first = batcher.submit(request(maw_session, rows=1, length=3, seed=1))
    assert gated.running.acquire(timeout=10)
    queued = batcher.submit(request(maw_session, rows=1, length=4, seed=2))
    threading.Timer(0.1, gated.gate.set).start()
    batcher.close(drain=False)
    assert first.result(timeout=30)["output"].shape[1] == 3  # the running batch completes
    with pytest.raises(BatcherClosedError):
        queued.result(timeout=1)


def test_cancelled_request_is_skipped(maw_session):
    gated = GatedSession(maw_session)
    with DynamicBatcher(gated, BatcherConfig(max_batch_size=1, max_queue_delay_ms=0)) as batcher:
        batcher.submit(request(maw_session, rows=1, length=3, seed=1))
        assert gated.running.acquire(timeout=10)
        doomed = batcher.submit(request(maw_session, rows=1, length=4, seed=2))
        kept_feeds = request(maw_session, rows=1, length=5, seed=3)
        kept = batcher.submit(kept_feeds)
        assert doomed.cancel()
        gated.gate.set()
        assert_outputs_equal(kept.result(timeout=30), maw_session.run(kept_feeds))
    assert gated.runs == 2


def test_async_callers_on_one_event_loop_are_batched(maw_session):
    requests = [request(maw_session, rows=1, length=4 + 5 * i, seed=i) for i in range(6)]

    async def main(batcher):
        return await asyncio.gather(*(batcher.infer_async(r) for r in requests))

    with DynamicBatcher(maw_session, BatcherConfig(max_queue_delay_ms=200, **PAD_ANYTHING)) as batcher:
        results = asyncio.run(main(batcher))
        assert batcher.stats.batches == 1
    for g, r in zip(results, requests):
        assert_outputs_equal(g, maw_session.run(r))


def test_many_threads_under_load_get_exactly_their_results(maw_session):
    pool = [request(maw_session, rows=1 + i % 2, length=[8, 16, 24, 32][i % 4], seed=i) for i in range(16)]
    expected = [maw_session.run(r) for r in pool]
    errors: list = []
    counts = [0] * 24

    def client(k: int) -> None:
        deadline = time.monotonic() + 3
        i = k
        while time.monotonic() < deadline and counts[k] < 40:
            got = batcher.infer(pool[i % len(pool)])
            try:
                assert_outputs_equal(got, expected[i % len(pool)])
            except AssertionError as e:
                errors.append(e)
            counts[k] += 1
            i += 7

    with DynamicBatcher(maw_session, BatcherConfig(max_batch_size=16, max_queue_delay_ms=2)) as batcher:
        threads = [threading.Thread(target=client, args=(k,)) for k in range(24)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert batcher.stats.largest_batch > 1
        assert batcher.stats.requests == sum(counts)
    assert not errors, errors[:3]
    assert sum(counts) > 24
