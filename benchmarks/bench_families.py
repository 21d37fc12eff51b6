"""attnx's exports of transformers' own models against Hugging Face Optimum's export of the same
folder (issue 22's bar: ONNX Runtime speed ratio >= 1.0), for a Llama-shaped decoder and a
BERT-shaped encoder.

- ``llama``: a random-weight Llama (hidden 512, 8 layers, 8 heads, 4 key/value heads, FFN 1376,
  vocab 16000; about SmolLM's width), saved with ``save_pretrained``; logits for every position.
  Optimum: ``optimum-cli export onnx --task text-generation`` (no cache), fed ``position_ids``;
  attnx: ``attnx export --from-pretrained`` (positions from the mask, in the graph).
- ``bert``: the real all-MiniLM-L6-v2, ``last_hidden_state``. Optimum: ``--task feature-extraction``.

Both files run in the same ONNX Runtime session settings (attnx.runtime's ``OrtOptions``, equal
``intra_op_num_threads``), timed in interleaved rounds in this one process; each pair is first
checked to compute the same thing. Optimum pins an older transformers, so it runs in its own venv
(``bench_pretrained.py``'s, created with pip on first use); only its export runs there.

    .venv/bin/python benchmarks/bench_families.py [--models llama bert] [--shapes 1x128 8x128] [--rounds 7]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))
import torch  # noqa: E402
from bench_pretrained import OPTIMUM_VENV, optimum_python, time_interleaved  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

console = Console(width=130)
LLAMA = dict(vocab_size=16000, hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
             intermediate_size=1376, max_position_embeddings=2048, tie_word_embeddings=True)


def _log(msg: str) -> None:
    console.print(f"[dim]{msg}[/dim]", highlight=False)


def llama_folder(root: Path) -> Path:
    import transformers

    folder = root / "llama"
    if not (folder / "config.json").is_file():
        config = transformers.LlamaConfig(**LLAMA)
        config.architectures = ["LlamaForCausalLM"]
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def optimum_export(python: Path, folder: Path, task: str, out: Path) -> Path:
    if not (out / "model.onnx").is_file():
        _log(f"Optimum export of {folder.name} ({task}) in its own venv...")
        cmd = [str(python.parent / "optimum-cli"), "export", "onnx", "--model", str(folder), "--task", task, str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError("Optimum's export failed: " + " ".join((proc.stderr or proc.stdout).split())[-400:])
    return out / "model.onnx"


def session(path: Path, threads: int):
    from attnx.runtime.core.backends.onnxrt import OrtOptions

    return OrtOptions(device="cpu", threads=threads).inference_session(path)


def ids_for(vocab: int, batch: int, seq: int) -> np.ndarray:
    return np.random.default_rng(0).integers(5, vocab, (batch, seq)).astype(np.int64)


def contenders_for(name: str, attnx_path: Path, optimum_path: Path, batch: int, seq: int, threads: int) -> dict:
    ids = ids_for(16000 if name == "llama" else 30522, batch, seq)
    mask = np.ones_like(ids)
    out = "logits" if name == "llama" else "last_hidden_state"
    a, o = session(attnx_path, threads), session(optimum_path, threads)
    a_feeds = {k: v for k, v in {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}.items()
               if k in {i.name for i in a.get_inputs()}}
    o_feeds = {"input_ids": ids, "attention_mask": mask}
    o_names = {i.name for i in o.get_inputs()}
    if "position_ids" in o_names:
        o_feeds["position_ids"] = np.broadcast_to(np.arange(seq, dtype=np.int64), ids.shape).copy()
    if "token_type_ids" in o_names:
        o_feeds["token_type_ids"] = np.zeros_like(ids)
    return {"attnx": lambda: a.run([out], a_feeds)[0], "optimum": lambda: o.run([out], o_feeds)[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["llama", "bert"], choices=["llama", "bert"])
    ap.add_argument("--shapes", nargs="+", default=["1x128", "8x128"])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--optimum-venv", type=Path, default=OPTIMUM_VENV)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import transformers

    from attnx.export.pretrained import export_pretrained
    from attnx.pretrained import minilm_path

    transformers.logging.set_verbosity_error()
    tmp = None
    if args.workdir is None:
        tmp = tempfile.TemporaryDirectory()
        args.workdir = Path(tmp.name)
    args.workdir.mkdir(parents=True, exist_ok=True)
    python, why = optimum_python(args.optimum_venv, True)
    if python is None:
        raise SystemExit(f"no Optimum to compare with: {why}")
    rows = []
    for name in args.models:
        folder = llama_folder(args.workdir) if name == "llama" else minilm_path()
        task = "text-generation" if name == "llama" else "feature-extraction"
        attnx_path = args.workdir / f"attnx-{name}.onnx"
        if not attnx_path.is_file():
            _log(f"attnx export of {name}...")
            t = time.perf_counter()
            export_pretrained(folder, attnx_path)
            _log(f"  {time.perf_counter() - t:.0f}s")
        optimum_path = optimum_export(python, folder, task, args.workdir / f"optimum-{name}")
        for shape in args.shapes:
            batch, seq = (int(v) for v in shape.lower().split("x"))
            contenders = contenders_for(name, attnx_path, optimum_path, batch, seq, args.threads)
            diff = float(np.abs(contenders["attnx"]() - contenders["optimum"]()).max())
            _log(f"{name} {shape}: max |attnx - optimum| {diff:.1e}; timing {args.rounds} rounds...")
            ms = time_interleaved(contenders, args.rounds, args.runs)
            rows.append((name, shape, ms["attnx"] * 1e3, ms["optimum"] * 1e3, ms["optimum"] / ms["attnx"], diff))
    table = Table(title=f"ONNX Runtime, fp32 CPU, {args.threads} threads, median of {args.rounds} interleaved rounds",
                  title_justify="left")
    for col in ("model", "shape", "attnx ms", "Optimum ms", "speed ratio Optimum / attnx (goal >= 1.0)",
                "max |diff|"):
        table.add_column(col, justify="left" if col in ("model", "shape") else "right")
    for name, shape, a, o, ratio, diff in rows:
        table.add_row(name, shape, f"{a:.2f}", f"{o:.2f}", f"{ratio:.2f}", f"{diff:.1e}")
    console.print(table)
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
