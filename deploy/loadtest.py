"""``attnx bench``: a closed-loop load generator: N concurrent clients for a bounded time, latency percentiles.

Targets:

- :class:`InProcessTarget`: a :class:`~attnx.runtime.batcher.DynamicBatcher` in this
  process (measures the runtime itself, no HTTP).
- :class:`HttpTarget`: a running server (``attnx serve`` or Triton) through the
  unmodified ``tritonclient.http`` client, binary tensors.

Every client thread loops: pick a request from a pre-generated pool (so input
generation does not count), send it, wait for its answer, record the latency.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import numpy as np

from attnx.contract import BATCH, SEQ, Role
from attnx.runtime.session import TensorSpec


def synthetic_feeds(
    inputs: Sequence[TensorSpec], batch: int, seq: int, rng: np.random.Generator, *, length: int | None = None
) -> dict[str, np.ndarray]:
    """Valid random inputs for a model: unit-scale floats, a mask of ``length`` ones then padding.

    Integer context inputs (type ids) are zeros, always in range. Unnamed dynamic
    dims get size 1.
    """
    feeds: dict[str, np.ndarray] = {}
    for spec in inputs:
        shape = [batch if d == BATCH else seq if d == SEQ else d if isinstance(d, int) else 1 for d in spec.shape]
        dtype = np.dtype(spec.dtype)
        if spec.role == Role.ATTENTION_MASK:
            arr = np.zeros(shape, dtype=dtype)
            arr[..., : (length or seq)] = 1
        elif dtype.kind == "f":
            scale = 1.0 if spec.role == Role.HIDDEN_STATES else (0.05 if "trace" in spec.name else 0.5)
            arr = (rng.standard_normal(shape) * scale).astype(dtype)
        elif dtype.kind == "b":
            arr = np.ones(shape, dtype=dtype)
        else:
            arr = np.zeros(shape, dtype=dtype)
        feeds[spec.name] = arr
    return feeds


@dataclass
class LoadResult:
    """What one load run measured."""

    label: str
    concurrency: int
    duration_s: float
    ok: int = 0
    rows: int = 0
    tokens: int = 0
    errors: Counter = field(default_factory=Counter)
    latencies_s: list[float] = field(default_factory=list)
    mean_batch_rows: float | None = None

    @property
    def requests_per_s(self) -> float:
        return self.ok / self.duration_s if self.duration_s else 0.0

    @property
    def sequences_per_s(self) -> float:
        return self.rows / self.duration_s if self.duration_s else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.duration_s if self.duration_s else 0.0

    def percentile_ms(self, q: float) -> float:
        return float(np.percentile(self.latencies_s, q) * 1000) if self.latencies_s else float("nan")

    def summary(self) -> dict:
        return {
            "label": self.label,
            "concurrency": self.concurrency,
            "duration_s": round(self.duration_s, 3),
            "ok": self.ok,
            "errors": dict(self.errors),
            "req_per_s": round(self.requests_per_s, 2),
            "seq_per_s": round(self.sequences_per_s, 2),
            "tokens_per_s": round(self.tokens_per_s, 1),
            "p50_ms": round(self.percentile_ms(50), 3),
            "p95_ms": round(self.percentile_ms(95), 3),
            "p99_ms": round(self.percentile_ms(99), 3),
            "mean_batch_rows": self.mean_batch_rows,
        }


Call = Callable[[Mapping[str, np.ndarray]], Mapping[str, np.ndarray]]


def run_load(
    call_factory: Callable[[], Call],
    pool: Sequence[tuple[dict[str, np.ndarray], int, int]],
    *,
    concurrency: int,
    duration_s: float,
    max_requests: int | None = None,
    label: str = "",
    seed: int = 0,
) -> LoadResult:
    """``concurrency`` client threads, each with its own ``call_factory()``, for ``duration_s``.

    ``pool`` holds ``(feeds, rows, tokens)`` requests to draw from at random.
    ``max_requests`` bounds the total (per run) besides the time.
    """
    result = LoadResult(label, concurrency, duration_s)
    lock = threading.Lock()
    budget = [max_requests if max_requests is not None else float("inf")]
    start_barrier = threading.Barrier(concurrency + 1)
    stop_at = [0.0]

    def client(index: int) -> None:
        rng = np.random.default_rng(seed + index)
        latencies: list[float] = []
        ok = rows = tokens = 0
        errors: Counter = Counter()
        try:
            call = call_factory()
        except Exception as e:  # noqa: BLE001 - still meet the others at the barrier
            with lock:
                result.errors[_error_kind(e)] += 1
            start_barrier.wait()
            return
        start_barrier.wait()
        while time.perf_counter() < stop_at[0]:
            with lock:
                if budget[0] <= 0:
                    break
                budget[0] -= 1
            feeds, n_rows, n_tokens = pool[int(rng.integers(len(pool)))]
            t0 = time.perf_counter()
            try:
                call(feeds)
            except Exception as e:  # noqa: BLE001 - a load run counts failures, it does not stop on them
                errors[_error_kind(e)] += 1
                continue
            latencies.append(time.perf_counter() - t0)
            ok += 1
            rows += n_rows
            tokens += n_tokens
        close = getattr(call, "close", None)
        if close is not None:
            close()
        with lock:
            result.latencies_s.extend(latencies)
            result.ok += ok
            result.rows += rows
            result.tokens += tokens
            result.errors.update(errors)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(concurrency)]
    for t in threads:
        t.start()
    began = time.perf_counter()
    stop_at[0] = began + duration_s
    start_barrier.wait()
    for t in threads:
        t.join(duration_s + 120)
    result.duration_s = time.perf_counter() - began
    return result


def _error_kind(e: Exception) -> str:
    status = getattr(e, "status", None)
    status = status() if callable(status) else status
    return f"{type(e).__name__}:{status}" if status else type(e).__name__


def request_pool(
    inputs: Sequence[TensorSpec], seq_lengths: Sequence[int], *, batch: int = 1, per_length: int = 8, seed: int = 0
) -> list[tuple[dict[str, np.ndarray], int, int]]:
    """Pre-generated requests: ``per_length`` of each length in the mix."""
    rng = np.random.default_rng(seed)
    return [
        (synthetic_feeds(inputs, batch, L, rng), batch, batch * L)
        for L in seq_lengths
        for _ in range(per_length)
    ]


# --------------------------------------------------------------------------------------
# Targets
# --------------------------------------------------------------------------------------


class InProcessTarget:
    """Calls go through a batcher in this process."""

    def __init__(self, batcher):
        self.batcher = batcher

    def factory(self) -> Call:
        return self.batcher.infer


class HttpTarget:
    """Calls go to a server through ``tritonclient.http`` (one client per thread), binary tensors."""

    def __init__(self, url: str, model: str, timeout_s: float = 60.0):
        self.address = url.split("://", 1)[-1].rstrip("/")
        self.model = model
        self.timeout_s = timeout_s

    def factory(self) -> Call:
        import tritonclient.http as httpclient
        from tritonclient.utils import np_to_triton_dtype

        client = httpclient.InferenceServerClient(
            self.address, connection_timeout=self.timeout_s, network_timeout=self.timeout_s
        )
        model = self.model

        class _Call:
            def __call__(self, feeds):
                inputs = []
                for name, arr in feeds.items():
                    i = httpclient.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype))
                    i.set_data_from_numpy(arr, binary_data=True)
                    inputs.append(i)
                result = client.infer(model, inputs)
                return {o["name"]: result.as_numpy(o["name"]) for o in result.get_response()["outputs"]}

            def close(self):
                client.close()

        return _Call()


def render(results: Sequence[LoadResult], title: str = "attnx bench", baseline: LoadResult | None = None):
    """A Rich table of results (ratios against ``baseline`` when given)."""
    from rich.table import Table

    table = Table(title=title)
    for col in ("run", "clients", "ok", "errors", "req/s", "seq/s", "tokens/s", "p50 ms", "p95 ms", "p99 ms",
                "mean batch"):
        table.add_column(col, justify="right" if col != "run" else "left")
    if baseline is not None:
        table.add_column("x throughput", justify="right")
    for r in results:
        row = [
            r.label,
            str(r.concurrency),
            str(r.ok),
            str(sum(r.errors.values())),
            f"{r.requests_per_s:.1f}",
            f"{r.sequences_per_s:.1f}",
            f"{r.tokens_per_s:.0f}",
            f"{r.percentile_ms(50):.1f}",
            f"{r.percentile_ms(95):.1f}",
            f"{r.percentile_ms(99):.1f}",
            f"{r.mean_batch_rows:.1f}" if r.mean_batch_rows is not None else "-",
        ]
        if baseline is not None:
            ratio = r.sequences_per_s / baseline.sequences_per_s if baseline.sequences_per_s else float("nan")
            row.append(f"{ratio:.2f}")
        table.add_row(*row)
    return table
