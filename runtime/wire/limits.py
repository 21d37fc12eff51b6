"""What one request may ask of the server, and how the work it brings is kept off the event loop.

- :class:`Limits`: body size, tensor elements, texts and tokens per request (one set for every API).
- :class:`ByteBudget`: a JSON body costs a few times its size while it is decoded, so the bytes of bodies being
  read and decoded at once are bounded (taken from ``Content-Length`` before reading; a chunked body is charged
  the body limit); beyond it requests wait in arrival order, then are refused as overloaded. Shared by the HTTP
  and gRPC front ends (two event loops: a lock plus futures woken with ``call_soon_threadsafe``).
- :func:`declared_length`, :func:`read_body`: 413 before reading, one buffer of the declared size.
- :class:`Workers`: the one worker policy. Work whose cost grows with the input (decoding JSON, tokenising,
  encoding big answers) runs inline only when small, else on one thread: these calls hold the GIL in C code,
  and one thread is all the event loop then competes with (two decode no faster, and doubled health-probe
  latency under 40 JSON clients: benchmarks/bench_server_load.py). Texts are cut to their model's character
  cap before tokenising; chat templates render in their own process (:mod:`attnx.runtime.core.chat`).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import ctypes
import ctypes.util
import threading
from dataclasses import dataclass
from typing import Any, Callable

from attnx.runtime.wire.errors import Kind, ProtocolError, bad_input, too_large


@dataclass
class Limits:
    """What one request may ask of the server.

    - ``max_body_bytes``: the HTTP body (after decompression) or gRPC message, default 64 MiB.
    - ``max_tensor_elements``: elements in one tensor (checked on the declared shape, before any allocation), default
      16 Mi.
    - ``max_request_elements``: summed over a request's inputs, default 32 Mi.
    - ``max_seq``: longest ``seq`` accepted (None: the model's profile max if it declares one, else unlimited).
    - ``max_texts``: strings in one text request (inputs of an OpenAI or TEI embedding request), default 1024.
    - ``max_request_tokens``: tokens summed over one text request's texts, after tokenising and truncation, default
      300,000 (OpenAI's own per-request limit); over it is a 413.
    - ``max_decode_bytes``: request bodies being read and decoded at once, summed over requests (default: the larger
      of ``max_body_bytes`` and 64 MiB); beyond it requests wait up to ``decode_wait_s`` seconds, then are refused as
      overloaded.

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

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_tensor_elements", "max_request_elements", "max_texts",
                     "max_request_tokens", "max_seq", "max_decode_bytes"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not self.decode_wait_s >= 0:
            raise ValueError(f"decode_wait_s must be >= 0, got {self.decode_wait_s!r}")

    @property
    def decode_budget(self) -> int:
        return self.max_decode_bytes or max(self.max_body_bytes, 64 << 20)

    def check_tokens(self, tokens: int) -> None:
        """413 for a request whose texts come to more tokens than ``max_request_tokens``."""
        if self.max_request_tokens is not None and tokens > self.max_request_tokens:
            raise too_large(f"the request's inputs come to {tokens} tokens, over the limit of "
                            f"{self.max_request_tokens} tokens per request; send fewer or shorter inputs")

    def check_count(self, count: int, param: str) -> None:
        """``too_many`` for more inputs than ``max_texts``."""
        if count > self.max_texts:
            raise ProtocolError(Kind.TOO_MANY, f"'{param}' has {count} inputs, over the limit of {self.max_texts} "
                                               f"per request; send them in several requests", param)


@dataclass
class _Waiter:
    size: int
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    granted: bool = False


class ByteBudget:
    """At most ``capacity`` bytes held at once; :meth:`hold` waits (FIFO) or refuses (overloaded)."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError("the decode budget must be >= 1 byte")
        self.capacity = capacity
        self.in_use = 0
        self._lock = threading.Lock()
        self._waiters: collections.deque[_Waiter] = collections.deque()

    @contextlib.asynccontextmanager
    async def hold(self, size: int, timeout_s: float):
        size = max(1, min(size, self.capacity))  # one request may always have the whole budget
        await self._acquire(size, timeout_s)
        try:
            yield
        finally:
            self.release(size)

    async def _acquire(self, size: int, timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        with self._lock:
            if not self._waiters and self.in_use + size <= self.capacity:
                self.in_use += size
                return
            waiter = _Waiter(size, loop.create_future(), loop)
            self._waiters.append(waiter)
        try:
            await asyncio.wait_for(waiter.future, timeout_s)
        except BaseException as e:  # timed out, or the request went away: give back what was granted
            with self._lock:
                if waiter.granted:
                    self.in_use -= size
                else:
                    self._waiters.remove(waiter)
                self._wake_locked()  # the ones behind it may fit now
            if isinstance(e, TimeoutError):
                raise ProtocolError(Kind.OVERLOADED, f"server busy: {self.in_use >> 20} MiB of request bodies are "
                                    f"being decoded (limit {self.capacity >> 20} MiB); retry later") from None
            raise

    def release(self, size: int) -> None:
        with self._lock:
            self.in_use -= size
            self._wake_locked()

    def _wake_locked(self) -> None:
        while self._waiters and self.in_use + self._waiters[0].size <= self.capacity:
            waiter = self._waiters.popleft()
            waiter.granted = True
            self.in_use += waiter.size
            try:
                waiter.loop.call_soon_threadsafe(_grant, waiter.future)
            except RuntimeError:  # its loop has closed: nobody will use the grant
                waiter.granted = False
                self.in_use -= waiter.size


def _grant(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


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


async def read_body(request, limit: int, size: int | None) -> bytearray:
    """The body, in one buffer of the declared size (not a list of chunks and then a joined copy)."""
    buf = bytearray(size) if size is not None else bytearray()
    filled = 0
    async for chunk in request.stream():
        if size is None:
            if filled + len(chunk) > limit:
                raise too_large(f"body exceeds the limit of {limit} bytes")
            buf += chunk
        else:
            if filled + len(chunk) > size:
                raise bad_input(f"body longer than its Content-Length ({size})")
            buf[filled:filled + len(chunk)] = chunk
        filled += len(chunk)
    if size is not None and filled != size:
        raise bad_input(f"body has {filled} bytes, Content-Length says {size}")
    return buf


# --- the worker policy -------------------------------------------------------------------------

#: Work below this cost (bytes or characters) runs inline: a thread hop costs more than it.
INLINE_COST = 32 << 10
#: After a request this big, freed heap pages go back to the system (glibc keeps them otherwise).
_TRIM_BYTES = 4 << 20
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
