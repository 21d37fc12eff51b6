"""``attnx bench``: a closed-loop load generator: N concurrent clients for a bounded time, latency percentiles.

Targets:

- :class:`InProcessTarget`: a :class:`~attnx.runtime.core.batcher.DynamicBatcher` in this
  process (measures the runtime itself, no HTTP).
- :class:`HttpTarget`: a running server (``attnx serve`` or Triton) through the
  unmodified ``tritonclient.http`` client, binary tensors.
- Text (``attnx bench --text``): :func:`text_pool` makes real-word texts of a chosen
  token-length range; :class:`TextInProcessTarget` tokenises and submits them to a
  batcher as the server does; :class:`HttpTarget` with ``text=True`` sends them as
  ``BYTES``. :func:`single_answers` records each pool item's answer run alone, and
  ``run_load(verify=...)`` counts every load answer that differs from it.

Every client thread loops: pick a request from a pre-generated pool (so input
generation does not count), send it, wait for its answer, record the latency.
:func:`rss_bytes` reads a process's resident memory (this one, or a server's ``/metrics``).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import numpy as np

from attnx.contract import SEQ, Role
from attnx.feeds import synthetic_feeds
from attnx.runtime.core.session import TensorSpec
from attnx.runtime.core.text import TEXT_INPUT


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
    #: Answers that differed from the same request run alone (``run_load(verify=...)``).
    mismatched: int = 0

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
            "mismatched": self.mismatched,
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
    verify: Callable[[int, Mapping[str, np.ndarray]], bool] | None = None,
) -> LoadResult:
    """``concurrency`` client threads, each with its own ``call_factory()``, for ``duration_s``.

    ``pool`` holds ``(feeds, rows, tokens)`` requests to draw from at random.
    ``max_requests`` bounds the total (per run) besides the time. ``verify(pool_index, answer)``
    says whether an answer is right; wrong ones are counted in ``mismatched``.
    """
    result = LoadResult(label, concurrency, duration_s)
    lock = threading.Lock()
    budget = [max_requests if max_requests is not None else float("inf")]
    start_barrier = threading.Barrier(concurrency + 1)
    stop_at = [0.0]

    def client(index: int) -> None:
        rng = np.random.default_rng(seed + index)
        latencies: list[float] = []
        ok = rows = tokens = wrong = 0
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
            index = int(rng.integers(len(pool)))
            feeds, n_rows, n_tokens = pool[index]
            t0 = time.perf_counter()
            try:
                answer = call(feeds)
            except Exception as e:  # noqa: BLE001 - a load run counts failures, it does not stop on them
                errors[_error_kind(e)] += 1
                continue
            latencies.append(time.perf_counter() - t0)
            if verify is not None and not verify(index, answer):
                wrong += 1
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
            result.mismatched += wrong
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


def merge_results(parts: Sequence[LoadResult], label: str) -> LoadResult:
    """One result from interleaved rounds: summed counts and time, pooled latencies, batch size weighted."""
    total = LoadResult(label, parts[0].concurrency, sum(p.duration_s for p in parts))
    rows = batches = 0.0
    for p in parts:
        total.ok += p.ok
        total.rows += p.rows
        total.tokens += p.tokens
        total.mismatched += p.mismatched
        total.errors.update(p.errors)
        total.latencies_s.extend(p.latencies_s)
        if p.mean_batch_rows:
            batches += p.rows / p.mean_batch_rows
            rows += p.rows
    total.mean_batch_rows = rows / batches if batches else None
    return total


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
    """Calls go to a server through ``tritonclient.http`` (one client per thread), binary tensors.

    ``text=True``: each pool item's feeds are ``{"text": str}``, sent as a ``BYTES`` input;
    ``outputs`` names the outputs asked for (default: all)."""

    def __init__(self, url: str, model: str, timeout_s: float = 60.0, *, text: bool = False,
                 outputs: Sequence[str] | None = None):
        self.address = url.split("://", 1)[-1].rstrip("/")
        self.model = model
        self.timeout_s = timeout_s
        self.text = text
        self.outputs = list(outputs) if outputs else None

    def factory(self) -> Call:
        import tritonclient.http as httpclient
        from tritonclient.utils import np_to_triton_dtype

        client = httpclient.InferenceServerClient(
            self.address, connection_timeout=self.timeout_s, network_timeout=self.timeout_s
        )
        model, text = self.model, self.text
        requested = [httpclient.InferRequestedOutput(n) for n in self.outputs] if self.outputs else None

        class _Call:
            def __call__(self, feeds):
                inputs = []
                for name, arr in feeds.items():
                    is_text = text and name == TEXT_INPUT  # the rest: the variant's context rows
                    if is_text:
                        arr = np.array([str(arr).encode()], dtype=object)
                    i = httpclient.InferInput(name, list(arr.shape), "BYTES" if is_text else np_to_triton_dtype(arr.dtype))
                    i.set_data_from_numpy(arr, binary_data=True)
                    inputs.append(i)
                result = client.infer(model, inputs, outputs=requested)
                return {o["name"]: result.as_numpy(o["name"]) for o in result.get_response()["outputs"]}

            def close(self):
                client.close()

        return _Call()


class TextInProcessTarget:
    """Texts tokenised and submitted to a batcher in this process, exactly as the server does."""

    def __init__(self, batcher, tokenizer, outputs: Sequence[str] | None = None):
        self.batcher, self.tokenizer = batcher, tokenizer
        self.outputs = list(outputs) if outputs else None

    def factory(self) -> Call:
        from attnx.runtime.core.text import text_feeds

        inputs = self.batcher.session.inputs

        def call(feeds):
            encoded = self.tokenizer.tokenize([feeds[TEXT_INPUT]])[0]
            context = {k: v for k, v in feeds.items() if k != TEXT_INPUT}
            return self.batcher.infer(text_feeds(inputs, encoded, context), output_names=self.outputs)

        return call


def text_context_specs(inputs: Sequence[TensorSpec]) -> list[TensorSpec]:
    """The inputs a text request must still send itself: a variant's per-example context (the token
    inputs come from the text; a head mask is optional). Per-token context cannot go with text."""
    token_roles = (Role.INPUT_IDS, Role.ATTENTION_MASK, Role.TOKEN_TYPE_IDS, Role.HEAD_MASK)
    specs = [s for s in inputs if s.role not in token_roles and s.name != TEXT_INPUT and s.dtype != np.dtype(object)]
    per_token = [s.name for s in specs if SEQ in s.shape]
    if per_token:
        raise ValueError(f"input(s) {', '.join(per_token)} have one value per token, which text requests cannot "
                         "line up with their tokens: bench this model with token ids (without --text)")
    return specs


def text_pool(tokenizer, count: int = 64, *, min_tokens: int = 3, max_tokens: int = 300, seed: int = 0,
              context: Sequence[TensorSpec] = ()) -> list[tuple[dict, int, int]]:
    """``count`` texts of real vocabulary words, their token counts (special tokens included, before any
    truncation) spread uniformly over ``[min_tokens, max_tokens]``: ``({"text": str, **context}, 1, tokens)``
    items for :func:`run_load` (tokens counted as the model runs them, truncated). ``context``: the
    per-example inputs each request also sends (:func:`text_context_specs`), random but valid."""
    vocab = tokenizer._full.get_vocab()
    words = sorted(w.lstrip("\u0120") for w in vocab if w.lstrip("\u0120").isalpha() and len(w.lstrip("\u0120")) > 2)
    if not words:
        raise ValueError("the tokenizer's vocabulary has no whole words to build texts from")
    rng = np.random.default_rng(seed)
    targets = np.linspace(min_tokens, max_tokens, count).round().astype(int)
    pool = []
    for target in rng.permutation(targets):
        text = words[int(rng.integers(len(words)))]
        while True:
            n = len(tokenizer._full.encode(text).ids)  # untruncated: the text's own length
            if n >= target:
                break
            # Grow by about the missing tokens' worth of words at once (one word is about one token).
            text += " " + " ".join(words[int(i)] for i in rng.integers(len(words), size=max(1, (target - n) // 2)))
        rows = synthetic_feeds(context, 1, 1, rng) if context else {}
        pool.append(({TEXT_INPUT: text, **rows}, 1, min(n, tokenizer.max_length or n)))
    return pool


def single_answers(call_factory: Callable[[], Call], pool: Sequence[tuple[dict, int, int]]) -> list[dict]:
    """Each pool request's answer when it runs alone (sent one at a time): the reference for ``verify``."""
    call = call_factory()
    try:
        return [dict(call(feeds)) for feeds, _, _ in pool]
    finally:
        close = getattr(call, "close", None)
        if close is not None:
            close()


def answers_match(reference: Sequence[Mapping[str, np.ndarray]], atol: float = 1e-4):
    """``verify`` for :func:`run_load`: the answer equals the pool item's single-run answer within ``atol``."""

    def verify(index: int, answer: Mapping[str, np.ndarray]) -> bool:
        want = reference[index]
        if set(answer) != set(want):
            return False
        for name, w in want.items():
            g = np.asarray(answer[name])
            if g.shape != w.shape or (g.size and float(np.abs(g.astype(np.float64) - w).max()) > atol):
                return False
        return True

    return verify


def rss_bytes(url: str | None = None) -> int | None:
    """Resident memory: of this process (``url=None``), or of the server at ``url`` (its ``/metrics``
    ``process_resident_memory_bytes``); None when it cannot be read."""
    if url is None:
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
        return None
    import httpx

    try:
        text = httpx.get(url.rstrip("/") + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    for line in text.splitlines():
        if line.startswith("process_resident_memory_bytes "):
            return int(float(line.split()[1]))
    return None


def render(results: Sequence[LoadResult], title: str = "attnx bench", baseline: LoadResult | None = None):
    """A Rich table of results (ratios against ``baseline`` when given)."""
    from rich.table import Table

    table = Table(title=title)
    for col in ("run", "clients", "ok", "errors", "wrong", "req/s", "seq/s", "tokens/s", "p50 ms", "p95 ms",
                "p99 ms", "mean batch"):
        table.add_column(col, justify="right" if col != "run" else "left")
    if baseline is not None:
        table.add_column("x throughput", justify="right")
    for r in results:
        row = [
            r.label,
            str(r.concurrency),
            str(r.ok),
            str(sum(r.errors.values())),
            str(r.mismatched),
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
