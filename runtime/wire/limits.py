"""What one request may ask of the server, and how the work it brings is kept off the event loop.

- :class:`Limits`: body size and body deadline, tensor elements, texts, messages and tokens per request (one set
  for every API), and the bounds on what a raw JSON body may hold before it is parsed (:meth:`Limits.json_bound`,
  checked by :mod:`attnx.runtime.wire.counts`).
- :class:`~attnx.runtime.wire.budget.ByteBudget` (re-exported here): the bytes of bodies being read and decoded at
  once, charged as they arrive, with a reserve for small bodies.
- :func:`declared_length`, :func:`read_body`: 413 before reading, one buffer of the declared size, each chunk
  charged to the request's share of the budget as it arrives, and the body's deadline (408 for a body that
  arrives too slowly: ``body_timeout_s`` plus one second per ``min_body_rate`` bytes received, as Apache's
  mod_reqtimeout ``body=...,MinRate=...``; time spent waiting for the budget does not count).
- :class:`Workers`: the one worker policy. Work whose cost grows with the input (decoding JSON, tokenising,
  encoding big answers) runs inline only when small, else on one thread: these calls hold the GIL in C code,
  and one thread is all the event loop then competes with (two decode no faster, and doubled health-probe
  latency under 40 JSON clients: benchmarks/bench_server_load.py). Texts are cut to their model's character
  cap before tokenising; chat templates render in their own process (:mod:`attnx.runtime.core.chat`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import ctypes.util
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

from attnx.runtime.wire.budget import ByteBudget, Share
from attnx.runtime.wire.errors import Kind, ProtocolError, bad_input, too_large

__all__ = ["ByteBudget", "Limits", "JsonBound", "Workers", "declared_length", "read_body", "cut_long_strings"]

#: Strings, values and lists a JSON body may hold beyond what its inputs need (names, schemas, tools, stops).
JSON_SLACK = 1 << 16
#: Values (numbers, strings, lists, objects) a text request may hold beyond its tokens: ``context`` rows.
CONTEXT_VALUES = 1 << 20


class JsonBound(NamedTuple):
    """What a route's raw JSON body may hold, checked before it is parsed (None: not bounded), and the limits
    that set it (named in the refusal)."""

    strings: int | None
    values: int | None
    lists: int | None
    limits: str


@dataclass
class Limits:
    """What one request may ask of the server: the wire's part of :class:`~attnx.runtime.config.ServingConfig`,
    whose field help says what each limit means (``max_body_bytes`` is set by ``max_body_mb``, ``max_texts`` by
    ``max_inputs``, ``min_body_rate`` by ``min_body_rate_kb``, ``max_decode_bytes`` by ``max_decode_mb``; the others
    by their own names). Here in bytes and counts; None: no limit (``max_seq``: the model's profile max,
    ``max_positions``: the model's own, ``max_decode_bytes``: the larger of ``max_body_bytes`` and 64 MiB,
    ``min_body_rate``: ``body_timeout_s`` is a total deadline).

    Limits that would refuse every request (a body limit or max seq below 1) are refused here.
    """

    max_body_bytes: int = 64 << 20
    max_tensor_elements: int = 16 << 20
    max_request_elements: int = 32 << 20
    max_seq: int | None = None
    max_texts: int = 1024
    max_request_tokens: int | None = 300_000
    max_decode_bytes: int | None = None
    decode_wait_s: float = 10.0
    max_messages: int = 2048
    body_timeout_s: float = 10.0
    min_body_rate: int | None = 16 << 10
    max_positions: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_tensor_elements", "max_request_elements", "max_texts",
                     "max_request_tokens", "max_seq", "max_decode_bytes", "max_messages", "min_body_rate",
                     "max_positions"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not self.decode_wait_s >= 0:
            raise ValueError(f"decode_wait_s must be >= 0, got {self.decode_wait_s!r}")
        if not self.body_timeout_s > 0:
            raise ValueError(f"body_timeout_s must be > 0, got {self.body_timeout_s!r}")

    @property
    def decode_budget(self) -> int:
        return self.max_decode_bytes or max(self.max_body_bytes, 64 << 20)

    def body_deadline(self, started: float, received: int) -> float:
        """When a body that began arriving at ``started`` and has ``received`` bytes so far must be complete."""
        return started + self.body_timeout_s + (received / self.min_body_rate if self.min_body_rate else 0.0)

    def check_tokens(self, tokens: int, partial: bool = False) -> None:
        """413 for a request whose texts come to more tokens than ``max_request_tokens`` (``partial``: ``tokens``
        counts some of its texts only)."""
        if self.max_request_tokens is not None and tokens > self.max_request_tokens:
            raise too_large(f"the request's inputs come to {'at least ' * partial}{tokens} tokens, over the limit of "
                            f"{self.max_request_tokens} tokens per request; send fewer or shorter inputs")

    def check_count(self, count: int, param: str) -> None:
        """``too_many`` for more inputs than ``max_texts``."""
        if count > self.max_texts:
            raise ProtocolError(Kind.TOO_MANY, f"'{param}' has {count} inputs, over the limit of {self.max_texts} "
                                               f"per request; send them in several requests", param)

    def check_messages(self, count: int) -> None:
        """``too_many`` for a chat with more messages than ``max_messages``."""
        if count > self.max_messages:
            raise ProtocolError(Kind.TOO_MANY, f"'messages' has {count} messages, over the limit of "
                                               f"{self.max_messages} per request", "messages")

    # --- what a raw JSON body may hold, per kind of route (before it is parsed) ----------------------
    def json_bound(self, route: str) -> JsonBound:
        """The bound of a route kind: ``texts`` (embeddings, rerank, classify: inputs are strings or token-id
        lists), ``prompts`` (completions), ``chat``, ``kserve`` (tensors: only strings are bounded, numbers are
        decoded without a Python object each)."""
        tokens = self.max_request_tokens or (1 << 24)
        values = tokens + 4 * max(self.max_texts, self.max_messages) + CONTEXT_VALUES
        lists = 64 * max(self.max_texts, self.max_messages) + JSON_SLACK
        if route == "texts":  # a (query, document) pair or a {"text": ...} document: two strings an input
            return JsonBound(2 * self.max_texts + JSON_SLACK, values, lists,
                             f"--max-inputs {self.max_texts}, --max-request-tokens {tokens}")
        if route == "prompts":
            return JsonBound(self.max_texts + JSON_SLACK, values, lists,
                             f"--max-inputs {self.max_texts}, --max-request-tokens {tokens}")
        if route == "chat":  # role, content and their keys, a name or a tool call: 8 strings a message
            return JsonBound(8 * self.max_messages + JSON_SLACK, values, lists,
                             f"{self.max_messages} messages, --max-request-tokens {tokens}")
        if route == "kserve":  # BYTES text and its pair: texts ride in strings
            return JsonBound(2 * self.max_texts + JSON_SLACK, None, None, f"--max-inputs {self.max_texts}")
        raise ValueError(f"unknown route kind {route!r}")


# --- reading a body under these rules (HTTP) ---------------------------------------------


def declared_length(request, limit: int) -> int | None:
    """``Content-Length``, refusing (413) one over ``limit`` before the body is read."""
    declared = request.headers.get("content-length")
    if declared is None:
        return None
    if not declared.strip().isdigit():
        raise bad_input("invalid Content-Length")
    if int(declared) > limit:
        raise too_large(f"body of {declared} bytes exceeds the limit of {limit} bytes")
    return int(declared)


async def read_body(request, limits: Limits, size: int | None, share: Share | None = None) -> bytearray:
    """The body, in one buffer grown as chunks arrive (not a list of chunks and then a joined copy; not sized to
    the declared length up front either, which a client could declare and never send): each chunk charged to
    ``share`` as it arrives, the whole under the body deadline (:meth:`Limits.body_deadline`)."""
    limit = limits.max_body_bytes
    buf = bytearray()
    filled, waited = 0, 0.0
    loop = asyncio.get_running_loop()
    started = loop.time()
    chunks = request.stream().__aiter__()
    while True:
        left = limits.body_deadline(started + waited, filled) - loop.time()
        try:
            if left <= 0:
                raise TimeoutError
            async with asyncio.timeout(left):
                chunk = await anext(chunks)
        except StopAsyncIteration:
            break
        except TimeoutError:
            raise _slow(limits, filled, size, loop.time() - started - waited) from None
        if share is not None and chunk:
            before = loop.time()
            await share.take(len(chunk), limits.decode_wait_s)
            waited += loop.time() - before
        if size is None and filled + len(chunk) > limit:
            raise too_large(f"body exceeds the limit of {limit} bytes")
        if size is not None and filled + len(chunk) > size:
            raise bad_input(f"body longer than its Content-Length ({size})")
        buf += chunk
        filled += len(chunk)
    if size is not None and filled != size:
        raise bad_input(f"body has {filled} bytes, Content-Length says {size}")
    return buf


def _slow(limits: Limits, filled: int, size: int | None, elapsed: float) -> ProtocolError:
    rate = f" plus 1 s per {limits.min_body_rate} bytes" if limits.min_body_rate else ""
    of = f" of {size}" if size is not None else ""
    return ProtocolError(Kind.BODY_TIMEOUT, f"request body too slow: {filled}{of} bytes in {elapsed:.1f} s (the body "
                                            f"may take {limits.body_timeout_s:g} s{rate}: --body-timeout-s)")


# --- the worker policy -------------------------------------------------------------------------

#: Work below this cost (bytes or characters) runs inline: a thread hop costs more than it.
INLINE_COST = 32 << 10
#: After a request this big, freed heap pages go back to the system (glibc keeps them otherwise).
_TRIM_BYTES = 4 << 20
_LIBC: ctypes.CDLL | None
try:
    _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    _LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
except (OSError, AttributeError):  # not glibc
    _LIBC = None


class Workers:
    """Runs work whose cost grows with the input off the event loop (module doc): ``await run(fn, cost=n)``."""

    def __init__(self, threads: int = 1):
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="attnx-work")

    async def run(self, fn: Callable[..., Any], *args, cost: int) -> Any:
        if cost < INLINE_COST:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def trim(self, size: int) -> None:
        """After a request of ``size`` bytes: give freed memory back to the system, on the worker thread."""
        if size >= _TRIM_BYTES and _LIBC is not None:
            self._pool.submit(_LIBC.malloc_trim, 0)

    def close(self) -> None:
        self._pool.shutdown(wait=False)


# --- long strings, before a JSON body is parsed -------------------------------------------------------------

#: Bytes a JSON string may spend on one character (a ``\uXXXX`` escape).
_ESCAPED = 6


def cut_long_strings(body: bytes, cap: int | None) -> bytes:
    """``body`` (JSON) with each string literal far past ``cap`` characters cut to its two ends (``cap`` characters
    each at least), found with ``find`` (a memchr) before parsing: parsing a 63 MiB string holds the GIL 0.3 s,
    and no model reads more than its character cap from either end (what is kept still exceeds the cap, so it is
    cut, or refused with truncation off, as the whole string would be). ``cap`` None: nothing is cut."""
    keep = None if cap is None else cap * _ESCAPED + 16
    if keep is None or len(body) < 2 * keep:
        return body
    pieces, pos, i = [], 0, body.find(b'"')
    while i >= 0:
        j = _closing_quote(body, i)
        if j < 0:
            break  # malformed: the parser says so
        if j - i > 2 * keep:
            head, tail = _safe(body, i + 1 + keep, 1), _safe(body, j - keep, -1)  # each keeps at least ``keep``
            if head is not None and tail is not None and head < tail:
                pieces += [body[pos:head], body[tail:j]]
                pos = j
        i = body.find(b'"', j + 1)
    return b"".join(pieces + [body[pos:]]) if pieces else body


def _closing_quote(body: bytes, i: int) -> int:
    j = i
    while (j := body.find(b'"', j + 1)) >= 0:
        k = j
        while body[k - 1] == 0x5C:  # backslashes before it: an odd run escapes the quote
            k -= 1
        if (j - k) % 2 == 0:
            return j
    return -1


def _safe(body: bytes, at: int, step: int) -> int | None:
    """A cut point from ``at`` on (moving by ``step``) outside any escape and UTF-8 sequence, within 1 KiB."""
    for p in range(at, at + 1024 * step, step):
        if b"\\" not in body[p - _ESCAPED:p] and body[p] & 0xC0 != 0x80:
            return p
    return None
