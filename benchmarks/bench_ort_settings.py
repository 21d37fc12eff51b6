"""What each ONNX Runtime session setting gives, against attnx.runtime's default (``OrtOptions()``), in one process.

One file (default: the real all-MiniLM-L6-v2 fp32 export, or ``--model FILE``), one session per
setting, timed in interleaved rounds (rotating order, fastest round), at each ``--shape`` BxL. Each row
changes one setting from the default; "x default" < 1 is faster. Peak memory is the resident
high-water mark growth during one call (see ``bench_variants.py``). IO binding (outputs bound to
pre-allocated buffers) is timed on the default session. With the arena on, a warmed-up call grows
nothing (its buffers stay in the arena), so that column shows what arena=off maps and frees per call.

    python benchmarks/bench_ort_settings.py [--model FILE] [--shapes 1x128 8x128] [--threads N]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
import onnxruntime as ort
from bench_variants import MB, interleaved, peak_bytes, pin_malloc, print_table

from attnx.runtime.core.backends.onnxrt import OnnxRuntimeSession, OrtOptions, default_threads, denormals_flushed

SETTINGS = {  # name -> OrtOptions overrides (one change each)
    "default": {},
    "optimization=basic": {"optimization": "basic"},
    "optimization=none": {"optimization": "none"},
    "spin=on": {"spin": True},
    "arena=off": {"arena": False},
    "mem_pattern=off": {"mem_pattern": False},
    "inter_threads=2 (parallel)": {"inter_threads": 2},
    "SkipLayerNormFusion on": {"disabled_optimizers": ()},
    "denormal_as_zero=off": {"denormal_as_zero": False},
}


def feeds_for(sess: OnnxRuntimeSession, batch: int, seq: int) -> dict:
    rng = np.random.default_rng(0)
    out = {}
    for spec in sess.inputs:
        shape = [batch if d == "batch" else seq if d == "seq" else int(d) for d in spec.shape]
        if spec.role == "attention_mask":
            out[spec.name] = (np.arange(seq)[None] < np.array([[max(1, seq - i * seq // 8)] for i in range(batch)]))\
                .astype(spec.dtype)
        elif spec.dtype.kind == "f":
            out[spec.name] = rng.standard_normal(shape).astype(spec.dtype)
        else:
            low, high = spec.range or (0, 2)
            out[spec.name] = rng.integers(low, min(high, 2 if spec.role == "token_type_ids" else high), shape).astype(spec.dtype)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--shapes", nargs="+", default=["1x128", "8x128"])
    ap.add_argument("--threads", type=int, default=default_threads())
    args = ap.parse_args()
    pin_malloc()
    path = args.model
    if path is None:
        from attnx.export.pretrained import export_pretrained
        from attnx.pretrained import minilm_path

        path = export_pretrained(minilm_path(), Path(tempfile.mkdtemp()) / "minilm.onnx").path
    sessions = {name: OnnxRuntimeSession(path, OrtOptions(device="cpu", threads=args.threads, **kw))
                for name, kw in SETTINGS.items()}
    print(f"onnxruntime {ort.__version__}, {path.name}, {args.threads} intra-op threads")
    rows = []
    for shape in args.shapes:
        batch, seq = (int(v) for v in shape.lower().split("x"))
        feeds = feeds_for(sessions["default"], batch, seq)
        fns = {name: (lambda s=s: s._run(feeds, [o.name for o in s.outputs])) for name, s in sessions.items()}

        base = sessions["default"]._sess
        binding = base.io_binding()
        for k, v in feeds.items():
            binding.bind_cpu_input(k, v)
        for o in base.get_outputs():
            binding.bind_output(o.name, "cpu")

        def io_bound(base=base, binding=binding):
            with denormals_flushed():  # as the default session's runs
                base.run_with_iobinding(binding)

        fns["io_binding"] = io_bound

        t = interleaved(fns, min_rounds=5, budget_s=10.0)
        for name in fns:
            mem = peak_bytes(fns[name])
            rows.append([shape, name, f"{t[name] * 1e3:,.1f}", f"{t[name] / t['default']:.2f}x", f"{mem / MB:,.1f}"])
        print(f"  {shape} done", file=sys.stderr, flush=True)
    print_table("ONNX Runtime settings, one change from attnx's default each",
                ["BxL", "setting", "ms", "x default", "peak MB (one call)"], rows)


if __name__ == "__main__":
    main()
