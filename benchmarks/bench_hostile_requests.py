"""Health probes while `attnx serve` refuses hostile requests (issue 32): nothing heavy on the event loop.

One ``attnx serve`` subprocess serves the real all-MiniLM-L6-v2 and a tiny random Llama with-past export whose
chat template turns hostile on request (nested ``range(100000)`` loops). A probe in this process opens a new
connection for ``GET /v2/health/live`` every 20 ms, as a Kubernetes probe does, while one request at a time is
sent and refused (or answered): a 3 MB prompt to ``/v1/completions`` and to ``/v1/chat/completions``, a 20 MB
string to ``/v1/embeddings``, a 63 MiB body (one string, truncation off) and the looping template. Printed per
case: the answer's status and time, the probe's p50/p99/max during it, and the server's RSS before and after
(``/proc/PID/status``). Before issue 32 the 3 MB prompt took 29 s with no probe answered, the 20 MB string got no
answer in 300 s (RSS 441 MB -> 3.5 GB) and the looping template hung the server for good.

    .venv/bin/python benchmarks/bench_hostile_requests.py [--idle-s 3]

Linux only (``/proc``). Needs nothing but the CPU.
"""

from __future__ import annotations

import argparse
import http.client
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import hf_folders  # noqa: E402  (random-weight folders with a trained tokenizer, as the tests make them)

LOOPING = ("{%- if messages[-1]['content'] == 'loop' %}{% for i in range(100000) %}{% for j in range(100000) %}"
           "{% endfor %}{% endfor %}{%- else %}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
           "{% endfor %}<assistant>{%- endif %}")


def models(root: Path) -> dict[str, Path]:
    from attnx.export.pretrained import export_pretrained
    from attnx.pretrained import minilm_path

    llama = hf_folders.make_folder("llama", root / "folders")
    cfg = json.loads((llama / "tokenizer_config.json").read_text())
    (llama / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": LOOPING}))
    return {"minilm": export_pretrained(minilm_path(), root / "minilm" / "minilm.onnx").path,
            "llm": export_pretrained(llama, root / "llm" / "model.onnx", with_past=True).path}


class Probe(threading.Thread):
    """``GET /v2/health/live`` on a new connection every 20 ms; (start time, seconds) of each."""

    def __init__(self, port: int):
        super().__init__(daemon=True)
        self.port, self.samples, self.stop = port, [], threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            started = time.perf_counter()
            c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
            c.request("GET", "/v2/health/live")
            c.getresponse().read()
            c.close()
            self.samples.append((started, time.perf_counter() - started))
            time.sleep(0.02)

    def during(self, start: float, end: float) -> np.ndarray:
        return np.array([s for t, s in self.samples if start <= t <= end]) * 1000


def post(port: int, path: str, body: bytes) -> tuple[int, float]:
    started = time.perf_counter()
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    c.request("POST", path, body, {"Content-Type": "application/json"})
    status = c.getresponse()
    status.read()
    c.close()
    return status.status, time.perf_counter() - started


def rss_mb(pid: int) -> float:
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("VmRSS"))
    return int(line.split()[1]) / 1024


def cases() -> dict[str, tuple[str, bytes]]:
    three_mb = "the cat sat on the mat " * 140_000
    return {
        "3 MB prompt, /v1/completions": ("/v1/completions", json.dumps({"model": "llm", "prompt": three_mb}).encode()),
        "3 MB message, /v1/chat/completions": ("/v1/chat/completions", json.dumps(
            {"model": "llm", "messages": [{"role": "user", "content": three_mb}]}).encode()),
        "20 MB string, /v1/embeddings": ("/v1/embeddings", json.dumps(
            {"model": "minilm", "input": ("word " * 4_000_000)}).encode()),
        "63 MiB string, truncate off": ("/v1/embeddings", json.dumps(
            {"model": "minilm", "input": "x" * (63 << 20), "truncate": False}).encode()),
        "looping chat template": ("/v1/chat/completions", json.dumps(
            {"model": "llm", "max_tokens": 2, "messages": [{"role": "user", "content": "loop"}]}).encode()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--idle-s", type=float, default=3.0)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="attnx-hostile-"))
    try:
        paths = models(root)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = subprocess.Popen([sys.executable, "-m", "attnx.cli.main", "serve", *(f"{k}={v}" for k, v in
                                                                                        paths.items()),
                                   "--port", str(port)], stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 300
            while True:
                try:
                    post(port, "/v1/embeddings", b'{"model": "minilm", "input": "warm up"}')
                    break
                except OSError:
                    if time.monotonic() > deadline or server.poll() is not None:
                        raise SystemExit("the server did not start")
                    time.sleep(0.5)
            probe = Probe(port)
            probe.start()
            rows = []
            start = time.perf_counter()
            time.sleep(args.idle_s)
            idle = rss_mb(server.pid)
            rows.append(("idle", "-", args.idle_s, probe.during(start, time.perf_counter()), idle, idle))
            for name, (path, body) in cases().items():
                before = rss_mb(server.pid)
                start = time.perf_counter()
                status, seconds = post(port, path, body)
                probes = probe.during(start, time.perf_counter())
                time.sleep(1.0)
                rows.append((name, status, seconds, probes, before, rss_mb(server.pid)))
            probe.stop.set()
            print(f"{'case':38} {'status':>6} {'answer s':>9} {'probes':>6} {'p50 ms':>7} {'p99 ms':>7} "
                  f"{'max ms':>7} {'RSS MB before -> 1 s after':>27}")
            for name, status, seconds, probes, before, after in rows:
                p50, p99, top = (np.percentile(probes, 50), np.percentile(probes, 99), probes.max()) \
                    if probes.size else (float("nan"),) * 3
                print(f"{name:38} {status!s:>6} {seconds:9.2f} {probes.size:6d} {p50:7.1f} {p99:7.1f} {top:7.1f} "
                      f"{before:12.0f} -> {after:8.0f}")
        finally:
            server.terminate()
            server.wait(60)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
