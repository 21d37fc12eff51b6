"""Bounds on HTTP connections before a request reaches the app: header size and count, idle heads, file descriptors.

uvicorn's fast parser (``httptools``) takes headers of any size and count and waits forever for a head that never
completes; its ``h11`` parser bounds the head's bytes (``h11_max_incomplete_event_size``) but answers 400 and has no
head timeout either. So the server runs uvicorn's own ``HttpToolsProtocol`` with these additions
(:class:`HttpLimits`, ``attnx serve --max-header-kb / --max-headers / --head-timeout-s``):

- a request head (request line and headers) over ``max_header_bytes``, or with more than ``max_headers`` headers,
  gets **431** (Request Header Fields Too Large, as Triton and h11 mean it) and the connection closes; bytes are
  counted as they arrive, so a 64 MiB header is never buffered whole;
- a connection that has not sent a complete head within ``head_timeout_s`` of opening (or of its next request's
  first byte) gets **408** and is closed; between requests uvicorn's keep-alive timeout applies;
- when file descriptors run low (fewer than ``fd_reserve`` left under ``RLIMIT_NOFILE``), each new connection first
  closes the oldest connection that is idle (no request in progress: waiting for a head, or kept alive), so slow or
  silent clients cannot lock new ones out.

Without ``httptools`` uvicorn's ``h11`` is used with its head-size bound (a 400 there, no timeout).
"""

from __future__ import annotations

import json
import logging
import os
import resource
from dataclasses import dataclass
from typing import TYPE_CHECKING

log = logging.getLogger("attnx.serve")


@dataclass(frozen=True)
class HttpLimits:
    """Per-connection bounds (see the module doc). Defaults: 64 KiB and 100 headers per head (Apache's
    ``LimitRequestFields``), 10 s to send a head, 64 descriptors kept free."""

    max_header_bytes: int = 64 << 10
    max_headers: int = 100
    head_timeout_s: float = 10.0
    fd_reserve: int = 64

    def __post_init__(self) -> None:
        for name in ("max_header_bytes", "max_headers", "fd_reserve"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not self.head_timeout_s > 0:
            raise ValueError(f"head_timeout_s must be > 0, got {self.head_timeout_s!r}")


def _response(status: bytes, message: str) -> bytes:
    body = message.encode()
    return (b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)


_TOO_LARGE = b"431 Request Header Fields Too Large"
_TIMEOUT = b"408 Request Timeout"
_BUSY = b"503 Service Unavailable"


def _open_fds() -> int | None:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return None


if TYPE_CHECKING:  # the guard is written against this base (mypy reads it as the only one)
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    _HAS_HTTPTOOLS = True
else:
    try:  # uvicorn's fast parser (the ``serve`` extra installs it)
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        _HAS_HTTPTOOLS = True
    except ImportError:  # uvicorn's h11 then, with its own head-size bound (see the module doc)
        HttpToolsProtocol, _HAS_HTTPTOOLS = object, False


def protocol_class(limits: HttpLimits) -> type | str:
    """The uvicorn HTTP protocol class (``uvicorn.Config(http=...)``) enforcing ``limits``."""
    if not _HAS_HTTPTOOLS:
        return "h11"
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return type("GuardedHttpToolsProtocol", (_Guarded,), {"limits": limits, "soft": soft,
                                                           "shed_warned": [float("-inf")]})


class _Guarded(HttpToolsProtocol):
    """uvicorn's ``HttpToolsProtocol`` with the bounds of :class:`HttpLimits` (``limits``, set per server)."""

    limits: HttpLimits
    soft: int  # RLIMIT_NOFILE when the server was made
    shed_warned: list  # when the last "descriptors low" line was logged

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._in_head = False  # between a request's first byte and the end of its headers
        self._head_read = 0  # bytes read while the head was incomplete (bounds what the parser buffers)
        self._head_parsed = 0  # bytes of request line and headers the parser handed over (exact)
        self._header_count = 0
        self._refused = False
        self._why = ""
        self._head_timer = None
        self._opened = self.loop.time()

    # --- connections ------------------------------------------------------------
    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_head_timer()
        self._shed_if_short_of_fds()

    def connection_lost(self, exc) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)

    def _idle(self) -> bool:
        return not self._refused and (self.cycle is None or self.cycle.response_complete) and not self.pipeline

    def _shed_if_short_of_fds(self) -> None:
        """With fewer than ``fd_reserve`` descriptors left, close the oldest idle connection (never one
        with a request in progress); with none idle, refuse this one (503)."""
        soft = self.soft
        if soft == resource.RLIM_INFINITY or len(self.connections) < (soft - self.limits.fd_reserve) // 2:
            return  # far from the limit: not worth listing /proc/self/fd
        used = _open_fds()
        if used is None or soft - used >= self.limits.fd_reserve:
            return
        idle = [c for c in self.connections if c is not self and isinstance(c, _Guarded)
                and c._idle() and not c.transport.is_closing()]
        if not idle:
            self._refuse(_BUSY, "server busy: too many open connections; retry later")
            return
        oldest = min(idle, key=lambda c: c._opened)
        now = self.loop.time()
        if now - self.shed_warned[0] > 10:  # at most one line per 10 s, however many are closed
            self.shed_warned[0] = now
            log.warning("file descriptors low (%d of %d in use): closing the oldest idle connections", used, soft)
        oldest.transport.close()

    # --- the head timer -----------------------------------------------------------
    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.limits.head_timeout_s, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._idle() and not self.transport.is_closing():
            self._refuse(_TIMEOUT, f"request head not received within {self.limits.head_timeout_s:g} s")

    # --- parser callbacks -----------------------------------------------------------
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head, self._head_read, self._head_parsed, self._header_count = True, 0, 0, 0
        self._arm_head_timer()

    def _over(self, why: str) -> None:
        self._refused = True  # answered by data_received once the parser returns; nothing more is run
        self._why = why

    def on_url(self, url: bytes) -> None:
        if self._refused:
            return
        self._head_parsed += len(url)
        if self._head_parsed > self.limits.max_header_bytes:
            return self._over(f"request head over {self.limits.max_header_bytes} bytes")
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._refused:
            return
        self._header_count += 1
        self._head_parsed += len(name) + len(value) + 4  # "name: value\r\n"
        if self._header_count > self.limits.max_headers:
            return self._over(f"more than {self.limits.max_headers} request headers")
        if self._head_parsed > self.limits.max_header_bytes:
            return self._over(f"request head over {self.limits.max_header_bytes} bytes")
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._disarm_head_timer()
        if not self._refused:
            super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if not self._refused:
            super().on_message_complete()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # its answer is on the way; nothing more is read
        in_head = self._in_head
        super().data_received(data)
        if self._refused:
            self._refuse(_TOO_LARGE, self._why)
        elif self._in_head and in_head:
            # A read that began and ended inside one head is all head: counted per read, so a huge header
            # never sits in the parser's buffer (a read that ends a body and starts a head is not counted;
            # the parsed headers are, in on_header).
            self._head_read += len(data)
            if self._head_read > self.limits.max_header_bytes:
                self._refuse(_TOO_LARGE, f"request head over {self.limits.max_header_bytes} bytes")

    def _refuse(self, status: bytes, message: str) -> None:
        self._refused = True
        self._disarm_head_timer()
        if not self.transport.is_closing():
            self.transport.write(_response(status, json.dumps({"error": message})))
            self.transport.close()

