"""Decoders at the sizes people run (issue 44): export memory, files, load memory and decode speed per shape and bits.

For each shape, a random bf16 Hugging Face folder of that shape is written **shard by shard** (each tensor drawn
N(0, 0.02) in bf16, norms 1; one safetensors shard of at most ~2 GB in memory at a time, then
``model.safetensors.index.json``, ``config.json`` for ``LlamaForCausalLM`` and a byte-level BPE tokenizer trained
to the shape's vocabulary), never the whole model in memory. Then, per ``--weights``:

- ``attnx export --from-pretrained FOLDER --with-past [--weights W]`` as a subprocess, its process tree polled
  every 50 ms through ``/proc/PID/status``: peak RSS (VmRSS summed over the tree; VmHWM of the largest process),
  peak RssAnon and RssFile, wall time, the files written (``model.onnx`` + ``model.onnx.data``) and peak RSS / files;
- the export loaded in a fresh process (``_sizes_worker.py``, ONNX Runtime, ``--threads``): the RSS loading added
  to the bare process (its libraries imported; anonymous / file-backed), a greedy generation of 16 tokens after
  an 8-token prompt (EOS ignored), decode ms/token (median step), VmHWM at the end, and the KV cache the decoder
  states at load (bytes per token, and at the model's positions).

``--peers [llama-cpp genai]`` (alone: both) puts peers beside attnx. llama.cpp: the same weights as a GGUF of the
same bits (int8 -> Q8_0, int4 -> Q4_0, every 2-D weight in that type as ``llama-quantize --pure`` writes it, norms
F32), written one tensor at a time by ``_sizes_gguf.py`` (the ``gguf`` package; what ``convert_hf_to_gguf.py``
writes, q/k permuted for llama.cpp's rotary layout: checked by reading it back with transformers' GGUF loader), its
peak RSS and wall time polled the same way, then loaded and run by llama-cpp-python (``n_ctx`` 536, ``--threads``)
in its own venv, which ``bench_decode.py`` sets up (``~/.cache/attnx-bench/llama-cpp-venv``: pip compiles llama.cpp
from source once, ~10+ CPU-minutes; ``--no-setup`` refuses to build a venv). onnxruntime-genai, for ``int4``: its
builder's int4 of the same folder (``python -m onnxruntime_genai.models.builder -i FOLDER -o OUT -p int4 -e cpu -c
CACHE``: its defaults, block 32, ``accuracy_level`` 4; its peak RSS and wall time polled the same way, files = its
``model.onnx*``), and for ``fp32`` genai running attnx's own fp32 export (the ``genai_config.json`` attnx writes
beside it; nothing built). Each peer's files are loaded and run in a fresh process by the same ``_sizes_worker.py``
(same prompt, tokens and ``--threads``; genai: ``intra_op_num_threads``, inter-op 1), and its ms/token is printed
over attnx's at the same bits (``/ attnx``). genai runs from its venv (``bench_decode.py``'s
``~/.cache/attnx-bench/genai-venv``), or with ``--here genai`` from this one where it has ``onnxruntime-genai`` (as
``bench_decode.py --here genai``).

``--rounds N`` then runs every contender of a shape and bits again, a fresh process each, N interleaved rounds
(order rotated), decode and a 512-id prefill, with a stream-copy probe between rounds, and prints per contender the
medians, the per-round ratios to attnx, the bytes of weights a decode step reads, the GB/s that implies and ms/token
over the floor (bytes / the round's copy GB/s): ``bench_decode.py``'s figure of merit at the sizes people run.

Shapes (published): ``135m`` SmolLM2-135M (hidden 576, 30 layers, GQA 9/3, FFN 1536, vocab 49152, tied), ``1.5b``
(hidden 2048, 24 layers, GQA 32/8, FFN 8192, vocab 49152, tied), ``3b`` Llama-3.2-3B (hidden 3072, 28 layers, GQA
24/8, FFN 8192, vocab 128256, tied), ``8b`` Llama-3.1-8B (hidden 4096, 32 layers, GQA 32/8, FFN 14336, vocab 128256,
untied). fp32 runs only where it fits (its weights x 1.2 in available memory, and on disk).

    python benchmarks/bench_decoder_sizes.py --shapes 135m --weights int4,int8
    python benchmarks/bench_decoder_sizes.py --shapes 135m,1.5b,3b,8b --weights int4,int8 --workdir /big/disk
        [--keep] [--threads 2] [--report sizes.json] [--peers [llama-cpp genai] [--here genai] [--no-setup]]
        [--rounds 5 [--llama-quantize]]

Folders are large (bf16: 2 bytes a parameter; the 8B shape 16 GB) and so are exports: free disk is checked
before writing (``df``), and each export (and peer's GGUF or genai build) is removed once measured, each folder
once its shape is done, unless ``--keep``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHAPES = {
    "135m": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                 intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=8192,
                 rope_theta=100000.0),
    "1.5b": dict(hidden_size=2048, num_hidden_layers=24, num_attention_heads=32, num_key_value_heads=8,
                 intermediate_size=8192, vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=2048,
                 rope_theta=10000.0),
    "3b": dict(hidden_size=3072, num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
               intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True, max_position_embeddings=131072,
               rope_theta=500000.0),
    "8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False,
               max_position_embeddings=131072, rope_theta=500000.0),
}
WEIGHTS = ("fp32", "int8", "int4")
PEERS = ("llama-cpp", "genai")
#: bytes per parameter an export of each kind may take on disk (staging included), for the free-disk check
DISK_PER_PARAM = {"fp32": 4.2, "int8": 2.0, "int4": 1.6}
SHARD_BYTES = 2 << 30
ATTNX = [sys.executable, "-m", "attnx.cli.main"]
ENV = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- the folders


def tensor_shapes(shape: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Every weight of a LlamaForCausalLM of ``shape``, in the order transformers names them."""
    h, ffn, vocab = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    heads, kv = shape["num_attention_heads"], shape["num_key_value_heads"]
    head_dim = h // heads
    out = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(shape["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_proj.weight", (heads * head_dim, h)),
                (p + "self_attn.k_proj.weight", (kv * head_dim, h)),
                (p + "self_attn.v_proj.weight", (kv * head_dim, h)),
                (p + "self_attn.o_proj.weight", (h, heads * head_dim)),
                (p + "mlp.gate_proj.weight", (ffn, h)), (p + "mlp.up_proj.weight", (ffn, h)),
                (p + "mlp.down_proj.weight", (h, ffn)),
                (p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,))]
    out.append(("model.norm.weight", (h,)))
    if not shape["tie_word_embeddings"]:
        out.append(("lm_head.weight", (vocab, h)))
    return out


def parameters(shape: dict) -> int:
    return sum(math.prod(s) for _, s in tensor_shapes(shape))


def config_of(name: str) -> dict:
    """config.json of a LlamaForCausalLM of shape ``name`` (bf16)."""
    shape = SHAPES[name]
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
            "attention_bias": False, "mlp_bias": False,
            "head_dim": shape["hidden_size"] // shape["num_attention_heads"],
            "torch_dtype": "bfloat16", "dtype": "bfloat16", "initializer_range": 0.02, "use_cache": True, **shape}


def write_folder(folder: Path, name: str, seed: int = 0) -> Path:
    """A random bf16 folder of shape ``name``, one shard (<= ~2 GB) in memory at a time."""
    import torch
    from safetensors.torch import save_file

    shape = SHAPES[name]
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    shards: list[list[str]] = [[]]
    sizes: list[int] = [0]
    plan = tensor_shapes(shape)
    for tname, dims in plan:  # the shard of each tensor, decided before any is drawn
        nbytes = 2 * math.prod(dims)
        if sizes[-1] and sizes[-1] + nbytes > SHARD_BYTES:
            shards.append([])
            sizes.append(0)
        shards[-1].append(tname)
        sizes[-1] += nbytes
    dims_of = dict(plan)
    index, total = {}, 0
    for n, names in enumerate(shards, 1):
        file = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for tname in names:
            t = torch.empty(dims_of[tname], dtype=torch.bfloat16)
            if tname.endswith("norm.weight"):
                t.fill_(1.0)
            else:
                t.normal_(0.0, 0.02, generator=g)
            tensors[tname] = t
            index[tname] = file
            total += t.numel() * 2
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
        del tensors
        log(f"  {file} ({sizes[n - 1] / 1e9:.2f} GB)")
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": index}, indent=1))
    (folder / "config.json").write_text(json.dumps(config_of(name), indent=1))
    write_tokenizer(folder, shape["vocab_size"])
    return folder


def write_tokenizer(folder: Path, vocab: int) -> None:
    """A byte-level BPE of ``vocab`` entries (``bench_export_memory.py``'s: trained on random words, seeded)."""
    sys.path.insert(0, str(HERE))
    from bench_export_memory import _tokenizer

    _tokenizer(vocab).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 2048, "padding_side": "left",
         "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}))


# ----------------------------------------------------------------------------- measuring a process tree


def _status(pid: int) -> dict[str, int]:
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                    out[key] = int(value.split()[0]) * 1024
    except (OSError, ValueError):
        pass
    return out


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants (``/proc/PID/task/*/children``)."""
    pids, todo = [], [pid]
    while todo:
        p = todo.pop()
        pids.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return pids


def run_polled(cmd: list[str], every_s: float = 0.05) -> dict:
    """Run ``cmd``, polling its process tree: peaks of VmRSS, RssAnon, RssFile summed over the tree, the largest
    VmHWM of any of its processes, wall time. Raises with the end of its stderr if it fails."""
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **ENV})
    peaks = {"VmRSS": 0, "RssAnon": 0, "RssFile": 0, "VmHWM": 0}

    def poll():
        while proc.poll() is None:
            sums = {"VmRSS": 0, "RssAnon": 0, "RssFile": 0}
            for pid in _tree(proc.pid):
                status = _status(pid)
                for key in sums:
                    sums[key] += status.get(key, 0)
                peaks["VmHWM"] = max(peaks["VmHWM"], status.get("VmHWM", 0))
            for key, value in sums.items():
                peaks[key] = max(peaks[key], value)
            time.sleep(every_s)

    watcher = threading.Thread(target=poll, daemon=True)
    watcher.start()
    out, err = proc.communicate()
    watcher.join()
    wall = time.perf_counter() - started
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd[:8])} ... failed (exit {proc.returncode}): "
                           f"{(err.strip().splitlines() or ['?'])[-1][:300]}")
    return {"peak": peaks, "wall_s": wall, "stdout": out, "stderr": err}


# ----------------------------------------------------------------------------- one shape x weights


def export(folder: Path, out: Path, weights: str) -> dict:
    cmd = [*ATTNX, "export", "--from-pretrained", str(folder), "--with-past", "-o", str(out / "model.onnx")]
    if weights != "fp32":
        cmd += ["--weights", weights]
    result = run_polled(cmd)
    files = {p.name: p.stat().st_size for p in out.iterdir() if p.is_file() and p.name.startswith("model.onnx")}
    return {"cmd": " ".join(["attnx", *cmd[3:]]), "wall_s": result["wall_s"], "peak": result["peak"],
            "files": files, "files_bytes": sum(files.values())}


def load_and_decode(model: Path, threads: int, kind: str = "attnx", python: Path | str = sys.executable) -> dict:
    """``_sizes_worker.py KIND MODEL THREADS`` in a fresh process of ``python``: its memory, decode ms/token and
    prefill ms."""
    proc = subprocess.run([str(python), str(HERE / "_sizes_worker.py"), kind, str(model), str(threads)],
                          capture_output=True, text=True, env={**os.environ, **ENV})
    if proc.returncode:
        raise RuntimeError(f"{kind} on {model} failed: {(proc.stderr.strip().splitlines() or ['?'])[-1][:300]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def gguf_peer(folder: Path, out: Path, weights: str, python: Path, threads: int) -> dict:
    """llama.cpp on a GGUF of the folder's weights in the bits of ``weights``: writing it (polled), then a run."""
    qtype = {"int8": "Q8_0", "int4": "Q4_0", "fp32": "F32"}[weights]
    out.mkdir(parents=True, exist_ok=True)
    gguf = out / f"model.{qtype}.gguf"
    written = run_polled([sys.executable, str(HERE / "_sizes_gguf.py"), str(folder), str(gguf), qtype])
    return {"label": f"llama.cpp {qtype}", "wall_s": written["wall_s"], "peak": written["peak"],
            "files_bytes": gguf.stat().st_size, "run": load_and_decode(gguf, threads, "llama-cpp", python)}


def llama_quantized(folder: Path, out: Path, python: Path, threads: int) -> Path:
    """llama.cpp's own Q4_0 of the folder (``_llama_quantize.py``: llama-quantize's defaults, the head in Q6_K),
    quantized from an F32 GGUF of it (written by ``_sizes_gguf.py`` where not there yet)."""
    f32, q4 = out / "model.F32.gguf", out / "model.Q4_0.llama-quantize.gguf"
    out.mkdir(parents=True, exist_ok=True)
    if not f32.is_file():
        run_polled([sys.executable, str(HERE / "_sizes_gguf.py"), str(folder), str(f32), "F32"])
    if not q4.is_file():
        proc = subprocess.run([str(python), str(HERE / "_llama_quantize.py"), str(f32), str(q4), "Q4_0", str(threads)],
                              capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"llama-quantize failed: {(proc.stderr.strip().splitlines() or ['?'])[-1][:300]}")
    return q4


def genai_peer(folder: Path, out: Path, python: Path, threads: int) -> dict:
    """onnxruntime-genai on its builder's int4 of the folder (``-p int4 -e cpu``: block 32, accuracy level 4):
    building it (polled), then a run."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [str(python), "-m", "onnxruntime_genai.models.builder", "-i", str(folder), "-o", str(out / "int4"),
           "-p", "int4", "-e", "cpu", "-c", str(out / "hf-cache")]
    built = run_polled(cmd)
    files = sum(p.stat().st_size for p in (out / "int4").iterdir() if p.name.startswith("model.onnx"))
    return {"label": "genai int4", "cmd": " ".join(cmd[1:]), "wall_s": built["wall_s"], "peak": built["peak"],
            "files_bytes": files, "run": load_and_decode(out / "int4", threads, "genai", python)}


def peer_row(name: str, peer: dict, attnx_ms: float) -> list[str]:
    """A peer's row: making its files (polled, or '-' where it runs attnx's own), its load and decode."""
    run, peak, files = peer["run"], peer.get("peak"), peer.get("files_bytes")
    made = ([f"{peer['wall_s']:.0f}", gb(peak["VmRSS"]), gb(peak["RssAnon"]), gb(peak["RssFile"]), gb(files),
             f"{peak['VmRSS'] / files:.2f}"] if peak else ["-"] * 6)
    return [name, peer["label"], *made, *_loaded(run), gb(run["decoded"]["VmHWM"]), f"{run['ms_per_token']:.1f}",
            f"{run['ms_per_token'] / attnx_ms:.2f}x", "-", "-"]


def add_peer(rows: list, entry: dict, name: str, label: str, attnx_ms: float, measure) -> None:
    """``measure()``'s peer into the report entry and a row; a peer that fails is a row saying why, not the end
    of a long run."""
    try:
        peer = measure()
    except RuntimeError as e:
        log(f"{name} {label}: failed: {e}")
        entry[label] = {"failed": str(e)}
        rows.append([name, label, f"failed: {str(e)[:100]}"] + [""] * 12)
        return
    entry[peer["label"]] = peer
    rows.append(peer_row(name, peer, attnx_ms))


def interleaved(shape: str, contenders: list, rounds: int, threads: int, table: list) -> dict:
    """Each ``(label, model, kind, python)`` decoded and prefilled once a round in a fresh process, the order
    rotated a round, and the stream-copy probe once a round (every worker gone); rows of medians, per-round ratios
    to the first (attnx), the weights a step reads and their distance to the floor (bytes / the round's copy GB/s,
    ``bench_decode.py``'s figure of merit) into ``table``; returns the times."""
    import statistics

    from _decode_bytes import copy_bandwidth, weight_bytes

    times: dict[str, list[float]] = {c[0]: [] for c in contenders}
    prefills: dict[str, list[float]] = {c[0]: [] for c in contenders}
    read = {label: weight_bytes(kind, Path(model))["read"] for label, model, kind, _ in contenders}
    bandwidth: list[float] = []
    for r in range(rounds):
        order = contenders[r % len(contenders):] + contenders[:r % len(contenders)]
        for label, model, kind, python in order:
            run = load_and_decode(model, threads, kind, python)
            times[label].append(run["ms_per_token"])
            prefills[label].append(run.get("prefill_ms") or float("nan"))
        bandwidth.append(copy_bandwidth(threads, rounds=3)["gb_s"])
        log(f"{shape} round {r + 1}/{rounds}: copy {bandwidth[-1]:.1f} GB/s, " + ", ".join(
            f"{k} {v[-1]:.1f} ms/token, prefill {prefills[k][-1]:.0f} ms" for k, v in times.items()))
    base, base_prefill = times[contenders[0][0]], prefills[contenders[0][0]]
    for label, ms in times.items():
        ratio = statistics.median(a / b for a, b in zip(ms, base))
        pre = prefills[label]
        pre_ratio = statistics.median(a / b for a, b in zip(pre, base_prefill))
        floor = statistics.median(m / (read[label] / g / 1e6) for m, g in zip(ms, bandwidth))
        table.append([shape, label, f"{statistics.median(ms):.1f}", f"{ratio:.2f}x", " ".join(f"{m:.1f}" for m in ms),
                      f"{read[label] / 1e6:,.0f}", f"{read[label] / statistics.median(ms) / 1e6:.1f}",
                      f"{floor:.2f}x", f"{statistics.median(pre):.0f}", f"{pre_ratio:.2f}x",
                      " ".join(f"{m:.0f}" for m in pre)])
    return {"ms_per_token": times, "prefill_ms": prefills, "read_bytes": read, "copy_gb_s": bandwidth}


def fits(name: str, weights: str, workdir: Path, folder_ready: bool) -> str | None:
    """Why this run cannot be made here (disk, or for fp32 memory), or None."""
    params = parameters(SHAPES[name])
    need = DISK_PER_PARAM[weights] * params + (0 if folder_ready else 2 * params)
    free = shutil.disk_usage(workdir).free
    if need > free:
        return f"needs ~{need / 1e9:.1f} GB of disk, {free / 1e9:.1f} GB free in {workdir}"
    if weights == "fp32":
        available = _available_memory()
        if available is not None and 4 * params * 1.2 > available:
            return f"fp32 weights ({4 * params / 1e9:.1f} GB) x 1.2 exceed the {available / 1e9:.1f} GB available"
    return None


def _available_memory() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _loaded(run: dict) -> list[str]:
    """RSS the load added to the bare process (its libraries imported): all, and anonymous / file-backed."""
    added = {k: run["loaded"][k] - run["start"].get(k, 0) for k in ("VmRSS", "RssAnon", "RssFile")}
    return [gb(added["VmRSS"]), f"{gb(added['RssAnon'])}/{gb(added['RssFile'])}"]


def gb(n) -> str:
    return f"{n / 1e9:.2f}" if n is not None else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="135m", help=f"comma-separated: {', '.join(SHAPES)}")
    ap.add_argument("--weights", default="int4,int8", help="comma-separated: fp32, int8, int4")
    ap.add_argument("--workdir", type=Path, default=None, help="where folders and exports go (default: a new "
                                                                "folder under the system temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the folders and exports")
    ap.add_argument("--threads", type=int, default=2, help="intra-op threads of the decode measurement")
    ap.add_argument("--peers", nargs="*", choices=PEERS, default=None,
                    help="beside attnx (alone: all): llama.cpp Q4_0/Q8_0 of the same weights, onnxruntime-genai's "
                         "builder int4 (and genai on attnx's fp32 export)")
    ap.add_argument("--here", nargs="*", choices=PEERS, default=[],
                    help="run these peers from this venv where it has their package (no venv to build)")
    ap.add_argument("--no-setup", action="store_true", help="with --peers: never build a peer's venv")
    ap.add_argument("--report", type=Path, help="also write every figure as JSON here")
    ap.add_argument("--rounds", type=int, default=1, help="then decode (and prefill 512 ids) every contender of a "
                    "shape and bits again in this many interleaved rounds (fresh processes, order rotated), for the "
                    "medians and per-round ratios (the single runs above move with the machine)")
    ap.add_argument("--llama-quantize", action="store_true", help="in the int4 rounds, also llama.cpp's own Q4_0 "
                    "(llama_model_quantize with llama-quantize's defaults: the head in Q6_K) of an F32 GGUF")
    args = ap.parse_args()
    shapes = [s for s in args.shapes.split(",") if s]
    weights = [w for w in args.weights.split(",") if w]
    bad = [s for s in shapes if s not in SHAPES] + [w for w in weights if w not in WEIGHTS]
    if bad:
        ap.error(f"unknown shape/weights {bad}; shapes: {', '.join(SHAPES)}; weights: {', '.join(WEIGHTS)}")
    peers = list(PEERS) if args.peers == [] else args.peers or []
    pythons: dict[str, Path] = {}
    if peers:
        sys.path.insert(0, str(HERE))
        from bench_decode import VENVS, peer_python

        pythons = {p: peer_python(p, VENVS, setup=not args.no_setup, here=p in args.here) for p in peers}
    llama_python, genai_python = pythons.get("llama-cpp"), pythons.get("genai")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="attnx-sizes-"))
    workdir.mkdir(parents=True, exist_ok=True)
    rows, report, rounds_rows = [], [], []
    for name in shapes:
        folder = workdir / f"llama-{name}-bf16"
        ready = (folder / "config.json").is_file()
        for w in weights:
            why = fits(name, w, workdir, ready)
            if why:
                log(f"{name} {w}: skipped: {why}")
                report.append({"shape": name, "weights": w, "skipped": why})
                rows.append([name, w, "skipped: " + why] + [""] * 12)
                continue
            if not ready:
                log(f"{name}: writing a random bf16 folder ({parameters(SHAPES[name]) / 1e9:.2f}B parameters) "
                    f"to {folder} ...")
                started = time.perf_counter()
                write_folder(folder, name)
                log(f"  written in {time.perf_counter() - started:.0f} s")
                ready = True
            out = workdir / f"llama-{name}-{w}"
            shutil.rmtree(out, ignore_errors=True)
            log(f"{name} {w}: exporting ...")
            ex = export(folder, out, w)
            log(f"  {ex['wall_s']:.0f} s, peak RSS {gb(ex['peak']['VmRSS'])} GB, files {gb(ex['files_bytes'])} GB")
            run = load_and_decode(out / "model.onnx", args.threads)
            entry = {"shape": name, "weights": w, "parameters": parameters(SHAPES[name]), "export": ex, "run": run}
            report.append(entry)
            peak, files = ex["peak"], ex["files_bytes"]
            rows.append([name, w, f"{ex['wall_s']:.0f}", gb(peak["VmRSS"]), gb(peak["RssAnon"]), gb(peak["RssFile"]),
                         gb(files), f"{peak['VmRSS'] / files:.2f}", *_loaded(run),
                         gb(run["decoded"]["VmHWM"]), f"{run['ms_per_token']:.1f}", "1.00x",
                         f"{run['kv_token_bytes']:,}" if run.get("kv_token_bytes") else "-",
                         f"{gb(run['kv_bytes'])} @{run['kv_positions']}" if run.get("kv_bytes") else "-"])
            if genai_python is not None and w == "fp32":  # genai on attnx's own export (its genai_config.json)
                log(f"{name} fp32: onnxruntime-genai on attnx's export ...")
                add_peer(rows, entry, name, "genai on attnx fp32", run["ms_per_token"], lambda: {
                    "label": "genai on attnx fp32", "run": load_and_decode(out, args.threads, "genai", genai_python)})
            contenders = [(f"attnx {w}", out / "model.onnx", "attnx", sys.executable)]
            if genai_python is not None and w == "fp32":
                contenders.append(("genai on attnx fp32", out, "genai", genai_python))
            if llama_python is not None:
                log(f"{name} {w}: llama.cpp ...")
                add_peer(rows, entry, name, "llama.cpp", run["ms_per_token"], lambda: gguf_peer(
                    folder, workdir / f"llama-{name}-{w}-gguf", w, llama_python, args.threads))
                gguf = workdir / f"llama-{name}-{w}-gguf" / f"model.{ {'int8': 'Q8_0', 'int4': 'Q4_0', 'fp32': 'F32'}[w]}.gguf"
                contenders.append((f"llama.cpp {gguf.suffixes[0][1:]}", gguf, "llama-cpp", llama_python))
            if llama_python is not None and w == "int4" and args.llama_quantize:
                log(f"{name} int4: llama.cpp's own quantizer (Q4_0, its default mix) ...")
                try:
                    contenders.append(("llama.cpp Q4_0, llama-quantize", llama_quantized(
                        folder, workdir / f"llama-{name}-fp32-gguf", llama_python, args.threads), "llama-cpp",
                        llama_python))
                except RuntimeError as e:
                    log(f"  failed: {e}")
            if genai_python is not None and w == "int4":
                log(f"{name} int4: onnxruntime-genai's builder ...")
                add_peer(rows, entry, name, "genai int4", run["ms_per_token"], lambda: genai_peer(
                    folder, workdir / f"llama-{name}-genai", genai_python, args.threads))
                contenders.append(("genai int4", workdir / f"llama-{name}-genai" / "int4", "genai", genai_python))
            if args.rounds > 1:
                sys.path.insert(0, str(HERE))
                entry["rounds"] = interleaved(name, [c for c in contenders if c[1].exists()], args.rounds,
                                              args.threads, rounds_rows)
            if not args.keep:
                for path in (out, workdir / f"llama-{name}-{w}-gguf", workdir / f"llama-{name}-genai",
                             *([workdir / f"llama-{name}-fp32-gguf"] if args.llama_quantize else [])):
                    shutil.rmtree(path, ignore_errors=True)
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
    sys.path.insert(0, str(HERE))
    from _common import print_table

    print_table(["shape", "weights", "export s", "peak RSS GB", "peak anon", "peak file", "files GB", "peak/files",
                 "load +RSS GB", "anon/file", "run HWM GB", "ms/token", "/ attnx", "KV B/token", "KV GB @positions"],
                rows)
    print(f"\nthreads {args.threads}; decode: 16 greedy tokens after 8 random prompt ids; '/ attnx': ms/token over "
          f"attnx's at the same bits (< 1: faster than attnx); workdir {workdir}"
          + ("; llama.cpp rows: 'export' is writing the GGUF (_sizes_gguf.py), its KV cache preallocated at n_ctx 536"
             if llama_python is not None else "")
          + ("; genai rows: 'export' is its builder (-p int4 -e cpu), 'genai on attnx fp32' runs attnx's own file"
             if genai_python is not None else ""))
    if rounds_rows:
        print(f"\n{args.rounds} interleaved rounds (a fresh process per contender per round, order rotated):")
        print_table(["shape", "contender", "median ms/token", "per-round ratio to attnx (median)", "rounds ms/token",
                     "MB read/token", "GB/s", "/ floor", "prefill ms", "prefill ratio to attnx", "rounds prefill ms"],
                    rounds_rows)
        print("MB read/token: the weights a decode step reads (_decode_bytes.py); GB/s: that over the median ms/token; "
              "/ floor: ms/token over MB read / the stream-copy probe's GB/s of the same round (median over rounds)")
    if args.report:
        args.report.write_text(json.dumps(report, indent=1))
    if not args.keep and args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
