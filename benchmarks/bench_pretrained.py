"""The real all-MiniLM-L6-v2 exported by attnx against Hugging Face Optimum and transformers (issue 11, item 6).

Contenders, all on the CPU, fp32, timed in this one process in interleaved rounds (every contender
once per round, so background load hits them alike), ONNX Runtime sessions with the same
``intra_op_num_threads`` and ``torch.set_num_threads`` equal to it:

- ``attnx mha``: ``attnx export --from-pretrained`` of the folder (plugin lowering, the default),
  and ``attnx mha unfused``: the same without :mod:`attnx.export.fuse` (packed Q/K/V, 3-D attention);
- ``optimum``: Optimum's ONNX export of the same folder (``optimum-cli export onnx --task
  feature-extraction``, optimum-onnx), and ``optimum + ort-opt``: that file after
  ``onnxruntime.transformers.optimizer.optimize_model(model_type="bert")`` (fused Attention,
  SkipLayerNormalization, BiasGelu, EmbedLayerNormalization);
- ``transformers eager``: ``BertModel`` with ``attn_implementation="eager"`` under ``torch.no_grad``;
- ``attnx <variant>``: each variant placed in the model (cultural, metaphor, smal in every layer;
  maw appended, its own form), exported with the ``rewrite`` lowering: the variant's fast path
  (SMAL's exact rewrite with fused attention, MAW's depth gather) in standard ops.

Every ONNX contender is asked for ``last_hidden_state`` only (Optimum's export has no pooling; the
transformers model returns it too). Optimum pins its own transformers, so it lives in its own
virtual environment (``--optimum-venv``, created there with pip on first use) and only its export
runs there, in a subprocess; the optimizer runs here, with the ONNX Runtime that times the file.

``GEMM GFLOP x mha``: a variant's weight-GEMM arithmetic against mha's (its extra projections: a
slowdown near this ratio is arithmetic, not overhead); ``GEMM GFLOP/s``: that arithmetic per second
(near the CPU's FMA peak, no graph can be much faster).

Ratios: ``optimum / attnx`` etc. are speed-ups of attnx's export (goal >= 1.0 against
Optimum + optimizer, >= 2.0 against transformers eager); ``variant / mha`` is a slowdown (goal
<= 1.3). Token ids come from real text (the built-in sentences, tokenized by the model's own
tokenizer and cut to the length), every row full length.

    .venv/bin/python benchmarks/bench_pretrained.py [--shapes 1x128 8x128] [--rounds 7] [--threads N]
        [--variants cultural metaphor maw smal] [--workdir DIR] [--no-optimum] [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

# torch's OpenMP threads must not busy-wait after eager runs either (set before torch loads OpenMP)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch  # noqa: E402
from rich.console import Console
from rich.table import Table

UNFUSED = "mha unfused"  # the same export without attnx.export.fuse: what the fusions are worth
OPTIMUM_VENV = Path.home() / ".cache" / "attnx-bench" / "optimum-venv"
# torch from the machine's own wheel where there is one; optimum-onnx brings its own transformers.
OPTIMUM_PACKAGES = ["optimum-onnx", "onnxruntime"]
console = Console(width=120)  # the tables stay unwrapped in logs


def _log(msg: str) -> None:
    console.print(f"[dim]{msg}[/dim]", highlight=False)


# ----------------------------------------------------------------------------- the files


def export_attnx(folder: Path, variants: list[str]) -> dict[str, tuple[Path, object]]:
    """``{name: (onnx, host model)}``: mha (default lowering) and each variant's fast path. Reused
    when ``folder`` already holds them (``--workdir``)."""
    from attnx.export.pretrained import export_pretrained
    from attnx.pretrained import load, minilm_path

    out = {}
    for name in ["mha", UNFUSED, *variants]:
        variant, fuse = ("mha", False) if name == UNFUSED else (name, True)
        lowering = "plugin" if variant == "mha" else "rewrite"
        path = folder / f"attnx-{variant}-{lowering}{'' if fuse else '-unfused'}.onnx"
        if path.is_file():
            out[name] = (path, load(minilm_path(), variant))
            continue
        _log(f"exporting attnx {name} ({lowering} lowering)...")
        t = time.perf_counter()
        res = export_pretrained(minilm_path(), path, variant=variant, lowering=lowering, fuse=fuse)
        _log(f"  {time.perf_counter() - t:.0f}s")
        out[name] = (res.path, res.model)
    return out


def optimum_python(venv: Path, setup: bool) -> tuple[Path | None, str]:
    """The Optimum venv's python (created with pip when missing and ``setup``), or why not."""
    python = venv / "bin" / "python"
    check = [str(python), "-c", "import optimum.exporters.onnx, transformers; print(transformers.__version__)"]
    if python.is_file() and subprocess.run(check, capture_output=True).returncode == 0:
        return python, ""
    if not setup:
        return None, f"no Optimum environment at {venv} (run once without --no-optimum-setup)"
    _log(f"creating {venv} with {' '.join(OPTIMUM_PACKAGES)} (once)...")
    venv.parent.mkdir(parents=True, exist_ok=True)
    steps = [[sys.executable, "-m", "venv", str(venv)]]
    torch_pin = f"torch=={torch.__version__}"  # the same torch build as here (a local wheel where the machine has one)
    steps.append([str(python), "-m", "pip", "install", "-q", torch_pin, *OPTIMUM_PACKAGES])
    for cmd in steps:
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = " ".join((proc.stderr or proc.stdout).split())[-300:]
            return None, f"could not set up Optimum in {venv}: {tail}"
    return (python, "") if subprocess.run(check, capture_output=True).returncode == 0 else \
        (None, f"Optimum does not import in {venv}")


def export_optimum(python: Path, folder: Path) -> tuple[Path | None, Path | None, str]:
    """``(optimum onnx, optimized onnx, note)``: Optimum's export in its venv, then ORT's optimizer here."""
    from attnx.pretrained import minilm_path

    out = folder / "optimum"
    plain, opt = out / "model.onnx", out / "model-ortopt.onnx"
    if not plain.is_file():
        _log("exporting with Optimum (its own venv)...")
        cmd = [str(python.parent / "optimum-cli"), "export", "onnx", "--model", str(minilm_path()), "--task",
               "feature-extraction", "--library-name", "transformers", str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        if proc.returncode != 0 or not plain.is_file():
            return None, None, "Optimum's export failed: " + " ".join((proc.stderr or proc.stdout).split())[-300:]
    version = subprocess.run([str(python), "-c", "import importlib.metadata as m; print(m.version('optimum-onnx'))"],
                             capture_output=True, text=True).stdout.strip()
    if not opt.is_file():
        from onnxruntime.transformers.optimizer import optimize_model

        from attnx.pretrained import read_folder

        cfg = read_folder(minilm_path()).config
        _log("optimizing Optimum's export with onnxruntime.transformers.optimizer...")
        model = optimize_model(str(plain), model_type="bert", num_heads=int(cfg["num_attention_heads"]),
                               hidden_size=int(cfg["hidden_size"]))
        model.save_model_to_file(str(opt))
        fused = {k: v for k, v in model.get_fused_operator_statistics().items() if v}
        _log(f"  fused: {fused}")
    return plain, opt, f"optimum-onnx {version}"


# ----------------------------------------------------------------------------- timing


def real_ids(batch: int, seq: int) -> np.ndarray:
    """``[batch, seq]`` token ids of real text: the built-in sentences joined, each row from another offset."""
    from tokenizers import Tokenizer

    from attnx.pretrained import minilm_path
    from attnx.pretrained.sentences import SENTENCES

    tok = Tokenizer.from_file(str(minilm_path() / "tokenizer.json"))
    tok.no_truncation()
    ids = tok.encode(" ".join(SENTENCES * 4), add_special_tokens=False).ids
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    rows = [[cls, *ids[17 * r: 17 * r + seq - 2], sep] for r in range(batch)]
    return np.asarray(rows, dtype=np.int64)


def ort_contender(path: Path, feeds: dict, threads: int):
    """Every ONNX file in the same session settings: attnx.runtime's (``OrtOptions``). Among them, no
    busy-waiting pool threads: with spinning on, the threads of the contender that just ran keep the
    cores busy while the next one runs, and on a small machine that, not the graph, decides the ratios
    (measured: 1x128 took 60 ms instead of 28 ms); and no SkipLayerNormFusion (a no-op for the Optimum
    + optimizer file, whose SkipLayerNormalization nodes are in the file already)."""
    from attnx.runtime.core.backends.onnxrt import OrtOptions

    sess = OrtOptions(device="cpu", threads=threads).inference_session(path)
    names = {i.name for i in sess.get_inputs()}
    missing = names - set(feeds)
    if missing:
        raise ValueError(f"{path.name} needs inputs {sorted(missing)}")
    mine = {k: v for k, v in feeds.items() if k in names}
    return lambda: sess.run(["last_hidden_state"], mine)[0]


def attnx_feeds(model, ids: np.ndarray) -> dict:
    """The export's inputs: the ids, a full mask, the variant's context at its example values."""
    from attnx.export.exporter import example_inputs

    feeds = {k: v.numpy() for k, v in example_inputs(model, batch=ids.shape[0], seq=ids.shape[1]).items()}
    feeds.update(input_ids=ids, attention_mask=np.ones_like(ids), token_type_ids=np.zeros_like(ids))
    return feeds


def time_interleaved(contenders: dict, rounds: int, runs: int) -> dict[str, float]:
    """Median seconds per call of each contender over ``rounds`` interleaved rounds of ``runs`` calls."""
    for fn in contenders.values():  # warm-up (ORT allocates its arenas on the first run)
        fn()
        fn()
    times: dict[str, list[float]] = {k: [] for k in contenders}
    for _ in range(rounds):
        for name, fn in contenders.items():
            t = time.perf_counter()
            for _ in range(runs):
                fn()
            times[name].append((time.perf_counter() - t) / runs)
    return {k: statistics.median(v) for k, v in times.items()}


def gemm_gflop(path: Path, tokens: int) -> float:
    """GFLOP of the file's weight GEMMs for ``tokens`` tokens: 2 K N per token for every MatMul/Gemm
    with a constant 2-D weight (attention's own L^2 products, ~5% at L = 128, not counted). Tells a
    slow graph from one that simply has more arithmetic to do (a variant's extra projections)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    dims = {t.name: list(t.dims) for t in model.graph.initializer}
    total = sum(2 * dims[n.input[1]][0] * dims[n.input[1]][1] for n in model.graph.node
                if n.op_type in ("MatMul", "Gemm") and len(dims.get(n.input[1], [])) == 2)
    return total * tokens / 1e9


def gemm_peak_gflops(tokens: int, d: int = 384, ff: int = 1536, seconds: float = 1.0) -> float:
    """This CPU's fp32 GEMM rate at the model's FFN shape (``[tokens, d] @ [d, ff]``, torch, the same
    threads): no graph's weight GEMMs run faster, which caps any speed-up over eager."""
    a, b = torch.randn(tokens, d), torch.randn(d, ff)
    for _ in range(3):
        a @ b
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        calls += 1
    return 2 * tokens * d * ff * calls / (time.perf_counter() - start) / 1e9


def check_outputs(contenders: dict, reference: str, atol: float = 2e-3) -> dict[str, float]:
    """Max abs difference of each contender's last_hidden_state from ``reference``'s: the timed files
    compute the same thing (variants at neutral values equal the original model too)."""
    want = np.asarray(contenders[reference]())
    return {k: float(np.abs(np.asarray(fn()) - want).max()) for k, fn in contenders.items()}


# ----------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["1x128", "8x128"], help="BATCHxSEQ")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--runs", type=int, default=3, help="calls per contender per round")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--variants", nargs="*", default=None, help="default: every registered variant")
    ap.add_argument("--workdir", type=Path, default=None, help="keep (and reuse) the exports here")
    ap.add_argument("--optimum-venv", type=Path, default=OPTIMUM_VENV)
    ap.add_argument("--no-optimum", action="store_true")
    ap.add_argument("--no-optimum-setup", action="store_true", help="do not create the Optimum venv")
    ap.add_argument("--quick", action="store_true", help="1x128 only, 3 rounds, one variant (the last registered)")
    args = ap.parse_args()
    if args.variants is None:
        from attnx.models.spec import all_specs

        args.variants = [s.name for s in all_specs() if s.name != "mha"]
    if args.quick:
        args.shapes, args.rounds, args.variants = ["1x128"], 3, args.variants[-1:]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    import transformers

    from attnx.pretrained import minilm_path

    transformers.logging.set_verbosity_error()
    tmp = None
    if args.workdir is None:
        tmp = tempfile.TemporaryDirectory()
        args.workdir = Path(tmp.name)
    args.workdir.mkdir(parents=True, exist_ok=True)

    attnx_files = export_attnx(args.workdir, args.variants)
    optimum_note, optimum_files = "not run (--no-optimum)", {}
    if not args.no_optimum:
        python, why = optimum_python(args.optimum_venv, not args.no_optimum_setup)
        if python is None:
            optimum_note = why
        else:
            plain, opt, optimum_note = export_optimum(python, args.workdir)
            if plain is not None:
                optimum_files = {"optimum": plain, "optimum + ort-opt": opt}
    hf = transformers.BertModel.from_pretrained(str(minilm_path()), attn_implementation="eager",
                                                add_pooling_layer=False, dtype=torch.float32).eval()

    results = {}
    for shape in args.shapes:
        batch, seq = (int(v) for v in shape.lower().split("x"))
        ids = real_ids(batch, seq)
        contenders = {}
        for name, (path, model) in attnx_files.items():
            contenders[f"attnx {name}"] = ort_contender(path, attnx_feeds(model, ids), args.threads)
        for name, path in optimum_files.items():
            contenders[name] = ort_contender(path, {"input_ids": ids, "attention_mask": np.ones_like(ids),
                                                    "token_type_ids": np.zeros_like(ids)}, args.threads)
        t_ids, t_mask = torch.from_numpy(ids), torch.ones(ids.shape, dtype=torch.long)

        def eager():
            with torch.no_grad():
                return hf(input_ids=t_ids, attention_mask=t_mask).last_hidden_state.numpy()

        contenders["transformers eager"] = eager
        diffs = check_outputs(contenders, "transformers eager")
        _log(f"{shape}: timing {len(contenders)} contenders, {args.rounds} rounds x {args.runs} calls...")
        gflop = {f"attnx {name}": gemm_gflop(path, batch * seq) for name, (path, _) in attnx_files.items()}
        gflop.update({name: gflop["attnx mha"] for name in contenders if name not in gflop})  # the same model
        results[shape] = (time_interleaved(contenders, args.rounds, args.runs), diffs, gflop,
                          gemm_peak_gflops(batch * seq))

    render(results, args, optimum_note)
    if tmp is not None:
        tmp.cleanup()


def render(results: dict, args, optimum_note: str) -> None:
    goals = []
    for shape, (ms, diffs, gflop, peak) in results.items():
        base = ms["attnx mha"]
        table = Table(title=f"all-MiniLM-L6-v2, {shape} tokens, fp32 CPU, {args.threads} threads, median of "
                            f"{args.rounds} interleaved rounds", title_justify="left")
        for col in ("contender", "ms", "attnx mha speed-up", "x attnx mha", "GEMM GFLOP x mha", "GEMM GFLOP/s",
                    "max |diff| vs transformers"):
            table.add_column(col, justify="left" if col == "contender" else "right")
        for name, t in ms.items():
            speedup = f"{t / base:.2f}" if not name.startswith("attnx") else ""
            slowdown = f"{t / base:.2f}" if name.startswith("attnx") and name != "attnx mha" else ""
            work = f"{gflop[name] / gflop['attnx mha']:.2f}" if slowdown else ""
            table.add_row(name, f"{t * 1e3:.2f}", speedup, slowdown, work, f"{gflop[name] / t:.0f}", f"{diffs[name]:.1e}")
        console.print(table)
        if "transformers eager" in ms:
            eager_rate = gflop["transformers eager"] / ms["transformers eager"]
            console.print(f"fp32 GEMM peak here ({shape}, FFN shape, torch): {peak:.0f} GFLOP/s; eager runs its GEMMs "
                          f"at {eager_rate:.0f}, so no fp32 graph can be more than {peak / eager_rate:.2f}x faster "
                          "than eager at this shape", highlight=False)
        for name, goal, op in (("optimum + ort-opt", 1.0, ">="), ("transformers eager", 2.0, ">=")):
            if name in ms:
                goals.append((shape, f"attnx mha vs {name}", ms[name] / base, op, goal))
        for name in ms:
            if name.startswith("attnx ") and name not in ("attnx mha", f"attnx {UNFUSED}"):
                goals.append((shape, f"{name} vs attnx mha", ms[name] / base, "<=", 1.3))
    table = Table(title="goals (issue 11, item 6)", title_justify="left")
    for col in ("shape", "ratio", "value", "goal", "met"):
        table.add_column(col, justify="right" if col in ("value",) else "left")
    for shape, what, value, op, goal in goals:
        met = value >= goal if op == ">=" else value <= goal
        table.add_row(shape, what, f"{value:.2f}", f"{op} {goal}", "[green]yes[/green]" if met else "[red]no[/red]")
    console.print(table)
    console.print(f"Optimum: {optimum_note}; onnxruntime {ort.__version__} here, torch {torch.__version__}",
                  highlight=False)


if __name__ == "__main__":
    main()
