"""Bytes charged as they arrive (issue 45, item 1): the byte budget's shares, its small-body reserve and its
banker's rule (runtime/wire/budget.py), and over real sockets: a body trickled a byte at a time holds only what
it sent, never the budget, its neighbours are answered meanwhile, and it ends in a 408 past the body deadline."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import numpy as np
import pytest

from attnx.runtime.wire.budget import ByteBudget
from attnx.runtime.wire.errors import Kind, ProtocolError
from attnx.runtime.wire.limits import Limits
from conftest_runtime import running_server
from support import exports

MiB = 1 << 20


def run(coro):
    return asyncio.run(coro)


# --- the budget alone ---------------------------------------------------------------------------------------

def test_a_share_is_charged_what_arrived_not_what_was_declared():
    async def main():
        budget = ByteBudget(64 * MiB)
        trickler = budget.share(64 * MiB)
        await trickler.take(10, 1.0)
        assert budget.in_use == 10 and trickler.held == 10
        neighbour = budget.share(40 * MiB)
        for _ in range(40):  # a 40 MiB neighbour reads its whole body beside the 64 MiB declaration
            await neighbour.take(MiB, 0.01)
        assert budget.in_use == 40 * MiB + 10
        neighbour.release()
        trickler.release()
        assert budget.in_use == 0 and budget.big_in_use == 0 and budget.small_in_use == 0

    run(main())


def test_small_bodies_have_their_own_reserve_and_never_wait_behind_big_ones():
    async def main():
        budget = ByteBudget(8 * MiB, small_body=MiB, reserve=4 * MiB)
        big = budget.share(8 * MiB)
        for _ in range(8):
            await big.take(MiB, 0.01)
        assert budget.big_in_use == 8 * MiB  # the budget for big bodies is full
        other_big = budget.share(2 * MiB)
        with pytest.raises(ProtocolError) as info:
            await other_big.take(64 << 10, 0.05)
        assert info.value.kind == Kind.OVERLOADED and "request bodies are being decoded" in info.value.message
        smalls = [budget.share(1000) for _ in range(4)]
        for s in smalls:
            await s.take(1000, 0.0)  # no wait at all: granted on the spot
        assert budget.small_in_use == 4000
        chunked = budget.share(None)  # a chunked body's first bytes are small too
        await chunked.take(512 << 10, 0.0)
        assert chunked.small == 512 << 10 and chunked.big == 0
        for s in [big, other_big, chunked, *smalls]:
            s.release()
        assert budget.in_use == 0

    run(main())


def test_two_bodies_that_cannot_both_fit_never_deadlock_half_read():
    """Declared 6 and 6 MiB in a budget of 8: read in turns, chunk by chunk. Charged blindly, both would stall at
    4 MiB each, waiting for each other until refused; the banker's rule lets the second wait while the first reads
    on, and both finish."""

    async def main():
        budget = ByteBudget(8 * MiB, small_body=0, reserve=0)
        order: list[str] = []

        async def upload(name: str, share):
            for _ in range(6):
                await share.take(MiB, 5.0)
                order.append(name)
                await asyncio.sleep(0)
            await asyncio.sleep(0.01)  # decoding
            share.release()
            return name

        a, b = budget.share(6 * MiB), budget.share(6 * MiB)
        done = await asyncio.gather(upload("a", a), upload("b", b))
        assert done == ["a", "b"] and len(order) == 12
        assert budget.in_use == 0

    run(main())


def test_two_33_mib_uploads_and_a_tiny_neighbour():
    """The issue's case: two honest 33 MiB uploads in the default 64 MiB budget, read in turns; a 1 KB body
    beside them is granted at once, whatever they hold."""

    async def main():
        budget = ByteBudget(64 * MiB)
        uploads = [budget.share(33 * MiB), budget.share(33 * MiB)]
        progress = [0, 0]

        async def upload(i):
            while progress[i] < 33 * MiB:
                await uploads[i].take(MiB, 10.0)
                progress[i] += MiB
                await asyncio.sleep(0)
            await asyncio.sleep(0.01)
            uploads[i].release()

        tasks = [asyncio.ensure_future(upload(i)) for i in (0, 1)]
        granted_at_once = 0
        while not all(t.done() for t in tasks):
            tiny = budget.share(1000)
            await tiny.take(1000, 0.0)  # a wait of 0: refused unless granted on the spot
            granted_at_once += 1
            tiny.release()
            await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        assert progress == [33 * MiB, 33 * MiB] and granted_at_once > 0 and budget.in_use == 0

    run(main())


def test_a_grpc_message_already_held_is_charged_at_once_without_waiting():
    async def main():
        budget = ByteBudget(4 * MiB, small_body=0, reserve=0)
        async with budget.held(10 * MiB):  # over the budget: it is in memory already, refusing frees nothing
            assert budget.in_use == 10 * MiB
            http_body = budget.share(MiB)
            with pytest.raises(ProtocolError):
                await http_body.take(MiB, 0.05)  # the memory is really held: a big HTTP body waits
            http_body.release()
        assert budget.in_use == 0

    run(main())


def test_the_body_deadline_grows_with_the_bytes_received():
    limits = Limits(body_timeout_s=2.0, min_body_rate=1000)
    assert limits.body_deadline(100.0, 0) == 102.0
    assert limits.body_deadline(100.0, 5000) == 107.0
    assert Limits(body_timeout_s=2.0, min_body_rate=None).body_deadline(100.0, 10 ** 9) == 102.0
    with pytest.raises(ValueError, match="body_timeout_s"):
        Limits(body_timeout_s=0)


# --- over real sockets ------------------------------------------------------------------------------------------

TEXT = "Two dogs play in the snow near a frozen lake this morning."


@pytest.fixture(scope="module")
def server():
    limits = Limits(body_timeout_s=4.0, min_body_rate=64 << 10)  # a trickler at a few bytes/s is late in 4 s
    with running_server({"minilm": exports.minilm().path}, limits=limits) as s:
        yield s


def trickle(port: int, path: str, declared: int | None, stop: threading.Event, sent: list[int]) -> bytes:
    """A POST that declares ``declared`` bytes (None: chunked) and sends one byte every 50 ms until the server
    answers (or ``stop``); the server's answer."""
    sock = socket.create_connection(("127.0.0.1", port))
    length = f"Content-Length: {declared}" if declared is not None else "Transfer-Encoding: chunked"
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{length}\r\n\r\n".encode())
    sock.settimeout(0.05)
    reply = b""
    try:
        while not stop.is_set():
            sock.sendall(b"[" if declared is not None else b"1\r\n[\r\n")
            sent[0] += 1
            try:
                if chunk := sock.recv(65536):
                    reply += chunk
                    sock.settimeout(2.0)
                    while chunk := sock.recv(65536):
                        reply += chunk
                    break
            except socket.timeout:
                pass
    except (BrokenPipeError, ConnectionResetError, socket.timeout):
        pass
    finally:
        sock.close()
    return reply


@pytest.mark.parametrize("declared", [64 << 20, None], ids=["declared-64MiB", "chunked"])
def test_a_trickled_body_holds_no_budget_its_neighbours_are_answered_and_it_gets_408(server, declared):
    stop, sent, replies = threading.Event(), [0], []
    thread = threading.Thread(target=lambda: replies.append(
        trickle(server.port, "/v1/embeddings", declared, stop, sent)))
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while sent[0] < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.budget.in_use < 1000  # what it sent, not what it declared
        r = httpx.post(f"{server.url}/v1/embeddings", json={"input": [TEXT, "Hi"]}, timeout=30)
        assert thread.is_alive()  # answered while the trickler was still sending
        assert r.status_code == 200, r.text
        alone = httpx.post(f"{server.url}/v1/embeddings", json={"input": TEXT}, timeout=30).json()
        np.testing.assert_allclose(r.json()["data"][0]["embedding"], alone["data"][0]["embedding"], atol=1e-5)
        assert abs(np.linalg.norm(r.json()["data"][1]["embedding"]) - 1) < 1e-4
    finally:
        thread.join(30)
        stop.set()
    (reply,) = replies
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 "), reply[:300]
    assert b"connection: close" in head.lower()
    error = json.loads(body)["error"]
    assert error["code"] == "request_timeout" and "--body-timeout-s" in error["message"], error
    assert "\n" not in error["message"]
    assert server.budget.in_use == 0
    assert httpx.get(f"{server.url}/v2/health/live", timeout=10).status_code == 200


def test_an_honest_body_sent_in_pieces_within_its_rate_is_answered(server):
    """Sent chunked in 4 pieces 0.25 s apart (well inside its 4 s): answered, not cut off."""
    body = json.dumps({"input": [TEXT] * 3}).encode()
    pieces = [body[j * len(body) // 4:(j + 1) * len(body) // 4] for j in range(4)]

    def slow():
        for j, piece in enumerate(pieces):
            if j:
                time.sleep(0.25)
            yield piece

    r = httpx.post(f"{server.url}/v1/embeddings", content=slow(), headers={"Content-Type": "application/json"},
                   timeout=30)
    assert r.status_code == 200, r.text
    assert len(r.json()["data"]) == 3
