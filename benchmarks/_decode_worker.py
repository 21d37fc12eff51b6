"""One generating contender, driven by ``bench_decode.py`` over stdin/stdout (one JSON object a line).

Run with the Python of the contender's own venv: ``python _decode_worker.py KIND MODEL THREADS [OPTION]``.
Kinds (each configured as its own docs tell a user, with ``THREADS`` intra-op threads and batch 1):

- ``attnx``: ``attnx.runtime.core.decoding.Decoder`` on a with-past export (ONNX Runtime, ``load(threads=)``);
- ``llama-cpp``: llama-cpp-python's ``Llama`` on a GGUF file (``n_threads`` = ``n_threads_batch`` =
  THREADS, ``n_batch`` 512, greedy sampler: ``top_k=1``, ``temp=0``); ``OPTION``: more ``Llama`` keywords as
  ``key=value,...`` (``flash_attn=1``: llama.cpp's own default on CPU, which llama-cpp-python turns off);
- ``genai``: onnxruntime-genai's ``Generator`` on a folder with ``genai_config.json`` (its session options
  carry the threads; ``bench_decode.py`` writes them);
- ``ct2``: CTranslate2's ``Generator`` on a converted folder, ``OPTION`` = compute type
  (``intra_threads`` = THREADS, ``inter_threads`` 1, ``sampling_topk=1``);
- ``transformers``: ``AutoModelForCausalLM`` fp32 and ``generate(do_sample=False)`` (``torch.set_num_threads``).

Requests, on token ids (every contender gets the same ids; the tokenizer is the HF folder's):
``{"op": "gen", "ids": [...], "n": N}`` -> ``{"s": seconds, "tokens": [N greedy ids]}`` (EOS ignored: N tokens
always, so every contender does the same work); ``{"op": "nll", "ids": [...]}`` -> ``{"nll": [-log p(id_i |
ids_<i) for i >= 1]}`` (teacher-forced: the log-softmax of the contender's own logits);
``{"op": "rss"}`` -> ``{"peak": bytes, "now": bytes}`` of this process. The call of each library is timed
here, so the pipe costs nothing to anyone. Imports nothing of attnx unless the kind is attnx.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np


def log_softmax_at(logits: np.ndarray, ids) -> np.ndarray:
    """``-log softmax(logits[i])[ids[i]]`` per row (float64)."""
    logits = np.asarray(logits, np.float64)
    top = logits.max(-1, keepdims=True)
    lse = top[:, 0] + np.log(np.exp(logits - top).sum(-1))
    return lse - logits[np.arange(len(ids)), ids]


def attnx(model: str, threads: int, option: str):
    from attnx.runtime import load
    from attnx.runtime.core.decoding import Decoder

    decoder = Decoder(load(model, device="cpu", threads=threads))

    def gen(ids, n):
        logits, state = decoder.start(ids)
        out = [int(np.argmax(logits))]
        while len(out) < n:
            logits, state = decoder.step(state, out[-1:])
            out.append(int(np.argmax(logits[0])))
        return out

    def nll(ids):
        rows = []
        logits, state = decoder.start(ids[:1])
        for t in ids[1:]:
            rows.append(logits)
            logits, state = decoder.step(state, [t])
            logits = logits[0]
        return log_softmax_at(np.stack(rows), ids[1:])

    return gen, nll


def llama_cpp(model: str, threads: int, option: str):
    from llama_cpp import Llama

    kw = dict(n_threads=threads, n_threads_batch=threads, n_ctx=2048, n_batch=512, verbose=False)
    for item in filter(None, option.split(",")):  # "flash_attn=1,n_ubatch=256": ints, 0/1 for booleans
        key, _, value = item.partition("=")
        kw[key] = int(value) if key != "flash_attn" else bool(int(value))
    llm = Llama(model_path=model, **kw)
    scorer = []  # a second context with logits for every position, made on the first nll request only

    def gen(ids, n):
        llm.reset()  # no reuse of the previous request's prefix: every run prefills its prompt
        out = []
        for token in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
            out.append(int(token))
            if len(out) == n:
                break
        return out

    def nll(ids):
        if not scorer:
            scorer.append(Llama(model_path=model, logits_all=True, **kw))
        s = scorer[0]
        s.reset()
        s.eval(ids)
        return log_softmax_at(np.asarray(s.scores[:len(ids) - 1]), ids[1:])

    return gen, nll


def genai(model: str, threads: int, option: str):
    import onnxruntime_genai as og

    m = og.Model(model)

    def generator(max_length):
        params = og.GeneratorParams(m)
        params.set_search_options(max_length=max_length, min_length=max_length, do_sample=False)
        return og.Generator(m, params)

    def gen(ids, n):
        g = generator(len(ids) + n)
        g.append_tokens(np.asarray(ids, np.int32))
        out = []
        while len(out) < n:
            g.generate_next_token()
            out.append(int(g.get_next_tokens()[0]))
        return out

    def nll(ids):
        g, rows = generator(len(ids) + 1), []
        for t in ids[:-1]:
            g.append_tokens(np.asarray([t], np.int32))
            rows.append(np.asarray(g.get_logits()).reshape(-1))
        return log_softmax_at(np.stack(rows), ids[1:])

    return gen, nll


def ct2(model: str, threads: int, option: str):
    import ctranslate2

    generator = ctranslate2.Generator(model, device="cpu", compute_type=option, intra_threads=threads,
                                      inter_threads=1)
    with open(os.path.join(model, "vocabulary.json")) as f:  # the converter's token list, by id
        vocab = json.load(f)
    tokens = lambda ids: [vocab[i] for i in ids]  # noqa: E731 (ct2 takes token strings)

    def gen(ids, n):
        # include_prompt_in_result=False: the prompt goes through the decoder in one step (its prefill)
        r = generator.generate_batch([tokens(ids)], max_length=n, min_length=n, sampling_topk=1, beam_size=1,
                                     include_prompt_in_result=False)
        return [int(t) for t in r[0].sequences_ids[0]]

    def nll(ids):
        return -np.asarray(generator.score_batch([tokens(ids)])[0].log_probs, np.float64)

    return gen, nll


def transformers_(model: str, threads: int, option: str):
    import torch
    import transformers

    torch.set_num_threads(threads)
    transformers.logging.set_verbosity_error()
    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()

    def gen(ids, n):
        x = torch.tensor([ids])
        with torch.inference_mode():
            out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, pad_token_id=0)
        return out[0, len(ids):].tolist()

    def nll(ids):
        with torch.inference_mode():
            logits = hf(torch.tensor([ids])).logits[0, :-1].numpy()
        return log_softmax_at(logits, ids[1:])

    return gen, nll


KINDS = {"attnx": attnx, "llama-cpp": llama_cpp, "genai": genai, "ct2": ct2, "transformers": transformers_}


def rss() -> dict:
    """This process's peak and current RSS. The peak is VmHWM, not ``ru_maxrss``: Linux carries
    ``ru_maxrss`` over fork and exec, so a worker started by a big parent reported the parent's peak."""
    with open("/proc/self/statm") as f:
        now = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    with open("/proc/self/status") as f:
        hwm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    return {"peak": hwm, "now": now}


def main() -> None:
    kind, model, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
    option = sys.argv[4] if len(sys.argv) > 4 else ""
    gen, nll = KINDS[kind](model, threads, option)
    print(json.dumps({"ready": kind, "rss": rss()}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "gen":
            start = time.perf_counter()
            tokens = gen(req["ids"], req["n"])
            print(json.dumps({"s": time.perf_counter() - start, "tokens": tokens}), flush=True)
        elif req["op"] == "nll":
            print(json.dumps({"nll": [float(x) for x in nll(req["ids"])]}), flush=True)
        else:
            print(json.dumps(rss()), flush=True)


if __name__ == "__main__":
    main()
