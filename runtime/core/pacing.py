"""Admission by work: refuse at once a request that cannot start before its queue deadline.

A request never starts after its deadline (``BatcherConfig.timeout_ms``, or the client's shorter ``timeout``), so
one whose texts take longer to compute than that, or that would wait behind more work than that, can only end in a
time-out, after holding the queue and the CPU for the whole wait (8 MB of text over gRPC: 34 s, then
``DEADLINE_EXCEEDED``). The batcher records the best rate it has seen (:class:`Pace`: seconds per padded token, per
length bucket, since attention makes long sequences dearer per token), and :func:`run` checks each request against
it before queueing:

- its own parts cannot all start in time: ``too_large`` (413) naming the tokens, the rate and the deadline; no retry
  helps, fewer or shorter texts do;
- the work already queued ahead would make it miss its deadline: ``overloaded`` (retry later).

The best rate seen is optimistic (it is a minimum over batches), so a borderline request is still admitted and times
out as before; only clear misses are refused. Where the model has not yet run sequences of the request's lengths, a
request of more than one batch first runs a few rows of them (the probe: at most :data:`PROBE_TOKENS` padded tokens),
then the check decides on the rest.
"""

from __future__ import annotations

import math
import threading
from typing import Awaitable, Callable, Sequence

import numpy as np

from attnx.runtime.core.errors import overloaded, too_large

#: A bucket must hold this share of a request's tokens before its rate is needed for the estimate.
_MINOR_SHARE = 0.1
#: Padded tokens the probe runs at most (at least one row): enough to learn a rate (long rows cost no less per
#: token alone than batched on a CPU), few enough that a neighbour queued behind it waits a fraction of a second,
#: where a full batch of a hostile request's 256-token rows held the model for seconds (issue 45).
PROBE_TOKENS = 512


def bucket(length: int) -> int:
    """Length bucket: sequences of 1-16 tokens, 17-32, 33-64, ... (powers of two)."""
    return max(4, math.ceil(math.log2(max(1, length))))


class Pace:
    """The best seconds per padded token a model has shown, per length bucket (thread-safe)."""

    def __init__(self) -> None:
        self._best: dict[int, float] = {}
        self._lock = threading.Lock()

    def observe(self, rows: int, length: int, seconds: float) -> None:
        tokens = rows * max(1, length)
        if tokens < 1 or seconds <= 0:
            return
        key, rate = bucket(length), seconds / tokens
        with self._lock:
            if rate < self._best.get(key, math.inf):
                self._best[key] = rate

    def seconds(self, parts: Sequence[tuple[int, int]], *, nearest: bool = False) -> float | None:
        """Estimated compute of ``parts`` (``(rows, length)`` each). Buckets never seen take the nearest seen
        one's rate when ``nearest``; otherwise an unseen bucket holding a real share of the tokens makes the
        estimate unknown (None)."""
        with self._lock:
            best = dict(self._best)
        if not best:
            return None
        tokens: dict[int, int] = {}
        for rows, length in parts:
            tokens[bucket(length)] = tokens.get(bucket(length), 0) + rows * max(1, length)
        total = sum(tokens.values()) or 1
        seconds = 0.0
        for key, count in tokens.items():
            rate = best.get(key)
            if rate is None:
                if not nearest and count / total > _MINOR_SHARE:
                    return None
                rate = best[min(best, key=lambda k: (abs(k - key), -k))]  # nearest, the longer on a tie
            seconds += rate * count
        return seconds

    def rate(self, length: int) -> float | None:
        """Tokens per second at this length, as far as seen (for messages)."""
        with self._lock:
            best = self._best.get(bucket(length))
        return 1.0 / best if best else None


def part_shape(layout, feeds: dict[str, np.ndarray]) -> tuple[int, int]:
    """``(rows, length)`` of one part's feeds, from the model's batch and seq axes."""
    rows = length = None
    for spec in layout.inputs:
        arr = feeds.get(spec.name)
        if arr is None:
            continue
        if rows is None and spec.batch_axis is not None:
            rows = arr.shape[spec.batch_axis]
        if length is None and spec.seq_axis is not None:
            length = arr.shape[spec.seq_axis]
    return rows or 1, length or 1


def check(batcher, parts: Sequence[tuple[int, int]], timeout_ms: float | None) -> bool:
    """Refuse (413 / 503) what cannot start in time; True when it may be queued, False when its lengths
    have not been seen yet (the estimate is unknown)."""
    limits = [t for t in (batcher.config.timeout_ms, timeout_ms) if t is not None]
    if not limits or not parts:
        return True
    deadline = min(limits) / 1000.0
    own = batcher.pace.seconds(parts)
    if own is None:
        return False
    # Parts batch together, up to max_batch_size rows a run: the last run must start by the deadline.
    rows = sum(r for r, _ in parts)
    before_last = own * max(0.0, 1.0 - batcher.config.max_batch_size / rows)
    tokens = sum(r * max(1, n) for r, n in parts)
    if before_last > deadline:
        longest = max(n for _, n in parts)
        rate = batcher.pace.rate(longest)
        at = f" at the {rate:,.0f} tokens/s this model has shown" if rate else ""
        raise too_large(f"this request needs about {own:.1f} s of compute ({tokens} padded tokens{at}), more "
                             f"than the {deadline:g} s a request may wait to start: send fewer or shorter texts "
                             f"(or serve with a longer --timeout-ms)")
    ahead = batcher.pace.seconds(batcher.queued_parts(), nearest=True) or 0.0
    if ahead + before_last > deadline:
        raise overloaded(f"model {batcher.name!r}: about {ahead:.1f} s of work is queued ahead, and this "
                               f"request could not start within {deadline:g} s; retry later")
    return True


async def run(batcher, feeds: list[dict[str, np.ndarray]], timeout_ms: float | None,
              submit: Callable[[list[dict[str, np.ndarray]]], Awaitable[list]]) -> list:
    """``submit(feeds)`` (all parts, results in order) once :func:`check` admits them. Lengths not seen yet,
    in a request of more than one batch: a few rows of its most common length bucket run first (the
    probe, :data:`PROBE_TOKENS` padded tokens at most), then the rest is checked with what it showed."""
    parts = [part_shape(batcher.layout, f) for f in feeds]
    if check(batcher, parts, timeout_ms):
        return await submit(feeds)
    size = batcher.config.max_batch_size
    if sum(r for r, _ in parts) <= size:
        return await submit(feeds)  # one batch: nothing to learn before running it
    counts: dict[int, int] = {}
    for rows, length in parts:
        counts[bucket(length)] = counts.get(bucket(length), 0) + rows * length
    main = max(counts, key=counts.__getitem__)
    probe: list[int] = []
    rows = 0
    for i, (n, length) in enumerate(parts):
        if bucket(length) == main:
            if probe and (rows + n > size or (rows + n) * max(1, length) > PROBE_TOKENS):
                break
            probe, rows = probe + [i], rows + n
    first = await submit([feeds[i] for i in probe])
    chosen = set(probe)
    rest = [i for i in range(len(feeds)) if i not in chosen]
    check(batcher, [parts[i] for i in rest], timeout_ms)  # unseen buckets left: admitted, as before pacing
    results: list = [None] * len(feeds)
    for i, r in zip(probe, first):
        results[i] = r
    for i, r in zip(rest, await submit([feeds[i] for i in rest]) if rest else []):
        results[i] = r
    return results
