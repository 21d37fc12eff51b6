"""The server under JSON and binary load: health-probe latency, how fast overload is refused, and peak
memory per MB of JSON body (issue 15, items 4 and 5).

One script run measures everything against servers it starts (``attnx serve`` subprocesses, so the
load generator's own Python does not share the server's GIL):

1. **Health under load.** 40 clients (two load processes x 20 threads) send ~250 KB bodies in a
   closed loop to a server with the default queue; a probe in this process opens a new connection
   for ``GET /v2/health/live`` (and ``/ready``) every 50 ms, as a Kubernetes probe does. Idle, JSON
   and binary load are interleaved in rounds; printed: probe p50/p99 and their ratio to idle.
2. **Overload.** The same 40 clients against a server with ``--max-queue 4``, one request a batch (the queue
   is full nearly all the time): p50/p99 time to the 503, JSON vs binary bodies.
3. **Memory.** A fresh server; its peak RSS (``VmHWM``, reset through ``/proc/PID/clear_refs``) over
   one ~31 MB JSON request, then over six sent at once; printed as MB of peak growth per MB of body.

    .venv/bin/python benchmarks/bench_server_load.py [--seconds 8] [--rounds 2] [--clients 40]
        [--server-cmd "python -m attnx.cli.main"]   # e.g. another build of the server to compare with

Linux only (``/proc``). Needs nothing but the CPU.
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing as mp
import os
import re
import shlex
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np


# ----------------------------------------------------------------------------- the model and bodies


def export_model(folder: Path) -> Path:
    """The maw variant, one layer at d_model 256: cheap compute, so serving overhead shows."""
    from attnx.export import export_variant

    return Path(export_variant("maw", str(folder / "maw.onnx"), overrides={"d_model": 256, "n_heads": 4},
                               n_layers=1).path)


def make_body(rows: int, seq: int, d: int, binary: bool, seed: int = 0) -> tuple[bytes, dict]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, seq, d)).astype(np.float32)
    mask = np.ones((rows, seq), np.int64)
    if not binary:
        inputs = [{"name": "hidden_states", "datatype": "FP32", "shape": list(x.shape), "data": x.ravel().tolist()},
                  {"name": "attention_mask", "datatype": "INT64", "shape": list(mask.shape),
                   "data": mask.ravel().tolist()}]
        return json.dumps({"inputs": inputs}).encode(), {"Content-Type": "application/json"}
    inputs = [{"name": "hidden_states", "datatype": "FP32", "shape": list(x.shape),
               "parameters": {"binary_data_size": x.nbytes}},
              {"name": "attention_mask", "datatype": "INT64", "shape": list(mask.shape),
               "parameters": {"binary_data_size": mask.nbytes}}]
    header = json.dumps({"inputs": inputs, "parameters": {"binary_data_output": True}}).encode()
    return header + x.tobytes() + mask.tobytes(), {"Inference-Header-Content-Length": str(len(header))}


# ----------------------------------------------------------------------------- servers


class Server:
    """``attnx serve`` in a subprocess on a free port."""

    def __init__(self, cmd: list[str], model: Path, *flags: str):
        self.proc = subprocess.Popen([*cmd, "serve", str(model), "--port", "0", *flags],
                                     stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
        for line in self.proc.stderr:
            m = re.search(r"listening on http://([\d.]+):(\d+)", line)
            if m:
                self.host, self.port = m.group(1), int(m.group(2))
                break
        else:
            raise RuntimeError("the server did not start")
        threading.Thread(target=self.proc.stderr.read, daemon=True).start()  # keep the pipe drained

    def rss(self) -> tuple[int, int]:
        """(current RSS, peak RSS since the last reset) in bytes."""
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        get = lambda key: int(re.search(rf"{key}:\s+(\d+) kB", status).group(1)) * 1024  # noqa: E731
        return get("VmRSS"), get("VmHWM")

    def reset_peak(self) -> None:
        Path(f"/proc/{self.proc.pid}/clear_refs").write_text("5")  # VmHWM := VmRSS

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


def post(host: str, port: int, body: bytes, headers: dict, timeout: float = 120) -> tuple[int, float]:
    started = time.perf_counter()
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("POST", "/v2/models/maw/infer", body=body, headers=headers)
        response = conn.getresponse()
        response.read()
        return response.status, time.perf_counter() - started
    finally:
        conn.close()


# ----------------------------------------------------------------------------- load processes


def _load_worker(host, port, body, headers, threads, start_at, seconds, out):
    """One load process: ``threads`` closed-loop clients, each on its own keep-alive connection."""
    stats = {"status": {}, "latency_503": [], "errors": 0}
    lock = threading.Lock()

    def client():
        conn = http.client.HTTPConnection(host, port, timeout=120)
        while time.time() < start_at + seconds:
            t = time.perf_counter()
            try:
                conn.request("POST", "/v2/models/maw/infer", body=body, headers=headers)
                response = conn.getresponse()
                response.read()
                status = response.status
                if response.getheader("connection", "").lower() == "close":
                    conn.close()
                    conn = http.client.HTTPConnection(host, port, timeout=120)
            except (OSError, http.client.HTTPException):
                conn.close()
                conn = http.client.HTTPConnection(host, port, timeout=120)
                with lock:
                    stats["errors"] += 1
                continue
            with lock:
                stats["status"][status] = stats["status"].get(status, 0) + 1
                if status == 503:
                    stats["latency_503"].append(time.perf_counter() - t)
        conn.close()

    while time.time() < start_at:
        time.sleep(0.005)
    pool = [threading.Thread(target=client) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    out.put(stats)


def run_load(server: Server, body: bytes, headers: dict, clients: int, seconds: float, probe: bool):
    """``clients`` load clients for ``seconds`` (0 clients: idle); with ``probe``, health latencies too."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = []
    start_at = time.time() + (3.0 if clients else 0.0)  # spawned processes need a moment to import
    for share in ([clients // 2, clients - clients // 2] if clients else []):
        p = ctx.Process(target=_load_worker, args=(server.host, server.port, body, headers, share,
                                                   start_at, seconds, out))
        p.start()
        procs.append(p)
    probes: dict[str, list[float]] = {"/v2/health/live": [], "/v2/health/ready": []}
    while time.time() < start_at + 0.5:  # let the load ramp up first
        time.sleep(0.01)
    while probe and time.time() < start_at + seconds - 0.2:
        for route, values in probes.items():
            t = time.perf_counter()
            conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
            conn.request("GET", route)
            response = conn.getresponse()
            response.read()
            conn.close()
            assert response.status == 200, (route, response.status)
            values.append(time.perf_counter() - t)
        time.sleep(0.05)
    while time.time() < start_at + seconds:
        time.sleep(0.05)
    merged = {"status": {}, "latency_503": [], "errors": 0}
    for _ in procs:
        stats = out.get(timeout=300)
        for k, v in stats["status"].items():
            merged["status"][k] = merged["status"].get(k, 0) + v
        merged["latency_503"] += stats["latency_503"]
        merged["errors"] += stats["errors"]
    for p in procs:
        p.join(60)
    merged["probe"] = probes["/v2/health/live"] + probes["/v2/health/ready"]
    return merged


def pct(values, q) -> float:
    return float(np.percentile(values, q)) * 1000 if values else float("nan")


# ----------------------------------------------------------------------------- the three parts


def health_under_load(cmd, model, args, bodies):
    server = Server(cmd, model)
    pooled = {"idle": [], "json": [], "binary": []}
    counts = {"json": {}, "binary": {}}
    try:
        for r in range(args.rounds):
            for label in ("idle", "json", "binary"):
                body, headers = bodies.get(label, (b"", {}))
                res = run_load(server, body, headers, 0 if label == "idle" else args.clients, args.seconds, True)
                pooled[label] += res["probe"]
                if label != "idle":
                    for k, v in res["status"].items():
                        counts[label][k] = counts[label].get(k, 0) + v
                print(f"  round {r + 1} {label:6s}: probe p50 {pct(res['probe'], 50):7.1f} ms  "
                      f"p99 {pct(res['probe'], 99):7.1f} ms  answers {res['status']}  errors {res['errors']}",
                      flush=True)
    finally:
        server.stop()
    print(f"\nhealth probe latency ({args.clients} clients, {len(bodies['json'][0]) >> 10} KiB JSON / "
          f"{len(bodies['binary'][0]) >> 10} KiB binary bodies, {args.rounds} interleaved rounds):")
    idle99 = pct(pooled["idle"], 99)
    for label in ("idle", "json", "binary"):
        p50, p99 = pct(pooled[label], 50), pct(pooled[label], 99)
        print(f"  {label:6s}  p50 {p50:7.1f} ms  p99 {p99:7.1f} ms  (p99 {p99 / idle99:5.1f}x idle)  "
              f"n={len(pooled[label])}  answers {counts.get(label, '')}")


def overload(cmd, model, args, bodies):
    rows = json.loads(bodies["binary"][0][:int(bodies["binary"][1]["Inference-Header-Content-Length"])]
                      )["inputs"][0]["shape"][0]
    server = Server(cmd, model, "--max-batch", str(rows), "--max-queue", "4")  # one request per batch
    try:
        print(f"\n503 latency (--max-batch {rows} --max-queue 4: one request a batch, {args.clients} clients):")
        for r in range(args.rounds):
            for label in ("json", "binary"):
                res = run_load(server, *bodies[label], args.clients, args.seconds, False)
                lat = res["latency_503"]
                print(f"  round {r + 1} {label:6s}: 503 p50 {pct(lat, 50):7.1f} ms  p99 {pct(lat, 99):7.1f} ms  "
                      f"answers {res['status']}  errors {res['errors']}", flush=True)
    finally:
        server.stop()


def memory(cmd, model, args, d):
    """Peak RSS growth of a fresh server over ~31 MB JSON requests (the issue's measure), and over the
    same tensors sent and answered as binary: the model's own share (activations, ONNX Runtime's arena).
    Each figure from its own fresh server (freed memory stays in a process and would hide the next)."""
    seq = 250
    rows = min(64, round(31e6 / len(make_body(1, seq, d, binary=False)[0])))  # ~31 MB of JSON
    bodies = {kind: make_body(rows, seq, d, binary=kind == "binary", seed=1) for kind in ("binary", "json")}
    mb = len(bodies["json"][0]) / 1e6
    print(f"\npeak RSS growth of a fresh server over requests of [{rows}, {seq}, {d}] FP32 ({mb:.1f} MB as JSON, "
          f"{len(bodies['binary'][0]) / 1e6:.1f} MB binary), per MB of one JSON body:")
    for n in (1, 6):
        growth = {}
        for kind in ("binary", "json"):
            server = Server(cmd, model, "--max-body-mb", "64", "--max-batch", "64")
            try:
                post(server.host, server.port, *make_body(1, 8, d, kind == "binary"))  # first-request set-up
                rss0, _ = server.rss()
                server.reset_peak()
                results = []

                def call(kind=kind):
                    results.append(post(server.host, server.port, *bodies[kind])[0])

                threads = [threading.Thread(target=call) for _ in range(n)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                rss1, peak = server.rss()
            finally:
                server.stop()
            growth[kind] = (peak - rss0) / 1e6
            print(f"  {n} at once, {kind:6s}: RSS before {rss0 / 1e6:5.0f} MB, peak {peak / 1e6:5.0f} MB, "
                  f"after {rss1 / 1e6:5.0f} MB: growth {growth[kind]:5.0f} MB = {growth[kind] / mb:4.1f} per MB; "
                  f"answers {sorted(results)}", flush=True)
        print(f"  {n} at once: JSON {growth['json'] / mb:4.1f} MB peak per MB of one JSON body "
              f"({growth['json'] / (n * mb):4.1f} per MB sent); JSON minus binary "
              f"{(growth['json'] - growth['binary']) / mb:4.1f} per MB of one body")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=8.0, help="Seconds of load per measurement.")
    parser.add_argument("--rounds", type=int, default=2, help="Interleaved rounds.")
    parser.add_argument("--clients", type=int, default=40)
    parser.add_argument("--kib", type=int, default=250, help="JSON body size (KiB).")
    parser.add_argument("--server-cmd", default=f"{shlex.quote(sys.executable)} -m attnx.cli.main",
                        help="How to run the attnx CLI for the servers.")
    parser.add_argument("--only", choices=["health", "overload", "memory"], action="append")
    args = parser.parse_args()
    cmd = shlex.split(args.server_cmd)
    parts = args.only or ["health", "overload", "memory"]
    with tempfile.TemporaryDirectory() as tmp:
        model = export_model(Path(tmp))
        d = 256
        seq = 16
        rows = max(1, args.kib * 1024 // (seq * d * 20))  # ~20 characters a JSON float
        bodies = {"json": make_body(rows, seq, d, False), "binary": make_body(rows, seq, d, True)}
        print(f"model: maw, d_model {d}, 1 layer; bodies [{rows}, {seq}, {d}]; host CPUs {os.cpu_count()}",
              flush=True)
        if "health" in parts:
            health_under_load(cmd, model, args, bodies)
        if "overload" in parts:
            overload(cmd, model, args, bodies)
        if "memory" in parts:
            memory(cmd, model, args, d)


if __name__ == "__main__":
    socket.setdefaulttimeout(300)
    main()
