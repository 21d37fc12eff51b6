"""What each attention variant costs next to plain attention (``mha``), on the CPU, in one process.

Three tables (docs/performance.md shows them):

- default, the cost table: every registered variant x L {128, 512, 2048} x batch {1, 8}: PyTorch
  eager (eval, the default fast path) and ONNX Runtime fp32 (the rewrite-lowering file: standard
  ops, the CPU deployment) latency and peak memory as ratios to mha; then the TensorRT-RTX engine build
  of each variant's file (build seconds and engine MB: it is built here, it cannot run without a GPU);
- ``--memory``: peak memory against L (128 ... 4096, batch 4, every row padded: lengths L, 3L/4,
  L/2, L/4) on torch and ORT, and the growth per doubling of L (~2x = O(L), ~4x = O(L^2));
- ``--int8``: the real all-MiniLM-L6-v2, int8 (``attnx export --int8``; and ORT's ``quantize_dynamic``
  for comparison) vs fp32 on ONNX Runtime at 1x128 and 8x128, with each file's per-sentence
  embedding cosine against sentence-transformers.

Timing: the fastest of interleaved rounds (rotating order, so drift on a shared machine hits every
contender alike); torch and ORT use the same thread count (``--threads``). Memory: the process's
peak resident memory during one call minus its resident memory before it (``VmHWM`` reset through
``/proc/self/clear_refs``), with glibc's mmap threshold pinned at 64 KiB and ORT's CPU arena off, so
every working buffer is mapped and unmapped and counted while it lives. The same measure for torch
and ORT; it includes whatever the backend's own attention kernel allocates.

    python benchmarks/bench_variants.py [--quick] [--no-engine] [--memory] [--int8 [--profile]] [--threads N]
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from attnx.export import export_encoder
from attnx.export.exporter import example_inputs
from attnx.models import build_encoder
from attnx.models.spec import variant_names

MB = 2**20


# ----------------------------------------------------------------------------- measuring


def pin_malloc() -> None:
    """Every allocation over 64 KiB gets its own mapping, returned on free (glibc ``M_MMAP_THRESHOLD``):
    resident memory then follows what is alive, which the peak measure below relies on."""
    ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)


def _status_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def peak_bytes(fn) -> int:
    """Peak resident memory during ``fn()`` above the resident memory before it."""
    before = _status_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset the high-water mark to now
    fn()
    return max(0, _status_kb("VmHWM") - before) * 1024


def interleaved(fns: dict, min_rounds: int = 3, budget_s: float = 6.0, slow_s: float = 4.0) -> dict[str, float]:
    """Fastest seconds per callable over rounds in rotating order (one warm-up each). The minimum, not
    the median: on a shared machine other work only ever adds time. When a warm-up call takes over
    ``slow_s``, three rounds only."""
    warm = []
    for fn in fns.values():
        t = time.perf_counter()
        fn()
        warm.append(time.perf_counter() - t)
    if max(warm) > slow_s:
        min_rounds, budget_s = 3, 0.0
    times: dict[str, list[float]] = {k: [] for k in fns}
    start, rounds = time.perf_counter(), 0
    while rounds < min_rounds or (time.perf_counter() - start < budget_s and rounds < 30):
        order = list(fns.items())
        k = rounds % len(order)
        for name, fn in order[k:] + order[:k]:
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
        rounds += 1
    return {k: min(v) for k, v in times.items()}


def ort_session(path: Path, threads: int, arena: bool = True) -> ort.InferenceSession:
    """attnx.runtime's default settings (see runtime/backends/onnxrt.py), the arena switchable."""
    from attnx.runtime.core.backends.onnxrt import OrtOptions

    return OrtOptions(device="cpu", threads=threads, arena=arena).inference_session(path)


def ort_run(sess: ort.InferenceSession, feeds: dict, names=None):
    """One run as attnx.runtime makes it: this thread, which does part of ORT's intra-op work, flushes
    denormals like ORT's pool threads (``OrtOptions.denormal_as_zero``)."""
    from attnx.runtime.core.backends.onnxrt import denormals_flushed

    with denormals_flushed():
        return sess.run(names, feeds)


class Contender:
    """One variant's torch model and ORT sessions at one size."""

    def __init__(self, variant: str, args, folder: Path):
        self.variant = variant
        self.model = build_encoder(variant, d_model=args.d_model, n_heads=args.heads, n_layers=args.layers,
                                   seed=0).eval()
        profiles = {"batch": (1, 8, 32), "seq": (1, 512, 4096)}
        # ORT runs the rewrite lowering (standard ops: the CPU deployment); TensorRT builds the plugin one
        self.path = export_encoder(self.model, folder / f"{variant}.onnx", save_weights=False, profiles=profiles).path
        rewrite = export_encoder(self.model, folder / f"{variant}-rewrite.onnx", lowering="rewrite",
                                 save_weights=False, profiles=profiles).path
        self.fast = ort_session(rewrite, args.threads)
        self.lean = ort_session(rewrite, args.threads, arena=False)  # memory runs only

    def feeds(self, batch: int, seq: int, pad_all: bool = False) -> dict:
        feeds = example_inputs(self.model, batch, seq, seed=1)
        if pad_all:
            for spec in self.model.input_specs():
                if spec.role == "attention_mask":
                    lengths = torch.tensor([max(1, seq * (4 - i % 4) // 4) for i in range(batch)])
                    feeds[spec.name] = (torch.arange(seq)[None] < lengths[:, None]).to(feeds[spec.name].dtype)
        return feeds

    def runners(self, feeds: dict):
        np_feeds = {k: v.numpy() for k, v in feeds.items()}

        def eager():
            with torch.inference_mode():
                self.model(**feeds)

        return eager, (lambda: ort_run(self.fast, np_feeds)), (lambda: ort_run(self.lean, np_feeds))


def fmt_ratio(x: float) -> str:
    return f"{x:.2f}x"


def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print(f"\n{title}")
    print("| " + " | ".join(h.rjust(w) for h, w in zip(header, widths)) + " |")
    print("|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|")
    for r in rows:
        print("| " + " | ".join(c.rjust(w) for c, w in zip(r, widths)) + " |")


# ----------------------------------------------------------------------------- the tables


def cost_table(contenders: dict[str, Contender], lengths, batches) -> None:
    rows = []
    for seq in lengths:
        for batch in batches:
            fns, lean = {}, {}
            for name, c in contenders.items():
                fns[f"{name}/torch"], fns[f"{name}/ort"], lean[name] = c.runners(c.feeds(batch, seq))
            t = interleaved(fns)  # also the warm-up of the memory runs: first-call allocations are not counted
            mem = {}
            for name in contenders:
                lean[name]()
                mem[name] = (peak_bytes(fns[f"{name}/torch"]), peak_bytes(lean[name]))
            base_t, base_o = t["mha/torch"], t["mha/ort"]
            base_mt, base_mo = mem["mha"]
            for name in contenders:
                tt, to = t[f"{name}/torch"], t[f"{name}/ort"]
                mt, mo = mem[name]
                rows.append([name, f"{batch}x{seq}", f"{tt * 1e3:,.1f}", fmt_ratio(tt / base_t), f"{mt / MB:,.1f}",
                             fmt_ratio(mt / max(base_mt, 1)), f"{to * 1e3:,.1f}", fmt_ratio(to / base_o),
                             f"{mo / MB:,.1f}", fmt_ratio(mo / max(base_mo, 1))])
            print(f"  {batch}x{seq} done", file=sys.stderr, flush=True)
    print_table("Cost relative to mha (CPU; torch eager = eval fast path, ORT fp32 = the rewrite-lowering file)",
                ["variant", "BxL", "torch ms", "x mha", "torch peak MB", "x mha", "ORT ms", "x mha", "ORT peak MB",
                 "x mha"], rows)


def engine_table(contenders: dict[str, Contender], batch: int, seq: int, folder: Path) -> None:
    from attnx.engine.build import build

    rows = []
    for name, c in contenders.items():
        t = time.perf_counter()
        try:
            result = build(c.path, folder / f"{name}.engine", shapes={"batch": (1, batch, batch), "seq": (1, seq, seq)})
        except Exception as e:  # a build failure is a row, not the end of the benchmark
            rows.append([name, "failed", " ".join(str(e).split())[:60], "", ""])
            continue
        rows.append([name, f"{time.perf_counter() - t:,.1f}", f"{result.engine_bytes / MB:,.2f}",
                     str(result.plugin_layers), str(result.sidecar.get("target", "?"))])
    if "mha" in contenders and rows[0][1] != "failed":
        for r in rows[1:]:
            if r[1] != "failed":
                r[1] += f" ({float(r[1].replace(',', '')) / float(rows[0][1].replace(',', '')):.2f}x)"
                r[2] += f" ({float(r[2]) / float(rows[0][2]):.2f}x)"
    print_table(f"TensorRT-RTX engine build (profile batch 1..{batch}, seq 1..{seq}; built on this CPU machine, "
                "not run)", ["variant", "build s (x mha)", "engine MB (x mha)", "plugin layers", "target"], rows)


def memory_table(contenders: dict[str, Contender], lengths, batch: int = 4) -> None:
    rows, peaks = [], {}
    for seq in lengths:
        for name, c in contenders.items():
            eager, _, lean = c.runners(c.feeds(batch, seq, pad_all=True))
            eager(), lean()  # warm-up: one-time allocations are not the call's working memory
            peaks[name, seq] = (peak_bytes(eager), peak_bytes(lean))
        print(f"  L={seq} done", file=sys.stderr, flush=True)
    for name in contenders:
        for seq in lengths:
            mt, mo = peaks[name, seq]
            prev = peaks.get((name, seq // 2))
            grow = [f"{mt / max(prev[0], 1):.2f}x", f"{mo / max(prev[1], 1):.2f}x"] if prev else ["", ""]
            base = peaks["mha", seq]
            rows.append([name, str(seq), f"{mt / MB:,.1f}", grow[0], fmt_ratio(mt / max(base[0], 1)),
                         f"{mo / MB:,.1f}", grow[1], fmt_ratio(mo / max(base[1], 1))])
    print_table(f"Peak memory against L (batch {batch}, rows padded to L, 3L/4, L/2, L/4)",
                ["variant", "L", "torch MB", "per 2x L", "x mha", "ORT MB", "per 2x L", "x mha"], rows)


def int8_profile(files: dict[str, Path], threads: int, batch: int = 8, runs: int = 10) -> None:
    """Where the time goes: ONNX Runtime's profiler, kernel time summed by op type, per run at ``batch`` x 128."""
    import collections
    import json

    from attnx.runtime.core.backends.onnxrt import OrtOptions

    feeds = {"input_ids": np.random.default_rng(1).integers(1000, 20000, (batch, 128)),
             "attention_mask": np.ones((batch, 128), np.int64), "token_type_ids": np.zeros((batch, 128), np.int64)}
    by_op = {}
    for name, path in files.items():
        options = OrtOptions(device="cpu", threads=threads)
        so = options.session_options()
        so.enable_profiling = True
        sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"],
                                    disabled_optimizers=list(options.disabled_optimizers))
        for _ in range(2 + runs):
            ort_run(sess, feeds)
        events = [e for e in json.loads(Path(sess.end_profiling()).read_text())
                  if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
        counts = collections.Counter()
        for e in events[len(events) * 2 // (2 + runs):]:  # after the two warm-up runs
            counts[e["args"]["op_name"]] += e["dur"] / runs / 1e3
        by_op[name] = counts
    ops = sorted((o for o in set().union(*by_op.values()) if max(c[o] for c in by_op.values()) >= 0.05),
                 key=lambda o: -max(c[o] for c in by_op.values()))
    rows = [[op, *(f"{c[op]:,.1f}" if c[op] >= 0.05 else "" for c in by_op.values())] for op in ops]
    rows.append(["total (kernels)", *(f"{sum(c.values()):,.1f}" for c in by_op.values())])
    print_table(f"Where the time goes at {batch}x128: ONNX Runtime profiler, kernel ms per run by op "
                "(the profiler's own cost included)", ["op", *(f"{k} ms" for k in by_op)], rows)


def int8_table(threads: int, folder: Path, profile: bool = False) -> None:
    """Real all-MiniLM-L6-v2: int8 vs fp32 on ORT, and each file's sentence embeddings vs sentence-transformers."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from sentence_transformers import SentenceTransformer

    from attnx.contract import ModelInfo
    from attnx.export.pretrained import export_pretrained
    from attnx.export.quantize import quantize_file
    from attnx.export.tokenizer import ExportTokenizer
    from attnx.pretrained import minilm_path
    from attnx.pretrained.sentences import SENTENCES

    from onnxruntime.quantization import QuantType, quantize_dynamic

    from attnx.runtime.core.cpu import int8_dot_product, saturates_8bit_weights

    fp32 = export_pretrained(minilm_path(), folder / "minilm.onnx").path
    files = {"fp32": fp32}
    how = {"fp32": "attnx export (the baseline)"}

    def quantized(name: str, detail: str, **kw) -> None:
        files[name], how[name] = folder / f"minilm-{len(files)}.onnx", detail
        quantize_file(fp32, files[name], **kw)

    quantized("attnx int8", "attnx export --int8 (default: 7-bit weights, smoothed)")
    if not saturates_8bit_weights():  # only where the integer GEMM cannot clip full-range weights
        quantized("attnx int8, 8-bit weights", "attnx export --int8 --int8-weight-bits 8", weight_bits=8)
    quantized("attnx int8, unsmoothed", "quantize_file(smoothing=False): what SmoothQuant buys", smoothing=False)
    # the alternative attnx did not choose: ORT's own dynamic quantization (one activation scale per
    # tensor), in its defaults and in its most accurate setting here (per-channel uint8 weights)
    for name, detail, kw in (("ORT quantize_dynamic", "defaults (int8 weights per tensor)", {}),
                             ("ORT quantize_dynamic, per-channel u8", "per_channel=True, weight_type=QUInt8",
                              {"per_channel": True, "weight_type": QuantType.QUInt8})):
        files[name], how[name] = folder / f"minilm-{len(files)}.onnx", detail
        quantize_dynamic(fp32, files[name], op_types_to_quantize=["MatMul", "Gemm"], **kw)
    sessions = {name: ort_session(path, threads) for name, path in files.items()}

    # accuracy: the built-in sentences, padded to the longest, against sentence-transformers
    ref = SentenceTransformer(str(minilm_path()), device="cpu").encode(SENTENCES, convert_to_numpy=True)
    enc = ExportTokenizer(fp32, ModelInfo.read(fp32)).encode(SENTENCES)
    width = max(len(e.ids) for e in enc)
    ids = np.zeros((len(enc), width), np.int64)
    for i, e in enumerate(enc):
        ids[i, :len(e.ids)] = e.ids
    real = {"input_ids": ids, "attention_mask": (np.arange(width)[None] < np.array([[len(e.ids)] for e in enc]))
            .astype(np.int64), "token_type_ids": np.zeros_like(ids)}
    cosine = {}
    for name, s in sessions.items():
        emb = ort_run(s, real, ["sentence_embedding"])[0]
        cosine[name] = (emb * ref).sum(1) / np.linalg.norm(emb, axis=1) / np.linalg.norm(ref, axis=1)

    speed: dict[str, list[str]] = {name: [] for name in files}
    rng = np.random.default_rng(0)
    for batch in (1, 8):
        feeds = {"input_ids": rng.integers(1000, 20000, (batch, 128)), "attention_mask": np.ones((batch, 128), np.int64),
                 "token_type_ids": np.zeros((batch, 128), np.int64)}
        t = interleaved({k: (lambda s=s: ort_run(s, feeds)) for k, s in sessions.items()}, min_rounds=5)
        for name in files:
            speed[name] += [f"{t[name] * 1e3:,.1f}", f"{t['fp32'] / t[name]:.2f}x"]
    rows = [[name, *speed[name], f"{files[name].stat().st_size / MB:.1f}", f"{cosine[name].min():.4f}",
             f"{cosine[name].mean():.4f}", how[name]] for name in files]
    if profile:
        int8_profile({k: files[k] for k in ("fp32", "attnx int8")}, threads)
    print_table(f"all-MiniLM-L6-v2 on ONNX Runtime {ort.__version__}, int8 vs fp32 ({threads} threads; "
                f"CPU integer dot product: {int8_dot_product()}); cosine: the {len(SENTENCES)} built-in sentences' "
                "embeddings vs sentence-transformers",
                ["file", "1x128 ms", "speed-up", "8x128 ms", "speed-up", "MB", "min cosine", "mean cosine", "how"],
                rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="L 128 and 512, batch 1 and 8; memory to L 1024")
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--d-model", type=int, default=384)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--variants", nargs="+", default=None, help="default: every registered variant")
    ap.add_argument("--no-engine", action="store_true", help="skip the TensorRT-RTX engine builds")
    ap.add_argument("--engine-seq", type=int, default=512, help="the engines' profile max seq (one L: builds are slow)")
    ap.add_argument("--memory", action="store_true", help="only the peak-memory-against-L table")
    ap.add_argument("--memory-lengths", type=int, nargs="+", default=[128, 256, 512, 1024, 2048, 4096])
    ap.add_argument("--int8", action="store_true", help="only the real-MiniLM int8 table")
    ap.add_argument("--profile", action="store_true", help="with --int8: kernel time by op, fp32 and int8, at 8x128")
    args = ap.parse_args()
    if args.quick:
        args.lengths, args.memory_lengths = [128, 512], [128, 256, 512, 1024]
    torch.set_num_threads(args.threads)  # == ORT intra-op threads (ort_session)
    torch.set_grad_enabled(False)
    pin_malloc()
    folder = Path(tempfile.mkdtemp(prefix="attnx-bench-variants-"))
    print(f"torch {torch.__version__}, onnxruntime {ort.__version__}, {args.threads} threads each")
    if args.int8:
        int8_table(args.threads, folder, profile=args.profile)
        return
    names = args.variants or list(variant_names())
    names = ["mha"] + [n for n in names if n != "mha"]  # the baseline first
    print(f"variants {', '.join(names)}; d_model {args.d_model}, {args.heads} heads, {args.layers} layer(s), fp32")
    contenders = {name: Contender(name, args, folder) for name in names}
    if args.memory:
        memory_table(contenders, args.memory_lengths)
        return
    cost_table(contenders, args.lengths, args.batches)
    if not args.no_engine:
        engine_table(contenders, max(args.batches), args.engine_seq, folder)


if __name__ == "__main__":
    main()
