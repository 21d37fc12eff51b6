"""What each variant's default export costs next to mha's on ONNX Runtime, as users run it.

The file is what ``attnx export --variant X`` writes (the default lowering, ``plugin``), run two ways:

- **plain**: ``onnxruntime.InferenceSession(path)`` with default ``SessionOptions`` but for the thread count
  (what Triton's ONNX Runtime backend, ``TextModel``-less scripts and other tools do);
- **attnx**: ``attnx.runtime``'s session (``OnnxRuntimeSession``: no spinning, denormals flushed, ...).

Every variant at L in ``--lengths`` and batch in ``--batches``, rows padded (lengths L, 3L/4, L/2, L/4, ...),
timed in interleaved rounds (rotating order, a pause between calls; the fastest round), ratios against mha of
the same run and the same session kind. ``--lowering rewrite`` measures the other lowering instead. ``--forms`` adds, for a
variant whose op has a TensorRT form (smal), that form run by ONNX Runtime (``<v> tensorrt-form``: the
distance op and an explicit softmax, which was the default file before issue 25) and its ``rewrite`` file.

    python benchmarks/bench_default_export.py [--lengths 512 1024 2048] [--batches 1 8] [--threads N] [--forms]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from attnx.engine.forms import engine_form
from attnx.export import export_variant
from attnx.export.exporter import save_model
from attnx.export.exporter import example_inputs
from attnx.models.spec import variant_names
from attnx.runtime.core.backends.onnxrt import OnnxRuntimeSession, OrtOptions

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_variants import print_table  # noqa: E402

#: Seconds between two timed calls (not timed): a plain session's pool threads spin on after a run (ONNX
#: Runtime's default) and would take the cores from whichever contender runs next.
PAUSE_S = 0.1


def interleaved(fns: dict, min_rounds: int, budget_s: float) -> dict[str, float]:
    """Fastest seconds per callable over rounds in rotating order (one warm-up each, a pause between calls)."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    start, rounds = time.perf_counter(), 0
    while rounds < min_rounds or (time.perf_counter() - start < budget_s and rounds < 30):
        order = list(fns.items())
        for name, fn in order[rounds % len(order):] + order[:rounds % len(order)]:
            time.sleep(PAUSE_S)
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
        rounds += 1
    return {k: min(v) for k, v in times.items()}


def plain_session(path: Path, threads: int) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads  # equal thread counts; everything else ONNX Runtime's defaults
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def padded_feeds(model, batch: int, seq: int) -> dict[str, np.ndarray]:
    """The export's example inputs at batch x seq, row i keeping L * (4 - i % 4) / 4 tokens."""
    feeds = {k: v.numpy() for k, v in example_inputs(model, batch, seq, seed=1).items()}
    for spec in model.input_specs():
        if spec.role == "attention_mask":
            lengths = np.array([max(1, seq * (4 - i % 4) // 4) for i in range(batch)])
            feeds[spec.name] = (np.arange(seq)[None] < lengths[:, None]).astype(feeds[spec.name].dtype)
    return feeds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--d-model", type=int, default=384)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5, help="at least this many interleaved rounds per cell")
    ap.add_argument("--budget", type=float, default=10.0, help="seconds of further rounds per cell (at most 30)")
    ap.add_argument("--lowering", default="plugin", choices=("plugin", "rewrite"))
    ap.add_argument("--variants", nargs="+", default=None, help="default: every registered variant")
    ap.add_argument("--forms", action="store_true", help="also the TensorRT form and the rewrite file (smal)")
    ap.add_argument("--pairwise-above", type=float, default=1e8,
                    help="where B x H x L x L exceeds this, time each variant in a pair with mha (memory: every "
                         "ONNX Runtime session keeps its O(L^2) working set in its arena)")
    ap.add_argument("--forms-max-scores", type=float, default=1e8,
                    help="skip the TensorRT form where B x H x L x L exceeds this (its explicit scores' memory)")
    args = ap.parse_args()
    names = ["mha"] + [n for n in (args.variants or variant_names()) if n != "mha"]
    folder = Path(tempfile.mkdtemp(prefix="attnx-bench-default-"))
    profiles = {"batch": (1, 8, 32), "seq": (1, 512, 4096)}
    options = {"d_model": args.d_model, "n_heads": args.heads}
    exports = {n: export_variant(n, folder / f"{n}.onnx", overrides=options, n_layers=args.layers,
                                 lowering=args.lowering, profiles=profiles) for n in names}
    files = {n: r.path for n, r in exports.items()}
    models = {n: r.model for n, r in exports.items()}
    if args.forms:
        for n in names:
            form = engine_form(onnx.load(str(files[n])))
            if form is None:
                continue
            files[f"{n} tensorrt-form"] = folder / f"{n}-tensorrt-form.onnx"
            save_model(form, files[f"{n} tensorrt-form"])
            files[f"{n} rewrite"] = export_variant(n, folder / f"{n}-rewrite.onnx", overrides=options,
                                                   n_layers=args.layers, lowering="rewrite", profiles=profiles).path
            models[f"{n} tensorrt-form"] = models[f"{n} rewrite"] = models[n]
    print(f"onnxruntime {ort.__version__}, {args.threads} threads; {args.lowering} lowering (attnx export's "
          f"{'default' if args.lowering == 'plugin' else 'other lowering'}); d_model {args.d_model}, "
          f"{args.heads} heads, {args.layers} layers, fp32; rows padded to L, 3L/4, L/2, L/4", flush=True)
    rows = []
    for seq in args.lengths:
        for batch in args.batches:
            # Sessions live for one cell and one kind at a time: each keeps its largest working set in its
            # arena, and at 8x2048 a dozen of them would not fit in memory together. The TensorRT form's
            # explicit [B, H, L, L] tensors are left out past --forms-max-scores elements.
            big = batch * args.heads * seq * seq > args.forms_max_scores
            names_here = [n for n in files if not (big and n.endswith("tensorrt-form"))]
            feeds = {n: padded_feeds(models[n], batch, seq) for n in names_here}
            # Past --pairwise-above, each variant is timed against mha in a pair (two sessions alive).
            groups = [names_here] if batch * args.heads * seq * seq <= args.pairwise_above else \
                [["mha", n] for n in names_here if n != "mha"]
            t = {"plain": {}, "attnx": {}}  # kind -> name -> (seconds, mha's seconds in the same group)
            for kind in ("plain", "attnx"):
                for group in groups:
                    sessions = {n: plain_session(files[n], args.threads) if kind == "plain" else
                                OnnxRuntimeSession(files[n], OrtOptions(device="cpu", threads=args.threads))
                                for n in group}
                    fns = {n: (lambda s=s, f=feeds[n]: s.run(None, f)) if kind == "plain" else
                           (lambda s=s, f=feeds[n]: s.run(f)) for n, s in sessions.items()}
                    got = interleaved(fns, args.rounds, args.budget)
                    for n in group:
                        if n != "mha" or "mha" not in t[kind] or got["mha"] < t[kind]["mha"][0]:
                            t[kind][n] = (got[n], got["mha"])
                    del sessions, fns
            for n in names_here:
                cells = []
                for kind in ("plain", "attnx"):
                    seconds, base = t[kind][n]
                    cells += [f"{seconds * 1e3:,.1f}", f"{seconds / base:.2f}x"]
                rows.append([n, f"{batch}x{seq}", *cells])
                print("  " + " | ".join(rows[-1]), file=sys.stderr, flush=True)
    print_table("Default export vs mha on ONNX Runtime (fastest of interleaved rounds)",
                ["variant", "BxL", "plain ms", "x mha", "attnx ms", "x mha"], rows)


if __name__ == "__main__":
    main()
