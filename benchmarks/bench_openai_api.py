"""Throughput of the OpenAI-compatible ``/v1/embeddings`` against KServe v2 binary on the same server and the
same load (issue 24's bar: within 10%).

One ``attnx serve`` process (a subprocess, so the load generator's Python does not share its GIL) serves the
real all-MiniLM-L6-v2. Two loads take turns on it in interleaved rounds (the order flips every round): the
unmodified ``openai`` client's ``embeddings.create`` (base64, its default) and ``tritonclient.http`` with a
``BYTES`` text input and the binary ``sentence_embedding`` output. Both send the same requests (``--batch``
texts from the built-in sentences) from ``--clients`` closed-loop threads. Printed: texts/s of each per round,
the pooled figure, and openai / KServe; every answer of the first request of each API is checked against the
other (cosine >= 0.9999).

Also printed: the server's CPU seconds per 1000 texts under each API (from /proc), and their ratio. On a
machine shared with other work the throughput of one 8-second round swings by tens of percent either way,
so the pooled ratio needs several rounds; CPU per text does not depend on what else runs, and is the
server's capacity (cores / CPU per text) through each API. The load generator's own CPU is printed too:
the ``openai`` client costs several times tritonclient's per text (pydantic models, base64 decoded into
Python floats), which on a small machine is taken from the server's cores.

    .venv/bin/python benchmarks/bench_openai_api.py [--model minilm.onnx] [--seconds 8] [--rounds 3]
        [--clients 16] [--batch 8] [--encoding base64|float]

Needs nothing but the CPU (exports MiniLM to a temporary folder unless --model names an export).
"""

from __future__ import annotations

import argparse
import base64
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from attnx.deploy.loadtest import merge_results, run_load


def export_minilm(folder: Path) -> Path:
    from attnx.export.pretrained import export_pretrained
    from attnx.pretrained import minilm_path

    return Path(export_pretrained(minilm_path(), folder / "minilm-mha.onnx", variant="mha").path)


def start_server(model: Path, threads: int | None) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "attnx.cli.main", "serve", f"minilm={model}", "--port", "0"]
    if threads:
        cmd += ["--threads", str(threads)]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        found = re.search(r"listening on (http://\S+)", line)
        if found:
            return proc, found.group(1)
    proc.kill()
    raise RuntimeError("the server did not start")


def requests(batch: int, count: int = 64) -> list[tuple[dict, int, int]]:
    """``count`` requests of ``batch`` real sentences each (run_load's pool: feeds, rows, tokens)."""
    from attnx.pretrained.sentences import SENTENCES

    rng = np.random.default_rng(0)
    return [({"texts": [SENTENCES[int(i)] for i in rng.integers(len(SENTENCES), size=batch)]}, batch, 0)
            for _ in range(count)]


def openai_target(url: str, encoding: str):
    import openai

    def factory():
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)

        class Call:
            def __call__(self, feeds):
                response = client.embeddings.create(input=feeds["texts"], model="minilm", encoding_format=encoding)
                rows = [np.frombuffer(base64.b64decode(d.embedding), "<f4") if isinstance(d.embedding, str)
                        else d.embedding for d in response.data]  # asked for by name, base64 comes undecoded
                return {"sentence_embedding": np.array(rows, np.float32)}

            def close(self):
                client.close()

        return Call()

    return factory


def kserve_target(url: str):
    import tritonclient.http as httpclient

    def factory():
        client = httpclient.InferenceServerClient(url.split("://", 1)[1], network_timeout=120)
        wanted = [httpclient.InferRequestedOutput("sentence_embedding", binary_data=True)]

        class Call:
            def __call__(self, feeds):
                item = httpclient.InferInput("text", [len(feeds["texts"])], "BYTES")
                item.set_data_from_numpy(np.array([t.encode() for t in feeds["texts"]], dtype=object))
                return {"sentence_embedding": client.infer("minilm", [item], outputs=wanted)
                        .as_numpy("sentence_embedding")}

            def close(self):
                client.close()

        return Call()

    return factory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="a MiniLM export (default: export one to a temporary folder)")
    parser.add_argument("--seconds", type=float, default=8.0, help="seconds of load per API per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--clients", type=int, default=16, help="closed-loop client threads")
    parser.add_argument("--batch", type=int, default=8, help="texts per request")
    parser.add_argument("--threads", type=int, help="the server's intra-op threads (default: all CPUs)")
    parser.add_argument("--encoding", choices=("base64", "float"), default="base64",
                        help="the openai client's encoding_format (base64: its default)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or export_minilm(Path(tmp))
        proc, url = start_server(model, args.threads)
        try:
            run(url, args, proc.pid)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


def cpu_seconds(pid: int | None = None) -> float:
    """CPU time (user + system) of this process, or of ``pid`` (Linux /proc), all threads."""
    if pid is None:
        return time.process_time()
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(url: str, args, server_pid: int) -> None:
    pool = requests(args.batch)
    targets = {"kserve-binary": kserve_target(url), "openai": openai_target(url, args.encoding)}
    first = {name: make()(pool[0][0])["sentence_embedding"] for name, make in targets.items()}
    a, b = first["openai"], first["kserve-binary"]
    cosine = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    assert cosine.min() >= 0.9999, f"the two APIs disagree: cosine {cosine.min()}"
    for make in targets.values():  # warm-up: connections, allocator, the model's first batches
        run_load(make, pool, concurrency=args.clients, duration_s=1.0)
    results: dict[str, list] = {name: [] for name in targets}
    cpu = {name: [0.0, 0.0] for name in targets}  # seconds: [server, load generator]
    print(f"{args.clients} clients x {args.batch} texts/request, {args.seconds:.0f} s per API per round, "
          f"openai encoding_format {args.encoding}, {url}")
    for r in range(args.rounds):
        order = list(targets) if r % 2 == 0 else list(reversed(targets))
        line = []
        for name in order:
            before = cpu_seconds(server_pid), cpu_seconds()
            result = run_load(targets[name], pool, concurrency=args.clients, duration_s=args.seconds, label=name,
                              seed=r)
            cpu[name][0] += cpu_seconds(server_pid) - before[0]
            cpu[name][1] += cpu_seconds() - before[1]
            if result.errors:
                raise RuntimeError(f"{name}: errors {dict(result.errors)}")
            results[name].append(result)
            line.append(f"{name} {result.sequences_per_s:7.1f} texts/s (p50 {result.percentile_ms(50):6.1f} ms)")
        print(f"round {r + 1}: " + "   ".join(line))
    merged = {name: merge_results(parts, name) for name, parts in results.items()}
    per_round = [o.sequences_per_s / k.sequences_per_s for o, k in zip(results["openai"], results["kserve-binary"])]
    for name, m in merged.items():
        per_k = [1000 * c / m.rows for c in cpu[name]]  # where the CPU went, per 1000 texts
        print(f"{name:14s} {m.sequences_per_s:7.1f} texts/s  p50 {m.percentile_ms(50):6.1f} ms  "
              f"p99 {m.percentile_ms(99):6.1f} ms  CPU s per 1000 texts: server {per_k[0]:.2f}, "
              f"client {per_k[1]:.2f}")
    ratio = merged["openai"].sequences_per_s / merged["kserve-binary"].sequences_per_s
    print(f"openai / kserve-binary throughput: {ratio:.3f} (per round: {', '.join(f'{x:.3f}' for x in per_round)})")
    capacity = (cpu["kserve-binary"][0] / merged["kserve-binary"].rows) / (cpu["openai"][0] / merged["openai"].rows)
    print(f"openai / kserve-binary server capacity (server CPU per text, inverted): {capacity:.3f}")


if __name__ == "__main__":
    main()
