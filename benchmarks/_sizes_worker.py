"""Load one decoder and generate a little, for ``bench_decoder_sizes.py``: the memory it holds and its speed.

    python _sizes_worker.py KIND MODEL THREADS [OPTIONS_JSON [NEW]]

Kinds: ``attnx`` (a with-past export through ``attnx.runtime.load`` + :class:`Decoder`; ``OPTIONS_JSON`` are extra
``load`` options, e.g. ``{"arena": false}`` or ``{"extra_session_config": {"session.disable_prepacking": "1"}}``),
``llama-cpp`` (llama-cpp-python's ``Llama`` on a GGUF, flash attention on:
llama.cpp's CPU default), ``genai`` (onnxruntime-genai's ``Generator`` on a folder with ``genai_config.json``: its
builder's output, or an attnx with-past export; the threads go in through ``og.Config.overlay`` as the session's
``intra_op_num_threads``, inter-op 1, the file untouched). Prints one JSON object: this process's memory from
``/proc/self/status`` with its libraries imported (``start``), after loading and after a greedy generation
(``PROMPT`` random token ids, then ``NEW`` tokens, EOS ignored; ``NEW`` defaults to 16), decode ms/token (median
step after the first), the prefill of a fresh ``PREFILL``-id prompt (512; the faster of two runs;
``ATTNX_BENCH_PREFILL``, 0: none), and for attnx the KV cache it states. Imports nothing of attnx unless the kind is
attnx (llama-cpp-python, and onnxruntime-genai where attnx's venv lacks it, live in their own venvs).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

PROMPT, NEW = 8, 16
PREFILL = int(os.environ.get("ATTNX_BENCH_PREFILL", 512))  # then a prompt of this many ids, timed alone (0: none)


def memory() -> dict[str, int]:
    """VmRSS, VmHWM (peak RSS), RssAnon, RssFile of this process, bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    return out


def attnx(model: str, threads: int, options: dict):
    import numpy as np

    from attnx.runtime import load
    from attnx.runtime.core.decoding import Decoder

    decoder = Decoder(load(model, device="cpu", threads=threads, **options))
    vocab = decoder.vocab_size or 1000

    def generate(ids):
        times, out = [], []
        logits, state = decoder.start(ids)
        out.append(int(np.argmax(logits)))
        while len(out) < NEW:
            started = time.perf_counter()
            logits, state = decoder.step(state, out[-1:])
            times.append(time.perf_counter() - started)
            out.append(int(np.argmax(logits[0])))
        return times

    def prefill(ids):
        started = time.perf_counter()
        decoder.start(ids)
        return time.perf_counter() - started

    footprint = decoder.kv_footprint()
    return generate, prefill, vocab, {"kv_token_bytes": footprint.token_bytes, "kv_positions": footprint.positions,
                             "kv_bytes": footprint.bytes(), "kv_line": footprint.describe()}


def llama_cpp(model: str, threads: int, options: dict):
    from llama_cpp import Llama

    llm = Llama(model_path=model, n_threads=threads, n_threads_batch=threads,
                n_ctx=options.get("n_ctx", PREFILL + PROMPT + NEW), n_batch=512,
                flash_attn=options.get("flash_attn", True), verbose=False)  # on: llama.cpp's own CPU default

    def generate(ids):
        times, last = [], time.perf_counter()
        for count, _ in enumerate(llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0)):
            now = time.perf_counter()
            if count:
                times.append(now - last)
            last = now
            if count + 1 == NEW:
                break
        return times

    def prefill(ids):
        llm.reset()
        started = time.perf_counter()
        llm.eval(ids)  # the prompt in n_batch-sized runs, the last position's logits
        return time.perf_counter() - started

    return generate, prefill, llm.n_vocab(), {}


def genai(model: str, threads: int, options: dict):
    import numpy as np
    import onnxruntime_genai as og

    config = og.Config(model)
    config.overlay(json.dumps({"model": {"decoder": {"session_options": {
        "intra_op_num_threads": threads, "inter_op_num_threads": 1}}}}))
    m = og.Model(config)
    with open(f"{model}/genai_config.json") as f:
        vocab = json.load(f)["model"]["vocab_size"]

    def generate(ids):
        params = og.GeneratorParams(m)
        params.set_search_options(max_length=len(ids) + NEW, min_length=len(ids) + NEW, do_sample=False)
        g = og.Generator(m, params)
        # the prompt runs here; the first generate_next_token then only picks from its logits (not timed)
        g.append_tokens(np.asarray(ids, np.int32))
        times = []
        for count in range(NEW):
            started = time.perf_counter()
            g.generate_next_token()
            if count:
                times.append(time.perf_counter() - started)
        return times

    def prefill(ids):
        params = og.GeneratorParams(m)
        params.set_search_options(max_length=len(ids) + 1, do_sample=False)
        g = og.Generator(m, params)
        started = time.perf_counter()
        g.append_tokens(np.asarray(ids, np.int32))
        return time.perf_counter() - started

    return generate, prefill, vocab, {}


def main() -> None:
    kind, model, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
    options = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
    global NEW
    NEW = int(sys.argv[5]) if len(sys.argv) > 5 else NEW
    import importlib

    # the libraries first: "start" is the bare process, so loaded - start is what the model added
    libraries = {"attnx": ("onnxruntime", "attnx.runtime"), "genai": ("numpy", "onnxruntime_genai")}
    for module in libraries.get(kind, ("llama_cpp",)):
        importlib.import_module(module)
    before = memory()
    started = time.perf_counter()
    generate, prefill, vocab, extra = {"attnx": attnx, "llama-cpp": llama_cpp, "genai": genai}[kind](
        model, threads, options)
    load_s = time.perf_counter() - started
    loaded = memory()
    import random

    rng = random.Random(0)
    ids = [rng.randrange(3, vocab) for _ in range(PROMPT)]
    times = generate(ids)
    after = memory()
    long_prompt = [rng.randrange(3, vocab) for _ in range(PREFILL)]
    prefills = [prefill(long_prompt) for _ in range(2)] if PREFILL else []
    print(json.dumps({"kind": kind, "load_s": load_s, "start": before, "loaded": loaded, "decoded": after,
                      "ms_per_token": statistics.median(times) * 1000 if times else None,
                      "prefill_ms": min(prefills) * 1000 if prefills else None, **extra}), flush=True)


if __name__ == "__main__":
    main()
