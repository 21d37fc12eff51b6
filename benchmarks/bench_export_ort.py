"""ONNX Runtime (CPU) vs PyTorch eager for every variant and both lowerings.

Ratios are measured in one process: ``eager / ort`` (>= 1.0 means ONNX Runtime is
no slower) and ``plugin / rewrite`` on ONNX Runtime (target <= 1.5). For smal the
eager reference computes the literal distance; its rewrite path is timed too.

    python benchmarks/bench_export_ort.py [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
from rich.console import Console
from rich.table import Table

from attnx.export import export_encoder
from attnx.export.exporter import example_inputs
from attnx.models import build_encoder

VARIANTS = ["mha", "cultural", "metaphor", "maw", "smal"]
CONFIGS = [  # (batch, seq, d_model, heads)
    (8, 128, 256, 4),
    (4, 512, 768, 12),
]


def timeit(fn, min_runs=3, budget_s=4.0) -> float:
    t = time.perf_counter()
    fn()  # warm-up
    if time.perf_counter() - t > budget_s:  # a slow path (smal's literal distance at L=512): one more run
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t
    times = []
    start = time.perf_counter()
    while len(times) < min_runs or (time.perf_counter() - start < budget_s and len(times) < 50):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def ort_session(path: Path) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.intra_op_num_threads = torch.get_num_threads()
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the small configuration")
    args = parser.parse_args()
    console = Console(width=170)
    table = Table(title=f"ONNX Runtime {ort.__version__} CPU vs PyTorch {torch.__version__} eager "
                        f"({torch.get_num_threads()} threads)")
    for col in ("variant", "B x L, d/H", "eager ms", "ort plugin ms", "ort rewrite ms",
                "eager/ort plugin", "eager/ort rewrite", "plugin/rewrite"):
        table.add_column(col, justify="right")
    folder = Path(tempfile.mkdtemp(prefix="attnx-bench-"))
    for batch, seq, d, h in CONFIGS[:1] if args.quick else CONFIGS:
        for variant in VARIANTS:
            model = build_encoder(variant, d_model=d, n_heads=h, n_layers=2, seed=0)
            feeds = example_inputs(model, batch, seq, seed=1)
            np_feeds = {k: v.numpy() for k, v in feeds.items()}
            with torch.inference_mode():
                eager = timeit(lambda: model(**feeds))
            extra = ""
            if variant == "smal":
                for block in model.blocks:
                    block.attn.config.use_rewrite = True
                with torch.inference_mode():
                    extra = f" (rewrite path {timeit(lambda: model(**feeds)) * 1e3:.1f})"
                for block in model.blocks:
                    block.attn.config.use_rewrite = False
            ort_ms = {}
            for lowering in ("plugin", "rewrite"):
                path = export_encoder(model, folder / f"{variant}-{lowering}-{seq}.onnx", lowering=lowering,
                                      save_weights=False).path
                sess = ort_session(path)
                ort_ms[lowering] = timeit(lambda: sess.run(None, np_feeds))
            table.add_row(variant, f"{batch}x{seq}, {d}/{h}", f"{eager * 1e3:.1f}{extra}",
                          f"{ort_ms['plugin'] * 1e3:.1f}", f"{ort_ms['rewrite'] * 1e3:.1f}",
                          f"{eager / ort_ms['plugin']:.2f}", f"{eager / ort_ms['rewrite']:.2f}",
                          f"{ort_ms['plugin'] / ort_ms['rewrite']:.2f}")
            console.print(f"[dim]{variant} {batch}x{seq} done[/dim]")
    console.print(table)


if __name__ == "__main__":
    main()
