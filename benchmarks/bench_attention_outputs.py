"""What attention outputs and a head_mask input cost on the deployed model (issue 13, item 1).

The real all-MiniLM-L6-v2 exported three ways — plain, with ``--head-mask``, and with
``--attention-outputs all --head-mask`` — timed on ONNX Runtime (CPU) in one process, interleaved
rounds, the same threads for every session. Ratios are against the plain export:

- ``head-mask``: the extra input alone (ones = no ablation), i.e. what a served model pays for
  being ablatable;
- ``outputs, embedding only``: the export with ``attentions.{i}`` outputs, asked only for the
  embedding (what normal traffic pays when the server hides the attention outputs);
- ``outputs, all``: the same file asked for every attention map too (what ``attnx explain`` pays).

Also printed: node counts, so "a plain export has nothing extra" is visible, not assumed.

    .venv/bin/python benchmarks/bench_attention_outputs.py [--batch 8] [--seq 128] [--rounds 5] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from rich.console import Console
from rich.table import Table


def export_three(folder: Path) -> dict[str, Path]:
    from attnx.export.pretrained import export_pretrained
    from attnx.pretrained import minilm_path

    src = minilm_path()
    return {
        "plain": export_pretrained(src, folder / "plain.onnx").path,
        "head-mask": export_pretrained(src, folder / "mask.onnx", head_mask=True).path,
        "outputs": export_pretrained(src, folder / "outputs.onnx", attention_outputs="all", head_mask=True).path,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--runs", type=int, default=3, help="runs per contender per round")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    args = ap.parse_args()
    console = Console()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    with tempfile.TemporaryDirectory() as tmp:
        paths = export_three(Path(tmp))
        so = ort.SessionOptions()
        so.intra_op_num_threads = args.threads
        so.inter_op_num_threads = 1
        sessions = {k: ort.InferenceSession(str(p), so, providers=["CPUExecutionProvider"]) for k, p in paths.items()}
        nodes = {k: len(onnx.load(str(p), load_external_data=False).graph.node) for k, p in paths.items()}

    rng = np.random.default_rng(0)
    ids = rng.integers(1000, 20000, (args.batch, args.seq)).astype(np.int64)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}
    n_layers = sum(o.name.startswith("attentions.") for o in sessions["outputs"].get_outputs())
    heads = sessions["outputs"].get_outputs()[-1].shape[1]
    mask = {"head_mask": np.ones((n_layers, heads), np.float32)}
    contenders = {
        "plain": lambda: sessions["plain"].run(["sentence_embedding"], feeds),
        "head-mask": lambda: sessions["head-mask"].run(["sentence_embedding"], {**feeds, **mask}),
        "outputs, embedding only": lambda: sessions["outputs"].run(["sentence_embedding"], {**feeds, **mask}),
        "outputs, all": lambda: sessions["outputs"].run(None, {**feeds, **mask}),
    }
    for run in contenders.values():  # warm-up
        run()
    times: dict[str, list[float]] = {k: [] for k in contenders}
    for _ in range(args.rounds):
        for name, run in contenders.items():  # interleaved: background load hits every contender alike
            t = time.perf_counter()
            for _ in range(args.runs):
                run()
            times[name].append((time.perf_counter() - t) / args.runs)

    base = statistics.median(times["plain"])
    file_of = {"plain": "plain", "head-mask": "head-mask", "outputs, embedding only": "outputs", "outputs, all": "outputs"}
    table = Table(title=f"all-MiniLM-L6-v2 on ONNX Runtime CPU, {args.batch}x{args.seq} tokens, "
                        f"{args.threads} threads, median of {args.rounds} interleaved rounds")
    for col in ("export / outputs asked", "nodes", "ms", "x plain"):
        table.add_column(col, justify="left" if col.startswith("export") else "right")
    for name, ts in times.items():
        ms = statistics.median(ts)
        table.add_row(name, str(nodes[file_of[name]]), f"{ms * 1e3:.1f}", f"{ms / base:.2f}")
    console.print(table)


if __name__ == "__main__":
    main()
