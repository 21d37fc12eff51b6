"""The byte budget: request bodies held in memory at once (being read, then decoded), charged as bytes arrive.

A JSON body costs a few times its size while it is decoded, so the bytes of the bodies in flight are bounded. Each
request has a :class:`Share` of the budget and is charged chunk by chunk as its bytes arrive (a client that
declares 64 MiB and sends a byte a second holds a few bytes, not 64 MiB), then holds what it read until its body
is decoded. Two rules keep one request from making others wait:

- **Small requests have a pool of their own**: a body declared at most :data:`SMALL_BODY` bytes (and the first
  :data:`SMALL_BODY` bytes of a chunked one) is charged to a reserve of :data:`SMALL_RESERVE` bytes that big
  bodies never touch, so a 1 KB request never queues behind 33 MiB uploads, however many.
- **Big bodies are granted only what leaves everyone able to finish** (the banker's rule, on one resource): a
  chunk is granted when, after it, the bodies in flight can still all be read to their declared ends in some
  order, each finishing and freeing what it holds. Bodies read in parallel never deadlock half-read; one that
  would have to wait does so until others finish, and past ``decode_wait_s`` is refused as overloaded. A chunked
  body's end is not declared: it is counted as needing up to the whole budget, so it comes last.

Shared by the HTTP and gRPC front ends (two event loops: a lock, and futures woken with ``call_soon_threadsafe``).
A gRPC message has arrived whole before its handler runs: :meth:`ByteBudget.held` charges it at once, never waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Iterable

from attnx.runtime.wire.errors import Kind, ProtocolError

#: Bodies declared at most this big (and the first bytes of a chunked body) are "small": charged to the reserve.
SMALL_BODY = 1 << 20
#: Bytes set aside for small bodies, on top of the budget for big ones.
SMALL_RESERVE = 16 << 20


class Share:
    """One request's part of the budget: :meth:`take` charges bytes as they arrive, :meth:`release` frees them all."""

    def __init__(self, budget: "ByteBudget", expected: int | None):
        self.budget = budget
        self.expected = expected  # the declared length (None: chunked, unknown)
        self.small = 0  # bytes charged to the small reserve
        self.big = 0  # bytes charged to the budget for big bodies
        #: the most this body may ever charge to the big budget (what the banker's rule reserves room for)
        self.ceiling = 0 if expected is not None and expected <= budget.small_body else \
            min(budget.capacity, expected if expected is not None else budget.capacity)

    @property
    def held(self) -> int:
        return self.small + self.big

    async def take(self, size: int, timeout_s: float) -> None:
        """Charge ``size`` more bytes; waits (for others to finish) up to ``timeout_s``, then overloaded."""
        await self.budget._take(self, size, timeout_s)

    def release(self) -> None:
        self.budget._release(self)


class ByteBudget:
    """``capacity`` bytes for big bodies plus ``reserve`` for small ones (module doc)."""

    def __init__(self, capacity: int, *, small_body: int | None = None, reserve: int | None = None):
        small_body = SMALL_BODY if small_body is None else small_body
        reserve = SMALL_RESERVE if reserve is None else reserve
        if capacity < 1:
            raise ValueError("the decode budget must be >= 1 byte")
        if not 0 <= small_body <= reserve:  # a small body must fit the reserve, or it would wait forever
            raise ValueError(f"small bodies ({small_body} bytes) must fit their reserve ({reserve} bytes)")
        self.capacity, self.small_body, self.reserve = capacity, small_body, reserve
        self.big_in_use = 0
        self.small_in_use = 0
        self._lock = threading.Lock()
        self._active: set[Share] = set()  # shares holding (or about to hold) big bytes
        self._waiters: list[tuple[Share, int, int, asyncio.Future, asyncio.AbstractEventLoop]] = []

    @property
    def in_use(self) -> int:
        return self.big_in_use + self.small_in_use

    def share(self, expected: int | None) -> Share:
        return Share(self, expected)

    @contextlib.asynccontextmanager
    async def held(self, size: int):
        """``size`` bytes already in memory (a gRPC message), charged at once for as long as the block runs."""
        share = Share(self, None)
        share.ceiling = share.big = max(0, size)
        with self._lock:
            self._active.add(share)
            self.big_in_use += share.big
        try:
            yield share
        finally:
            share.release()

    # --- charging ---------------------------------------------------------------------------------------
    def _split(self, share: Share, size: int) -> tuple[int, int]:
        """``(small, big)`` parts of ``size`` more bytes for ``share``."""
        if share.ceiling == 0:  # declared small: all of it from the reserve
            return size, 0
        if share.expected is None:  # chunked: its first bytes are small
            small = max(0, min(size, self.small_body - share.small))
            return small, size - small
        return 0, size

    def _grantable(self, share: Share, small: int, big: int) -> bool:
        if small and self.small_in_use + small > self.reserve:
            return False
        if not big:
            return True
        big = min(big, share.ceiling - share.big)  # a body past the whole budget is charged the budget
        if self.big_in_use + big > self.capacity:
            return False
        return _safe(self.capacity - self.big_in_use - big,
                     ((s.ceiling - s.big - (big if s is share else 0), s.big + (big if s is share else 0))
                      for s in self._active | {share}))

    def _grant(self, share: Share, small: int, big: int) -> None:
        big = max(0, min(big, share.ceiling - share.big))
        share.small += small
        share.big += big
        self.small_in_use += small
        self.big_in_use += big
        if share.ceiling:
            self._active.add(share)

    async def _take(self, share: Share, size: int, timeout_s: float) -> None:
        small, big = self._split(share, size)
        loop = asyncio.get_running_loop()
        with self._lock:  # first come, first served within a pool; the small pool never waits on the big one
            if not any((w[2] if big else w[1]) for w in self._waiters) and self._grantable(share, small, big):
                self._grant(share, small, big)
                return
            entry = (share, small, big, loop.create_future(), loop)
            self._waiters.append(entry)
            self._wake_locked()  # granted now if those before it are waiting for room it does not need
        try:
            await asyncio.wait_for(entry[3], timeout_s)
        except BaseException as e:  # timed out, or the request went away
            with self._lock:
                waiting = entry in self._waiters
                if waiting:
                    self._waiters.remove(entry)
                    self._wake_locked()  # the ones behind it may fit now
            if isinstance(e, TimeoutError):
                if not waiting:
                    return  # granted just as the wait ran out
                raise _busy(self) from None
            raise  # what was granted stays in the share, freed with it

    def _release(self, share: Share) -> None:
        with self._lock:
            self.small_in_use -= share.small
            self.big_in_use -= share.big
            share.small = share.big = 0
            self._active.discard(share)
            self._waiters[:] = [w for w in self._waiters if w[0] is not share]
            self._wake_locked()

    def _wake_locked(self) -> None:
        """Grant every waiter that fits now, in arrival order (one that does not fit does not block the rest)."""
        for entry in list(self._waiters):
            share, small, big, future, loop = entry
            if future.done() or not self._grantable(share, small, big):
                continue
            try:
                loop.call_soon_threadsafe(_set, future)
            except RuntimeError:  # its loop has closed: nobody will use the grant
                self._waiters.remove(entry)
                continue
            self._grant(share, small, big)
            self._waiters.remove(entry)


def _safe(free: int, needs: Iterable[tuple[int, int]]) -> bool:
    """The banker's rule: with ``free`` bytes, can every ``(still needed, held)`` body finish in some order?"""
    for need, held in sorted(needs):
        if need > free:
            return False
        free += held
    return True


def _busy(budget: ByteBudget) -> ProtocolError:
    return ProtocolError(Kind.OVERLOADED, f"server busy: {budget.in_use / (1 << 20):.1f} MiB of request bodies are "
                                          f"being decoded or read (limit {budget.capacity / (1 << 20):.1f} MiB); "
                                          f"retry later")


def _set(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)
