"""What ``bench_hostile_requests.py`` attacks with and measures by: the ``attnx serve`` process (its process
group's RSS and CPU time, an RSS watchdog that kills it past a limit, restarts), the health probe, a raw-socket
HTTP client that records when its last byte left (bodies sent in slices, or trickled, an early answer stopping
the upload) and TEI gRPC stubs generated from the project's ``tei.proto``.

Not a benchmark itself; the script imports it as ``_hostile`` (its own folder is on ``sys.path``).
Every wait here is bounded; traffic goes to 127.0.0.1 only.
"""

from __future__ import annotations

import http.client
import importlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np

HOST = "127.0.0.1"
PAGE_MB = os.sysconf("SC_PAGE_SIZE") / 2**20
TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------- the server


def group_stats(pgid: int) -> tuple[float, float, float]:
    """``(RSS MB of the group's leader, RSS MB of the whole group, CPU seconds of the whole group)``: the
    server and the worker processes it started (template rendering)."""
    leader = total = cpu = 0.0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
        if int(fields[2]) != pgid:
            continue
        rss = int(fields[21]) * PAGE_MB
        total += rss
        cpu += (int(fields[11]) + int(fields[12])) * TICK_S
        if int(entry.name) == pgid:
            leader = rss
    return leader, total, cpu


class Server:
    """``python -m attnx.cli.main serve`` in its own process group, with a watchdog thread that samples its RSS
    every 0.1 s (``peak`` since :meth:`reset_peak`) and kills the group past ``rss_limit_mb``."""

    def __init__(self, models: dict[str, Path], log: Path, rss_limit_mb: float):
        self.models, self.log, self.rss_limit_mb = models, log, rss_limit_mb
        self.proc: subprocess.Popen | None = None
        self.port = self.grpc_port = 0
        self.peak = 0.0
        self.killed_for_rss = False
        self.restarts = -1

    @property
    def argv(self) -> list[str]:
        return [sys.executable, "-m", "attnx.cli.main", "serve", *(f"{k}={v}" for k, v in self.models.items()),
                "--port", str(self.port), "--grpc-port", str(self.grpc_port)]

    def start(self, timeout_s: float = 300.0) -> None:
        self.port, self.grpc_port = free_port(), free_port()
        self.killed_for_rss, self.restarts = False, self.restarts + 1
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=log, start_new_session=True)
        proc = self.proc
        threading.Thread(target=self._watch, args=(proc,), daemon=True).start()
        deadline = time.monotonic() + timeout_s
        while True:
            answer = exchange(self.port, "POST", "/v1/embeddings", b'{"model": "minilm", "input": "warm up"}',
                              deadline=time.perf_counter() + 30)
            if answer.status == "200":
                return
            if time.monotonic() > deadline or proc.poll() is not None:
                tail = self.log.read_text(errors="replace")[-2000:]
                raise SystemExit(f"the server did not start:\n{tail}")
            time.sleep(0.5)

    def _watch(self, proc: subprocess.Popen) -> None:
        while proc.poll() is None:
            try:
                leader, total, _ = group_stats(proc.pid)
            except (OSError, ValueError, IndexError):
                leader = total = 0.0
            self.peak = max(self.peak, leader)
            if total > self.rss_limit_mb:
                self.killed_for_rss = True
                self._kill(proc, signal.SIGKILL)
                return
            time.sleep(0.1)

    @staticmethod
    def _kill(proc: subprocess.Popen, sig: int) -> None:
        try:
            os.killpg(proc.pid, sig)  # the group this script started: the server and its workers
        except ProcessLookupError:
            pass

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def rss_mb(self) -> float:
        return group_stats(self.proc.pid)[0] if self.alive() else float("nan")

    def cpu_s(self) -> float:
        return group_stats(self.proc.pid)[2] if self.alive() else float("nan")

    def reset_peak(self) -> None:
        self.peak = self.rss_mb()

    def settled(self, within_s: float) -> bool:
        """Whether the server goes idle (under 20% of a core over 0.5 s) within ``within_s``: a refused request
        whose work goes on in the background would otherwise be charged to the next case."""
        deadline = time.monotonic() + within_s
        while self.alive() and time.monotonic() < deadline:
            before = self.cpu_s()
            time.sleep(0.5)
            if self.cpu_s() - before < 0.1:
                return True
        return False

    def stop(self) -> None:
        if self.proc is None:
            return
        self._kill(self.proc, signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self._kill(self.proc, signal.SIGKILL)
            self.proc.wait(20)
        self._kill(self.proc, signal.SIGKILL)  # workers left behind


# ----------------------------------------------------------------------------- the health probe


class Probe(threading.Thread):
    """``GET /v2/health/live`` on a new connection every 20 ms, as a Kubernetes probe does, with its 1 s timeout:
    ``(start, seconds, ok)`` of each (a failed probe counts as the time it took to fail)."""

    TIMEOUT_S = 1.0

    def __init__(self, server: Server):
        super().__init__(daemon=True)
        self.server, self.samples, self.stop = server, [], threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            started = time.perf_counter()
            ok = False
            try:
                c = http.client.HTTPConnection(HOST, self.server.port, timeout=self.TIMEOUT_S)
                c.request("GET", "/v2/health/live")
                ok = c.getresponse().status == 200
                c.close()
            except (OSError, http.client.HTTPException):
                pass
            self.samples.append((started, time.perf_counter() - started, ok))
            time.sleep(0.02)

    def during(self, start: float, end: float) -> tuple[np.ndarray, int, float]:
        """``(milliseconds of the probes started in [start, end], failed probes, longest stretch in seconds
        without a probe answered)``."""
        window = [(t, s, ok) for t, s, ok in list(self.samples) if start <= t <= end]
        ms = np.array([s for _, s, _ in window]) * 1000
        answered = [start] + [t + s for t, s, ok in window if ok] + [end]
        return ms, sum(not ok for *_, ok in window), float(np.diff(sorted(answered)).max())


# ----------------------------------------------------------------------------- one HTTP exchange


@dataclass
class Answer:
    """What one request got. ``status``: the HTTP status, a gRPC code name, ``none`` (no answer before the
    bench gave up) or the client's error; times are ``time.perf_counter()``."""

    started: float = 0.0
    last_byte: float = 0.0
    answered: float | None = None
    status: str = "none"
    message: str = ""
    sent: int = 0

    @property
    def latency(self) -> float:
        return (self.answered if self.answered is not None else time.perf_counter()) - self.started

    @property
    def after_last_byte(self) -> float | None:
        return None if self.answered is None else max(0.0, self.answered - self.last_byte)


def head(method: str, path: str, length: int | None = None, chunked: bool = False) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: {HOST}", "Content-Type: application/json", "Connection: close"]
    if chunked:
        lines.append("Transfer-Encoding: chunked")
    elif length is not None:
        lines.append(f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def one_line(body: bytes) -> str:
    """The error's message (OpenAI's ``error.message``, FastAPI's ``detail``, KServe's ``error``) or the body's
    start; a message of several lines keeps its line breaks as ``\\n`` so that they show."""
    try:
        obj = json.loads(body)
        err = obj.get("error", obj.get("detail", obj.get("message"))) if isinstance(obj, dict) else None
        text = err.get("message", json.dumps(err)) if isinstance(err, dict) else err
        text = text if isinstance(text, str) else f"ok ({len(body)} bytes)"
    except (ValueError, UnicodeDecodeError):
        text = body[:200].decode(errors="replace")
    return text.replace("\n", "\\n")


def exchange(port: int, method: str, path: str, body: bytes = b"", *, deadline: float,
             pieces: Iterable[tuple[bytes, float]] | None = None, chunked: bool = False,
             length: int | None = None, answer_s: float | None = None, answer: Answer | None = None) -> Answer:
    """Send a request and read its answer by ``deadline``. The body goes in 1 MiB slices, or as ``pieces``
    (``(bytes, seconds to wait before them)``: a trickle); an answer arriving meanwhile stops the upload.
    ``answer_s``: after the last byte wait at most this long for the answer. Pass ``answer`` to watch it while
    the request runs."""
    answer = answer or Answer()
    answer.started = time.perf_counter()
    answer.last_byte = answer.started
    if pieces is None:
        pieces = [(body[i:i + (1 << 20)], 0.0) for i in range(0, len(body), 1 << 20)]
        length = len(body)
    try:
        sock = socket.create_connection((HOST, port), timeout=max(0.1, deadline - time.perf_counter()))
    except OSError as e:
        answer.status, answer.answered = type(e).__name__, None
        return answer
    try:
        try:
            sock.sendall(head(method, path, length, chunked))
            answer.last_byte = time.perf_counter()
            for data, pause in pieces:
                if select.select([sock], [], [], pause)[0] or time.perf_counter() > deadline:
                    break  # answered (or closed) before the body was all sent
                sock.settimeout(max(0.1, deadline - time.perf_counter()))
                sock.sendall(data)
                answer.last_byte, answer.sent = time.perf_counter(), answer.sent + len(data)
        except OSError:
            pass  # the server stopped reading: its answer may still be there
        until = deadline if answer_s is None else min(deadline, answer.last_byte + answer_s)
        try:
            sock.settimeout(max(0.05, until - time.perf_counter()))
            response = http.client.HTTPResponse(sock)
            response.begin()
            answer.answered, answer.status = time.perf_counter(), str(response.status)
            answer.message = one_line(response.read())
        except TimeoutError:
            answer.status, answer.message = "none", "(no answer: the bench stopped waiting)"
        except (OSError, http.client.HTTPException) as e:
            answer.status = "closed" if isinstance(e, http.client.RemoteDisconnected) else type(e).__name__
    finally:
        sock.close()
    return answer


# ----------------------------------------------------------------------------- TEI gRPC


def tei_stubs(out: Path):
    """``(tei_pb2, tei_pb2_grpc)`` generated by protoc from the ``tei.proto`` the server serves, as a TEI user
    makes them."""
    from grpc_tools import protoc

    proto = Path(__file__).resolve().parents[1] / "runtime" / "apis" / "tei.proto"
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(proto, out / "tei.proto")
    if protoc.main(["protoc", f"-I{out}", f"--python_out={out}", f"--grpc_python_out={out}", "tei.proto"]) != 0:
        raise SystemExit(f"protoc could not compile {proto}")
    sys.path.insert(0, str(out))
    try:
        return importlib.import_module("tei_pb2"), importlib.import_module("tei_pb2_grpc")
    finally:
        sys.path.remove(str(out))


def grpc_call(call, deadline: float, answer: Answer | None = None) -> Answer:
    """Run ``call(timeout)`` (a gRPC call; a stream is read to its end) into an :class:`Answer`: ``OK`` or the
    status code's name and its details. A stream's request iterator sets ``last_byte`` itself."""
    import grpc

    answer = answer or Answer(started=time.perf_counter())
    answer.started = answer.last_byte = answer.started or time.perf_counter()
    try:
        result = call(max(0.1, deadline - time.perf_counter()))
        if not hasattr(result, "ByteSize"):  # a response stream
            result = list(result)
        answer.status, answer.message = "OK", f"ok ({len(result) if isinstance(result, list) else 1} answers)"
    except grpc.RpcError as e:
        answer.status = e.code().name if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED else "none"
        answer.message = (e.details() or "").replace("\n", "\\n") if answer.status != "none" else \
            "(no answer: the bench's deadline passed)"
    if answer.status != "none":
        answer.answered = time.perf_counter()
    return answer
