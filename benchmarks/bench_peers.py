"""attnx against the embedding runtimes and servers users would pick instead, on the real all-MiniLM-L6-v2.

Every contender runs the **same ONNX graph** where it accepts one: attnx's fp32 export of the folder
(``attnx export --from-pretrained``), put as ``onnx/model.onnx`` into a copy of the folder, so what differs
is the runtime around the graph (tokenising, batching, pooling, session settings, the server):

- in-process: ``attnx`` (``attnx.runtime.TextModel``), ``fastembed`` (``TextEmbedding`` with the file as a
  custom model: mean pooling, normalised), ``st-onnx`` (sentence-transformers, ``backend="onnx"``);
  ``st-torch`` (sentence-transformers' default PyTorch backend) is the accuracy reference and a row;
- served, OpenAI-style ``POST /embeddings``: ``attnx serve`` and Infinity (``infinity_emb v2 --engine
  optimum``, which loads the ONNX file of the folder).

Each peer lives in its own venv under ``--venvs`` (default ``~/.cache/attnx-bench``), created by this
script with pip on first use, with this venv's ``onnxruntime`` (and ``torch``) versions pinned so the
graph runs on the same ONNX Runtime. Each in-process embedder runs in a worker process of its venv
(``_peer_worker.py``) that times its own encode call; requests go to the workers in interleaved rounds
(rotating order, a pause between contenders so no pool thread still spins). Threads: ``--threads`` for
every ONNX Runtime session and torch; the servers use their defaults on this machine's CPUs.

Accuracy: each contender's embeddings of the corpus (the built-in sentences, calibration sentences and
queries) against sentence-transformers' own (``st-torch``), per-sentence cosine.

    python benchmarks/bench_peers.py [--rounds 15] [--batches 1 32] [--threads 2] [--no-served] [--peers ...]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_variants import print_table  # noqa: E402

VENVS = Path.home() / ".cache" / "attnx-bench"
#: pip requirements of each peer's venv (onnxruntime and torch are pinned to this venv's versions on top)
PEERS = {"fastembed": ["fastembed==0.9.1"], "st-onnx": ["sentence-transformers[onnx]"],
         "infinity": ["infinity-emb[server,optimum]==0.0.78"]}
NEEDS_TORCH = ("st-onnx", "infinity")
PAUSE_S = 0.05  # between contenders: ONNX Runtime's default pool threads spin a while after a run


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def peer_python(name: str, venvs: Path, setup: bool) -> tuple[Path | None, str]:
    """The peer venv's python (created with pip when missing and ``setup``), or why not."""
    import onnxruntime
    import torch

    venv = venvs / f"{name}-venv"
    python = venv / "bin" / "python"
    pins = [f"onnxruntime=={onnxruntime.__version__}"] + \
           ([f"torch=={torch.__version__.split('+')[0]}"] if name in NEEDS_TORCH else [])
    marker = venv / "attnx-bench.json"
    wanted = {"packages": PEERS[name], "pins": pins}
    if python.is_file() and marker.is_file() and json.loads(marker.read_text()) == wanted:
        return python, ""
    if not setup:
        return None, f"no {name} venv at {venv} (run once without --no-setup)"
    _log(f"setting up {venv}: {' '.join(PEERS[name] + pins)} ...")
    steps = [[sys.executable, "-m", "venv", str(venv)]] if not python.is_file() else []
    steps.append([str(python), "-m", "pip", "install", "-q", *pins, *PEERS[name]])
    for cmd in steps:
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            return None, f"pip could not set up {name}: {(proc.stderr.strip().splitlines() or ['?'])[-1][:200]}"
    marker.write_text(json.dumps(wanted))
    return python, ""


def package_version(python: Path, dist: str) -> str:
    code = f"import importlib.metadata as m; print(m.version({dist!r}))"
    proc = subprocess.run([str(python), "-c", code], capture_output=True, text=True)
    return proc.stdout.strip() or "?"


# ----------------------------------------------------------------------------- the model and the corpus


def prepare(workdir: Path) -> tuple[Path, Path, list[str]]:
    """(folder with onnx/model.onnx = attnx's export, the export itself, the corpus)."""
    from attnx.export.pretrained import export_pretrained
    from attnx.pretrained import minilm_path
    from attnx.pretrained.sentences import CALIBRATION, QUERIES, SENTENCES

    export = workdir / "minilm.onnx"
    if not export.is_file():
        _log("exporting all-MiniLM-L6-v2 with attnx ...")
        export_pretrained(minilm_path(), export)
    folder = workdir / "all-MiniLM-L6-v2"
    if not (folder / "onnx" / "model.onnx").is_file():
        shutil.copytree(minilm_path(), folder, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.safetensors"))
        (folder / "onnx").mkdir(exist_ok=True)
        shutil.copyfile(export, folder / "onnx" / "model.onnx")
        shutil.copyfile(minilm_path() / "model.safetensors", folder / "model.safetensors")  # st-torch's weights
    return folder, export, [*SENTENCES, *CALIBRATION, *QUERIES]


# ----------------------------------------------------------------------------- in process


class Worker:
    def __init__(self, kind: str, python: Path, folder: Path, export: Path, threads: int):
        # OpenMP's wait policy at its default, as a user runs torch (PASSIVE, set here before 2026-11-29, slows
        # a torch worker's small ops; the pause between contenders outlasts its threads' spin)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        self.kind = kind
        self.proc = subprocess.Popen([str(python), str(HERE / "_peer_worker.py"), kind, str(folder), str(export),
                                      str(threads)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=env, cwd=str(folder.parent))
        line = self.proc.stdout.readline()
        if not line or "ready" not in line:
            self.proc.kill()
            raise RuntimeError(f"{kind} worker did not start (run it by hand: {python} {HERE / '_peer_worker.py'} "
                               f"{kind} {folder} {export} {threads})")

    def encode(self, texts: list[str], emb: bool = False) -> dict:
        self.proc.stdin.write(json.dumps({"texts": texts, "emb": emb}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def rounds(fns: dict, n: int) -> dict[str, list[float]]:
    """Seconds per call of each contender over ``n`` interleaved rounds (rotating order, a pause between)."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    order = list(fns)
    for r in range(n):
        for name in order[r % len(order):] + order[:r % len(order)]:
            times[name].append(fns[name]())
            time.sleep(PAUSE_S)
    return times


def cosines(emb: np.ndarray, ref: np.ndarray) -> np.ndarray:
    emb, ref = np.asarray(emb, np.float64), np.asarray(ref, np.float64)
    return (emb * ref).sum(1) / np.linalg.norm(emb, axis=1) / np.linalg.norm(ref, axis=1)


def in_process(workers: dict[str, Worker], corpus: list[str], batches: list[int], n: int) -> None:
    ref = np.asarray(workers["st-torch"].encode(corpus, emb=True)["emb"])
    accuracy = {k: cosines(w.encode(corpus, emb=True)["emb"], ref).min() for k, w in workers.items()}
    rows = []
    for batch in batches:
        texts = (corpus * (batch // len(corpus) + 1))[:batch] if batch > 1 else ["Where is the nearest train station?"]
        times = rounds({k: (lambda w=w: w.encode(texts)["s"]) for k, w in workers.items()}, n)
        base = statistics.median(times["attnx"])
        for k, t in times.items():
            med = statistics.median(t)
            rows.append([k, str(batch), f"{min(t) * 1e3:,.2f}", f"{med * 1e3:,.2f}", f"{med / base:.2f}x",
                         f"{accuracy[k]:.6f}"])
    print_table(f"In-process encode (fastest and median of {n} interleaved rounds; x attnx: median over attnx's)",
                ["embedder", "texts", "min ms", "median ms", "x attnx", "min cosine vs ST"], rows)


# ----------------------------------------------------------------------------- served


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, name: str, cmd: list[str], port: int, route: str, model: str, log: Path, ready: str,
                 cwd: Path | None = None):
        self.name, self.port, self.route, self.model = name, port, route, model
        self.log = log.open("w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=cwd,
                                     env={**os.environ, "HF_HUB_OFFLINE": "1", "INFINITY_ANONYMOUS_USAGE_STATS": "0"})
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {self.proc.returncode}; its log: {log}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                conn.request("GET", ready)
                if conn.getresponse().status == 200:
                    break
            except OSError:
                time.sleep(0.5)
        else:
            raise RuntimeError(f"{name} did not answer {ready} in 300 s; its log: {log}")
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)

    def embed(self, texts: list[str], conn=None) -> tuple[float, list]:
        conn = conn or self.conn
        body = json.dumps({"input": texts, "model": self.model})
        start = time.perf_counter()
        conn.request("POST", self.route, body=body, headers={"Content-Type": "application/json"})
        answer = conn.getresponse().read()
        seconds = time.perf_counter() - start
        data = json.loads(answer)
        if "data" not in data:
            raise RuntimeError(f"{self.name}: {answer[:200]!r}")
        return seconds, [d["embedding"] for d in sorted(data["data"], key=lambda d: d["index"])]

    def throughput(self, texts: list[str], clients: int, seconds: float) -> float:
        """Texts per second with ``clients`` concurrent connections, each sending one text at a time."""
        def client(i: int) -> int:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
            done, stop = 0, time.monotonic() + seconds
            while time.monotonic() < stop:
                self.embed([texts[(i + done) % len(texts)]], conn)
                done += 1
            return done

        start = time.monotonic()
        with ThreadPoolExecutor(clients) as pool:
            total = sum(pool.map(client, range(clients)))
        return total / (time.monotonic() - start)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def served(servers: dict[str, Server], corpus: list[str], ref: np.ndarray, batches: list[int], n: int,
           clients: int, seconds: float) -> None:
    accuracy = {k: cosines(s.embed(corpus)[1], ref).min() for k, s in servers.items()}
    rows = []
    for batch in batches:
        texts = (corpus * (batch // len(corpus) + 1))[:batch] if batch > 1 else ["Where is the nearest train station?"]
        times = rounds({k: (lambda s=s: s.embed(texts)[0]) for k, s in servers.items()}, n)
        base = statistics.median(times["attnx serve"])
        for k, t in times.items():
            med = statistics.median(t)
            rows.append([k, f"{batch} per request", f"{min(t) * 1e3:,.2f}", f"{med * 1e3:,.2f}",
                         f"{med / base:.2f}x", f"{accuracy[k]:.6f}"])
    for k, s in servers.items():  # one at a time: each server gets the machine to itself
        rate = s.throughput(corpus, clients, seconds)
        rows.append([k, f"{clients} clients x 1 text", f"{rate:,.1f} texts/s", "", "", f"{accuracy[k]:.6f}"])
    print_table(f"Served, POST /embeddings over HTTP/1.1 keep-alive (client round trip; {n} interleaved rounds)",
                ["server", "load", "min ms", "median ms", "x attnx", "min cosine vs ST"], rows)


# ----------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--peers", nargs="+", default=list(PEERS), choices=list(PEERS))
    ap.add_argument("--venvs", type=Path, default=VENVS)
    ap.add_argument("--no-setup", action="store_true", help="use existing peer venvs only")
    ap.add_argument("--no-served", action="store_true")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=10.0, help="of each server's throughput run")
    ap.add_argument("--workdir", type=Path, default=None)
    args = ap.parse_args()
    os.environ["HF_HUB_OFFLINE"] = "1"
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="attnx-bench-peers-"))
    workdir.mkdir(parents=True, exist_ok=True)
    folder, export, corpus = prepare(workdir)
    pythons = {"attnx": Path(sys.executable), "st-torch": Path(sys.executable)}
    for name in args.peers:
        python, why = peer_python(name, args.venvs, not args.no_setup)
        if python is None:
            print(f"{name}: not measured: {why}")
        else:
            pythons[name] = python
            dist = PEERS[name][0].split("[")[0].split("=")[0]
            print(f"{name}: {dist} {package_version(python, dist)}, onnxruntime {package_version(python, 'onnxruntime')}")
    import onnxruntime

    print(f"attnx: onnxruntime {onnxruntime.__version__}; {args.threads} threads per in-process embedder; corpus "
          f"{len(corpus)} real sentences; the same ONNX graph ({export.name}, fp32) in every ONNX contender")
    workers = {}
    try:
        for kind in ("attnx", "fastembed", "st-onnx", "st-torch"):
            if kind in pythons:
                try:
                    workers[kind] = Worker(kind, pythons[kind], folder, export, args.threads)
                except RuntimeError as e:
                    print(f"{kind}: not measured: {e}")
        in_process(workers, corpus, args.batches, args.rounds)
        ref = np.asarray(workers["st-torch"].encode(corpus, emb=True)["emb"])
    finally:
        for w in workers.values():
            w.close()
    if args.no_served:
        return
    servers = {}
    try:
        port = free_port()
        servers["attnx serve"] = Server("attnx serve", [str(Path(sys.executable).parent / "attnx"), "serve",
                                        f"minilm={export}", "--port", str(port)], port, "/v1/embeddings", "minilm",
                                        workdir / "attnx-serve.log", "/v2/health/ready")
        if "infinity" in pythons:
            port = free_port()
            cli = pythons["infinity"].parent / "infinity_emb"
            # Infinity 0.0.78 hands Optimum the ONNX file's path with the folder in front, which Optimum then
            # fails to find in that folder: run it in a folder holding model.onnx at its root, as --model-id "."
            own = workdir / "infinity-model"
            if not (own / "model.onnx").is_file():
                shutil.copytree(folder, own, dirs_exist_ok=True, ignore=shutil.ignore_patterns("onnx"))
                shutil.copyfile(export, own / "model.onnx")
            try:
                servers["infinity"] = Server("infinity", [str(cli), "v2", "--model-id", ".", "--engine", "optimum",
                                                         "--device", "cpu", "--port", str(port),
                                                         "--served-model-name", "minilm",
                                                         # its default ("auto") pools the optimum engine's output
                                                         # at [CLS]: cosine 0.05-0.5 against sentence-transformers
                                                         "--pooling-method", "mean"],
                                             port, "/embeddings", "minilm", workdir / "infinity.log", "/health",
                                             cwd=own)
            except RuntimeError as e:
                print(f"infinity: not measured: {e}")
        served(servers, corpus, ref, args.batches, args.rounds, args.clients, args.seconds)
    finally:
        for s in servers.values():
            s.close()


if __name__ == "__main__":
    main()
