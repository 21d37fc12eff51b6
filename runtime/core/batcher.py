"""Dynamic batching: many concurrent requests -> one padded, masked batch -> each caller's own result.

Triton's dynamic batcher only groups requests whose shapes already match; ours pads. Requests of different sequence
lengths are padded to the longest one in the batch (the ``attention_mask`` with 0 = padding, token ids with the pad
id, every other ``seq`` input with 0), concatenated along ``batch``, run once, and the outputs are split back by rows
and sliced back to each request's own length. Because padded keys are masked, a request's result equals running it
alone (up to float summation order).

Rules, all derived from the model's batch and seq axes (:mod:`attnx.runtime.core.axes` finds them):

- Requests batch together only when every non-batch, non-seq dim matches (their "batch key"). Inputs with a ``seq``
  axis are padded only when the model has a mask input; without one, requests also need equal lengths.
- If any input or output lacks a ``batch`` axis, requests never share a run.
- Lengths in one batch stay within ``max_length_ratio`` (longest/shortest, default 1.5) because padding costs compute;
  ``None`` pads anything. ``max_batch_tokens`` optionally caps rows x padded length.
- Sources take turns (issue 45): the next batch is built around the oldest request of the source served longest
  ago (a source is an asyncio task, i.e. one HTTP or gRPC request, a gRPC stream as a whole (:data:`SOURCE`), or a
  thread), so a client's hundreds of queued rows hold a neighbour's one row back by the batch running at most, and
  every source is served in turn (no starvation). With one source, that is the oldest request, as before.
- ``max_batch_size`` counts rows: a request may carry several rows itself, but never more than ``max_batch_size``.
- Queue limit: ``submit`` refuses at once (:class:`QueueFullError`) when ``max_queue_size`` requests are waiting;
  nothing queues forever.
- Per-request timeout: a request never starts after its deadline; it fails with :class:`RequestTimeoutError` when the
  worker next forms a batch (so a caller may hear it only after the batch running then). Once in a batch it completes.
- A request may omit ``attention_mask``: all ones for its length.
- Inputs are checked (names, dtypes, dims, id ranges) before they join a batch. If a merged batch still fails, each of
  its requests is run alone, so only the culprit fails; a runtime's refusal of one request's inputs is an
  :class:`InputError`.

One worker thread per batcher pulls from the queue, so the model runs one batch at a time and callers (threads or an
asyncio loop) never block on compute.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import math
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol

import numpy as np

from attnx.runtime.core.errors import Kind, Refusal
from attnx.runtime.core.layout import BatchLayout, Prepared
from attnx.runtime.core.pacing import Pace
from attnx.runtime.core.session import InputError, Session, model_input_error


#: Who a request comes from, where one caller's requests span tasks (a gRPC stream's messages run as tasks of
#: their own): set it, and :meth:`DynamicBatcher.submit` counts them as one source. Unset: the current asyncio task,
#: else the thread.
SOURCE: contextvars.ContextVar[object | None] = contextvars.ContextVar("attnx_batch_source", default=None)
#: Sources whose last turn is remembered (the least recently served are forgotten first: they count as new).
_SOURCES_REMEMBERED = 1024


def current_source() -> int:
    """The key of the caller :data:`SOURCE` names, else of its asyncio task, else of its thread."""
    found = SOURCE.get()
    if found is None:
        try:
            found = asyncio.current_task()
        except RuntimeError:  # no running loop: a thread of its own
            found = None
    return id(found) if found is not None else threading.get_ident()


class QueueFullError(Refusal, RuntimeError):
    """The queue already holds ``max_queue_size`` requests (HTTP 503)."""

    kind = Kind.OVERLOADED


class RequestTimeoutError(Refusal, TimeoutError):
    """The request waited past its deadline before a batch took it (HTTP 503)."""

    kind = Kind.TIMEOUT


class BatcherClosedError(Refusal, RuntimeError):
    """The batcher is shutting down and takes no new requests (HTTP 503)."""

    kind = Kind.SHUTTING_DOWN


@dataclass
class BatcherConfig:
    """Batching limits. ``timeout_ms=None`` waits as long as it takes.

    ``max_length_ratio``: the longest sequence in a batch is at most this many times the shortest (None: pad anything
    to anything). Padding is paid for in compute: on a CPU a batch costs about its padded tokens, so padding 16-token
    requests to 128 costs more than batching saves; requests of very different lengths therefore go in separate
    batches (each source's oldest request gets its turn: module doc).

    ``max_batch_tokens``: cap on rows x padded length per batch (None: no cap). On a CPU, long sequences are already
    compute-bound one at a time, and big padded batches only thrash the caches; the cap keeps batching for the short
    ones.
    """

    max_batch_size: int = 32
    max_queue_delay_ms: float = 2.0
    max_queue_size: int = 1024
    timeout_ms: float | None = 30_000.0
    max_length_ratio: float | None = 1.5
    max_batch_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        if self.max_queue_delay_ms < 0:
            raise ValueError("max_queue_delay_ms must be >= 0")
        if self.max_queue_size < 1:
            raise ValueError("max_queue_size must be >= 1")
        if self.timeout_ms is not None and self.timeout_ms <= 0:
            raise ValueError("timeout_ms must be > 0 (or None)")
        if self.max_length_ratio is not None and self.max_length_ratio < 1:
            raise ValueError("max_length_ratio must be >= 1 (or None)")
        if self.max_batch_tokens is not None and self.max_batch_tokens < 1:
            raise ValueError("max_batch_tokens must be >= 1 (or None)")


class BatchObserver(Protocol):
    """Receives one call per batch run (the metrics implement it)."""

    def on_batch(self, rows: int, requests: int, queue_seconds: list[float], compute_seconds: float) -> None: ...


# --------------------------------------------------------------------------------------
# The batcher
# --------------------------------------------------------------------------------------


@dataclass(eq=False)
class _Request:
    prepared: Prepared
    future: concurrent.futures.Future
    output_names: list[str] | None
    enqueued: float
    deadline: float | None
    source: int = 0

    @property
    def length(self) -> int:  # of a request to a model with a seq axis (the layout gives all its requests one)
        assert self.prepared.length is not None, "a request without a length beside requests with one"
        return self.prepared.length


@dataclass
class BatcherStats:
    """Running totals (cheap to read; the Prometheus metrics have the distributions)."""

    requests: int = 0
    batches: int = 0
    rows: int = 0
    rejected_full: int = 0
    timed_out: int = 0
    failed: int = 0
    largest_batch: int = 0
    batch_sizes: dict[int, int] = field(default_factory=dict)

    @property
    def mean_batch_rows(self) -> float:
        return self.rows / self.batches if self.batches else 0.0


class DynamicBatcher:
    """Collects concurrent requests for one session into padded batches, runs them on a worker thread.

    >>> batcher = DynamicBatcher(session, BatcherConfig(max_batch_size=32, max_queue_delay_ms=2))
    >>> outputs = batcher.infer({"hidden_states": x})           # blocking, from any thread
    >>> outputs = await batcher.infer_async({"hidden_states": x})  # from an event loop
    >>> batcher.close()                                          # drains what is queued
    """

    def __init__(
        self,
        session: Session,
        config: BatcherConfig | None = None,
        *,
        observer: BatchObserver | None = None,
        name: str | None = None,
        pad_id: int | None = None,
    ):
        self.session = session
        self.config = config or BatcherConfig()
        self.observer = observer
        self.name = name or session.path.stem
        if pad_id is None and session.info is not None and session.info.tokenizer is not None:
            pad_id = session.info.tokenizer.pad_id
        self.layout = BatchLayout.of(session, pad_id)
        self.stats = BatcherStats()
        self.pace = Pace()  # the best rate seen, for admission by work (attnx.runtime.core.pacing)
        self._waiting: deque[_Request] = deque()
        self._turns: OrderedDict[int, int] = OrderedDict()  # source -> the number of the batch it was last in
        self._batch_number = 0
        self._cond = threading.Condition()
        self._closed = False
        self._worker = threading.Thread(target=self._work, name=f"attnx-batcher-{self.name}", daemon=True)
        self._worker.start()

    # --- callers -------------------------------------------------------------
    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    def queued_parts(self) -> list[tuple[int, int]]:
        """``(rows, length)`` of each waiting request: the work queued ahead of a new one."""
        with self._cond:
            return [(r.prepared.rows, r.prepared.length or 1) for r in self._waiting]

    def submit(
        self,
        feeds: Mapping[str, Any],
        *,
        output_names: list[str] | None = None,
        timeout_ms: float | None = None,
    ) -> concurrent.futures.Future:
        """Queue one request; returns a future of its outputs.

        Raises :class:`InputError` (bad feeds), :class:`QueueFullError` (queue at its limit: refused now, not queued)
        or :class:`BatcherClosedError`. ``timeout_ms`` can only shorten the configured timeout.
        """
        checked = self.session.check_feeds(feeds)
        prepared = self.layout.prepare(checked)
        if prepared.rows > self.config.max_batch_size:
            raise InputError(
                f"request has {prepared.rows} rows, more than the max batch size {self.config.max_batch_size}"
            )
        if output_names is not None:
            unknown = [n for n in output_names if n not in self.session.output_names]
            if unknown:
                raise InputError(f"unknown output(s) {unknown}; the model gives {self.session.output_names}")
        now = time.perf_counter()
        limits = [t for t in (self.config.timeout_ms, timeout_ms) if t is not None]
        deadline = now + min(limits) / 1000.0 if limits else None
        request = _Request(prepared, concurrent.futures.Future(), output_names, now, deadline, current_source())
        with self._cond:
            if self._closed:
                raise BatcherClosedError(f"model {self.name!r} is shutting down")
            if len(self._waiting) >= self.config.max_queue_size:
                self.stats.rejected_full += 1
                raise QueueFullError(
                    f"model {self.name!r}: queue full ({self.config.max_queue_size} requests waiting)"
                )
            self._waiting.append(request)
            self.stats.requests += 1
            self._cond.notify()
        return request.future

    def infer(self, feeds: Mapping[str, Any], **kwargs: Any) -> dict[str, np.ndarray]:
        """Submit and wait (blocking)."""
        return self.submit(feeds, **kwargs).result()

    async def infer_async(self, feeds: Mapping[str, Any], **kwargs: Any) -> dict[str, np.ndarray]:
        """Submit and await without blocking the event loop."""
        return await asyncio.wrap_future(self.submit(feeds, **kwargs))

    def close(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop taking requests; with ``drain`` finish the queued ones, else fail them."""
        with self._cond:
            self._closed = True
            if not drain:
                while self._waiting:
                    req = self._waiting.popleft()
                    if req.future.set_running_or_notify_cancel():
                        req.future.set_exception(BatcherClosedError(f"model {self.name!r} shut down"))
            self._cond.notify_all()
        if threading.current_thread() is not self._worker:
            self._worker.join(timeout)

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "DynamicBatcher":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # --- worker --------------------------------------------------------------
    def _work(self) -> None:
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            if batch:
                self._run(batch)

    def _next_batch(self) -> list[_Request] | None:
        """Wait for requests, then take the next batch (:meth:`_take`; None = shut down)."""
        cfg = self.config
        with self._cond:
            while not self._waiting:
                if self._closed:
                    return None
                self._cond.wait()
            oldest = self._waiting[0]
            # The delay window counts from the oldest request's arrival: a request that
            # already waited behind a running batch is not made to wait again.
            window_end = oldest.enqueued + cfg.max_queue_delay_ms / 1000.0
            if self.layout.can_batch:
                while not self._closed:
                    if self._compatible_rows(oldest) >= cfg.max_batch_size:
                        break
                    remaining = window_end - time.perf_counter()
                    if remaining <= 0:
                        break
                    self._cond.wait(remaining)
            return self._take(oldest)

    def _joins(self, anchor: _Request, req: _Request) -> bool:
        """Could ``req`` share a batch with ``anchor`` (same key, lengths within the ratio)?"""
        if req.prepared.key != anchor.prepared.key:
            return False
        ratio, a, b = self.config.max_length_ratio, anchor.prepared.length, req.prepared.length
        return ratio is None or a is None or b is None or max(a, b) <= ratio * min(a, b)

    def _compatible_rows(self, oldest: _Request) -> int:
        return sum(r.prepared.rows for r in self._waiting if self._joins(oldest, r))

    def _take(self, oldest: _Request) -> list[_Request]:
        """Remove and return the next batch: the anchor (:meth:`_anchor`: the oldest live request of the source
        whose turn it is) plus what fits with it.

        Others are chosen closest in length first (then oldest first), and kept only
        while the batch's longest/shortest stays within ``max_length_ratio``, its
        rows within ``max_batch_size`` and rows x longest within ``max_batch_tokens``. Expired requests fail here; cancelled ones vanish.
        """
        now = time.perf_counter()
        alive: list[_Request] = []
        for req in self._waiting:
            if req.future.cancelled():
                continue
            if req.deadline is not None and now > req.deadline:
                self.stats.timed_out += 1
                if req.future.set_running_or_notify_cancel():
                    waited = (now - req.enqueued) * 1000
                    req.future.set_exception(
                        RequestTimeoutError(f"model {self.name!r}: request timed out after {waited:.0f} ms in queue")
                    )
                continue
            alive.append(req)
        if not alive:
            self._waiting = deque()
            return []
        anchor = self._anchor(alive)
        chosen = [anchor]
        if self.layout.can_batch:
            ratio, length = self.config.max_length_ratio, anchor.prepared.length
            cap = self.config.max_batch_tokens
            candidates = [r for r in alive if r is not anchor and r.prepared.key == anchor.prepared.key]
            if (ratio is not None or cap is not None) and length is not None:
                candidates.sort(key=lambda r: (abs(math.log(r.length / length)), r.enqueued))
            rows = anchor.prepared.rows
            span = (length, length) if length is not None else None  # the batch's shortest and longest so far
            for req in candidates:
                if rows + req.prepared.rows > self.config.max_batch_size:
                    continue
                if span is not None:
                    new_lo, new_hi = min(span[0], req.length), max(span[1], req.length)
                    if ratio is not None and new_hi > ratio * new_lo:
                        continue
                    if cap is not None and (rows + req.prepared.rows) * new_hi > cap:
                        continue
                    span = new_lo, new_hi
                chosen.append(req)
                rows += req.prepared.rows
                if rows == self.config.max_batch_size:
                    break
        picked = set(map(id, chosen))
        self._waiting = deque(r for r in alive if id(r) not in picked)
        self._batch_number += 1
        for req in chosen:
            self._turns[req.source] = self._batch_number
            self._turns.move_to_end(req.source)
        while len(self._turns) > _SOURCES_REMEMBERED:
            self._turns.popitem(last=False)
        # False from set_running_or_notify_cancel: the caller cancelled just now; drop it.
        return [r for r in chosen if r.future.set_running_or_notify_cancel()]

    def _anchor(self, alive: list[_Request]) -> _Request:
        """The request the next batch is built around: the oldest of the source whose last turn is longest ago
        (a source never served, or forgotten, first)."""
        turns = self._turns
        return min(alive, key=lambda r: turns.get(r.source, -1))  # min keeps the first (oldest) of equals

    def _run(self, batch: list[_Request]) -> None:
        wanted = self._wanted_outputs(batch)
        start = time.perf_counter()
        try:
            results = self._execute([r.prepared for r in batch], wanted)
        except Exception as e:  # noqa: BLE001 - every caller must hear about it, the worker must live
            if len(batch) == 1:
                self._fail(batch, model_input_error(e) or e)
                return
            # One request's inputs can fail a merged run (a value no check could foresee): run each
            # alone, so only the culprit fails and its neighbours get their results.
            for req in batch:
                self._run([req])
            return
        except BaseException as e:
            self._fail(batch, RuntimeError(repr(e)))
            raise
        self._deliver(batch, results, start)

    def _execute(self, items: list[Prepared], wanted: list[str]) -> list[dict[str, np.ndarray]]:
        feeds, _ = self.layout.merge(items)
        return self.layout.split(self.session._run(feeds, wanted), items)

    def _fail(self, batch: list[_Request], error: Exception) -> None:
        self.stats.failed += len(batch)
        for req in batch:
            req.future.set_exception(error)

    def _deliver(self, batch: list[_Request], results: list[dict[str, np.ndarray]], start: float) -> None:
        compute = time.perf_counter() - start
        rows = sum(r.prepared.rows for r in batch)
        self.pace.observe(rows, max(r.prepared.length or 1 for r in batch), compute)
        self.stats.batches += 1
        self.stats.rows += rows
        self.stats.largest_batch = max(self.stats.largest_batch, rows)
        self.stats.batch_sizes[rows] = self.stats.batch_sizes.get(rows, 0) + 1
        for req, result in zip(batch, results):
            if req.output_names is not None:
                result = {n: result[n] for n in req.output_names}
            req.future.set_result(result)
        if self.observer is not None:
            try:
                self.observer.on_batch(rows, len(batch), [start - r.enqueued for r in batch], compute)
            except Exception:  # noqa: BLE001 - metrics must never break serving
                pass

    def _wanted_outputs(self, batch: list[_Request]) -> list[str]:
        if any(r.output_names is None for r in batch):
            return self.session.output_names
        wanted = {n for r in batch for n in r.output_names or []}
        return [n for n in self.session.output_names if n in wanted]
