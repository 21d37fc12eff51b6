"""Every HTTP connection is bounded before a request reaches the app (issue 26, items 10 and 11): the
request head's size and header count (431), the time to send it (408), and the descriptors idle
connections may hold (the oldest idle one is closed for a new client). Real sockets on loopback, small
limits configured for the test."""

from __future__ import annotations

import resource
import socket
import threading
import time

import httpx
import pytest

from attnx.runtime.wire.http_guard import HttpLimits
from conftest_runtime import EXPORT_KW, running_server
from support.cli import subprocess_popen

HEAD = b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n"


@pytest.fixture(scope="module")
def model(exported):
    return exported("maw", **EXPORT_KW).path


@pytest.fixture(scope="module")
def server(model):
    limits = HttpLimits(max_header_bytes=16 << 10, max_headers=50, head_timeout_s=0.5)
    with running_server({"m": model}, http_limits=limits) as s:
        yield s


def answer(sock: socket.socket, timeout: float = 10.0) -> bytes:
    """Everything the server sends until it closes the connection (or ``timeout``)."""
    sock.settimeout(timeout)
    out = b""
    try:
        while chunk := sock.recv(65536):
            out += chunk
    except (ConnectionResetError, socket.timeout):
        pass
    return out


def stream_header(port: int, size: int) -> tuple[int, bytes]:
    """Send one header of ``size`` bytes in 1 MiB writes; (bytes the server took before closing, its answer)."""
    sock = socket.create_connection(("127.0.0.1", port))
    sent = 0
    try:
        sock.sendall(HEAD + b"X-Big: ")
        while sent < size:
            sock.sendall(b"a" * (1 << 20))
            sent += 1 << 20
    except (BrokenPipeError, ConnectionResetError):
        pass
    return sent, answer(sock)


def test_a_huge_header_gets_431_before_it_is_all_sent(server):
    sent, reply = stream_header(server.port, 64 << 20)
    assert reply.startswith(b"HTTP/1.1 431 "), reply[:200]
    assert b"request head over 16384 bytes" in reply
    assert sent < 64 << 20  # the server stopped reading long before the 64 MiB were through
    assert httpx.get(server.url + "/v2/health/live", timeout=10).status_code == 200


def test_concurrent_big_headers_all_get_431_and_the_server_stays_up(server):
    replies: list[bytes] = []
    threads = [threading.Thread(target=lambda: replies.append(stream_header(server.port, 8 << 20)[1]))
               for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(replies) == 16 and all(r.startswith(b"HTTP/1.1 431 ") for r in replies), [r[:40] for r in replies]
    assert httpx.get(server.url + "/v2/health/live", timeout=10).status_code == 200


def test_too_many_headers_get_431(server):
    for count in (51, 20_000):
        sock = socket.create_connection(("127.0.0.1", server.port))
        try:
            sock.sendall(HEAD + b"".join(b"x-%d: y\r\n" % i for i in range(count)) + b"\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        reply = answer(sock)
        assert reply.startswith(b"HTTP/1.1 431 "), (count, reply[:200])
    ok = httpx.get(server.url + "/v2/health/live", headers={f"x-{i}": "y" for i in range(40)}, timeout=10)
    assert ok.status_code == 200  # under the limits: served as ever


def test_a_head_that_never_completes_gets_408_and_is_closed(server):
    silent = socket.create_connection(("127.0.0.1", server.port))  # connects, sends nothing
    partial = socket.create_connection(("127.0.0.1", server.port))
    partial.sendall(HEAD)  # no blank line: the head never ends
    for sock in (silent, partial):
        reply = answer(sock, timeout=30)
        assert reply.startswith(b"HTTP/1.1 408 "), reply[:200]
        assert b"not received within 0.5 s" in reply
    # A slow body is not a slow head: a request whose head arrived is served whatever its pace.
    sock = socket.create_connection(("127.0.0.1", server.port))
    first, rest = b'{"inputs":', b" 5}" + b" " * 7
    sock.sendall(b"POST /v2/models/m/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (len(first + rest))
                 + first)
    time.sleep(1.0)  # past the head timeout
    sock.sendall(rest)
    assert answer(sock, timeout=30).startswith(b"HTTP/1.1 400 ")


def test_a_big_body_answered_early_then_the_next_request_on_the_connection_is_no_head_overflow(server):
    """A request refused before its body is read (404 here, a full queue alike) leaves the body to drain; the
    reads that end it and start the next head are body bytes, not head bytes."""
    body = b'{"inputs": [' + b" " * (1 << 20) + b"]}"
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(b"POST /v2/models/nope/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body)
                 + body[:10])
    sock.settimeout(30)
    first = b""
    while b"unknown model" not in first:  # answered while nearly all of its body is still to come
        first += sock.recv(65536)
    assert first.startswith(b"HTTP/1.1 404 "), first[:200]
    sock.sendall(body[10:] + b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n")  # the next head, in part
    time.sleep(0.2)
    sock.sendall(b"Connection: close\r\n\r\n")
    rest = answer(sock, timeout=30)
    assert rest.startswith(b"HTTP/1.1 200 OK"), rest[:300]


def test_the_defaults_bound_a_64_kib_head(model):
    limits = HttpLimits()
    assert (limits.max_header_bytes, limits.max_headers, limits.head_timeout_s) == (64 << 10, 100, 10.0)
    with running_server({"m": model}) as srv:  # what `attnx serve` runs with
        assert stream_header(srv.port, 1 << 20)[1].startswith(b"HTTP/1.1 431 ")
        sock = socket.create_connection(("127.0.0.1", srv.port))
        sock.sendall(HEAD + b"".join(b"x-%d: y\r\n" % i for i in range(101)) + b"\r\n")
        assert answer(sock).startswith(b"HTTP/1.1 431 ")
        ok = httpx.get(srv.url + "/v2/health/live", headers={"x-big": "a" * 60_000}, timeout=10)
        assert ok.status_code == 200
    for bad in ({"max_header_bytes": 0}, {"max_headers": -1}, {"head_timeout_s": 0}):
        with pytest.raises(ValueError):
            HttpLimits(**bad)


def _low_fd_limit():
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))


def test_silent_clients_past_the_descriptor_limit_do_not_lock_out_new_ones(model, tmp_path):
    """300 clients that send half a head and go silent, against a server with ``ulimit -n 256`` and a
    head timeout far longer than the test: a new client is still served."""
    proc = subprocess_popen("serve", f"m={model}", "--port", "0", "--head-timeout-s", "600", "--threads", "1",
                            env={"ATTNX_WORKDIR": str(tmp_path)}, stdout=None, preexec_fn=_low_fd_limit)
    slow: list[socket.socket] = []
    try:
        url = None
        for line in proc.stderr:
            if line.startswith("listening on "):
                url = line.split()[-1]
                break
        assert url, "the server did not start"
        port = int(url.rsplit(":", 1)[1])
        for _ in range(300):
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            sock.sendall(HEAD)
            slow.append(sock)
        for _ in range(3):
            assert httpx.get(url + "/v2/health/live", timeout=10).status_code == 200
        closed = 0
        for sock in slow:
            sock.setblocking(False)
            try:
                closed += sock.recv(1) == b""
            except BlockingIOError:
                pass
            except ConnectionResetError:
                closed += 1
        assert closed > 0  # the oldest silent ones made room
    finally:
        for sock in slow:
            sock.close()
        proc.terminate()
        proc.wait(60)
