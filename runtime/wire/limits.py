"""Admission control for request bodies: how many bytes may be read and decoded at once.

A JSON body costs a few times its size while it is decoded (text, then numbers, then the array), so
the server bounds the *sum* of body sizes in that phase with a :class:`ByteBudget`, taken before the
body is read (from ``Content-Length``) and given back once the request is decoded. Requests beyond
it wait in arrival order, up to a deadline, then get 503. The budget is shared by the HTTP and gRPC
front ends, which run on different threads and event loops, so it is a lock plus per-waiter futures
woken with ``call_soon_threadsafe``. A body of unknown length (chunked) is charged the body limit.

:func:`declared_length` and :func:`read_body` read an HTTP body under these rules: 413 before reading
when ``Content-Length`` is over the limit, and one buffer of the declared size (no chunk list + copy).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
from dataclasses import dataclass

from attnx.runtime.apis import kserve_tensors as proto


@dataclass
class _Waiter:
    size: int
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    granted: bool = False


class ByteBudget:
    """At most ``capacity`` bytes held at once; :meth:`hold` waits (FIFO) or raises ``Overloaded``."""

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
                raise proto.Overloaded(f"server busy: {self.in_use >> 20} MiB of request bodies are being "
                                       f"decoded (limit {self.capacity >> 20} MiB); retry later") from None
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
        raise proto.BadRequest("invalid Content-Length")
    if int(declared) > limit:
        raise proto.TooLarge(f"body of {declared} bytes exceeds the limit of {limit} bytes")
    return int(declared)


async def read_body(request, limit: int, size: int | None) -> bytearray:
    """The body, in one buffer of the declared size (not a list of chunks and then a joined copy)."""
    buf = bytearray(size) if size is not None else bytearray()
    filled = 0
    async for chunk in request.stream():
        if size is None:
            if filled + len(chunk) > limit:
                raise proto.TooLarge(f"body exceeds the limit of {limit} bytes")
            buf += chunk
        else:
            if filled + len(chunk) > size:
                raise proto.BadRequest(f"body longer than its Content-Length ({size})")
            buf[filled:filled + len(chunk)] = chunk
        filled += len(chunk)
    if size is not None and filled != size:
        raise proto.BadRequest(f"body has {filled} bytes, Content-Length says {size}")
    return buf
