"""`attnx demo` on the real all-MiniLM-L6-v2: the job a user ships, end to end.

For plain ``mha`` and each placed variant: export -> check against sentence-transformers ->
fp16 engine (TensorRT-RTX; built, and run only where a GPU of its target exists) -> all of them
served by ``attnx serve`` (a subprocess, HTTP + gRPC on free loopback ports) -> the unmodified
``tritonclient`` sends queries and a small corpus as text -> a semantic search whose ranking and
cosine scores must match sentence-transformers' own. Any mismatch exits non-zero.

The search helpers (:func:`embed`, :func:`search`, :func:`compare_search`) are what
``tests/test_demo.py`` checks against sentence-transformers.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

#: What the demo searches: three queries over ten sentences (short, so check and search are quick).
QUERIES = ["A man is eating pasta.", "Will it rain tomorrow?", "I forgot my login details."]
CORPUS = [
    "A man is eating a piece of bread.",
    "A man is riding a white horse on an enclosed ground.",
    "A monkey is playing drums.",
    "Two men pushed carts through the woods.",
    "A woman is playing the violin.",
    "The new movie is awesome and the actors were great.",
    "The stock market fell sharply after the interest rate decision.",
    "How do I reset the password of my account?",
    "Heavy rain is expected across the north of the country tomorrow.",
    "The cat is sleeping on the warm windowsill.",
]
TOP_K = 3
#: Served cosine scores must equal sentence-transformers' within this (fp32 ONNX Runtime vs PyTorch).
SCORE_TOL = 1e-4
OUTPUT = "sentence_embedding"


# --- the search itself (also tested) ------------------------------------------------------------
#: Inputs the server fills from the text itself; anything else a model declares is a variant's context.
TEXT_DERIVED = {"input_ids", "attention_mask", "token_type_ids", "position_ids"}


def _client_lib(protocol: str):
    if protocol == "http":
        import tritonclient.http as lib
    elif protocol == "grpc":
        import tritonclient.grpc as lib
    else:
        raise ValueError(f"protocol must be http or grpc, got {protocol!r}")
    return lib


def context_inputs(address: str, model: str, rows: int, protocol: str = "http", seed: int = 0) -> dict:
    """Seeded values for the variant's context inputs the model declares (``self_state``, ``trace`` for
    smal), ``rows`` of each. A placed variant starts neutral, so these leave the embeddings equal to the
    original's; a service would send its real context here."""
    lib = _client_lib(protocol)
    client = lib.InferenceServerClient(address)
    try:
        meta = client.get_model_metadata(model, as_json=True) if protocol == "grpc" else \
            client.get_model_metadata(model)
    finally:
        client.close()
    text_name = meta.get("parameters", {}).get("text_input", {"string_value": "text"})
    text_name = text_name["string_value"] if isinstance(text_name, dict) else text_name
    rng = np.random.default_rng(seed)
    feeds = {}
    for spec in meta["inputs"]:
        if spec["name"] == text_name or spec["name"] in TEXT_DERIVED:
            continue
        dims = [int(d) for d in spec["shape"][1:]]
        if any(d < 0 for d in dims):
            raise ValueError(f"{model}: context input {spec['name']} has a per-token shape; send it yourself")
        if spec["datatype"].startswith("FP"):
            feeds[spec["name"]] = (0.5 * rng.standard_normal((rows, *dims))).astype(np.float32)
        else:
            feeds[spec["name"]] = np.zeros((rows, *dims), np.int64)
    return feeds


def embed(address: str, model: str, texts: list[str], protocol: str = "http",
          context: dict[str, np.ndarray] | None = None) -> np.ndarray:
    """``[len(texts), d]`` sentence embeddings from a KServe v2 server, text in, via tritonclient."""
    from tritonclient.utils import np_to_triton_dtype

    lib = _client_lib(protocol)
    client = lib.InferenceServerClient(address)
    try:
        text = lib.InferInput("text", [len(texts)], "BYTES")
        text.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=object))
        inputs = [text]
        for name, arr in (context or {}).items():
            inputs.append(lib.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype)))
            inputs[-1].set_data_from_numpy(arr)
        wanted = [lib.InferRequestedOutput(OUTPUT)]  # only the pooled output comes back
        return client.infer(model, inputs, outputs=wanted).as_numpy(OUTPUT)
    finally:
        client.close()


def search(queries: np.ndarray, corpus: np.ndarray, k: int = TOP_K) -> tuple[np.ndarray, np.ndarray]:
    """Cosine scores ``[Q, N]`` (float64) and each query's ``k`` best corpus indices, best first."""
    q = queries.astype(np.float64)
    c = corpus.astype(np.float64)
    scores = (q / np.linalg.norm(q, axis=1, keepdims=True)) @ (c / np.linalg.norm(c, axis=1, keepdims=True)).T
    top = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return scores, top


def compare_search(scores: np.ndarray, top: np.ndarray, ref_scores: np.ndarray, ref_top: np.ndarray,
                   tol: float = SCORE_TOL) -> list[str]:
    """What differs from the reference search: every score within ``tol``, and the same hits in the same
    order, except that two hits whose reference scores are within ``tol`` may swap (a tie)."""
    problems = []
    diff = np.abs(scores - ref_scores)
    if not diff.max() <= tol:  # NaN fails too
        q, n = np.unravel_index(int(np.nanargmax(diff)), diff.shape)
        problems.append(f"cosine differs by {diff.max():.2e} > {tol:g} (query {q}, sentence {n})")
    for q in range(top.shape[0]):
        for r, (got, want) in enumerate(zip(top[q], ref_top[q])):
            if got != want and abs(ref_scores[q, got] - ref_scores[q, want]) > tol:
                problems.append(f"query {q} rank {r + 1}: sentence {got}, the reference has {want}")
    return problems


# --- the steps --------------------------------------------------------------------------------
@dataclass
class _Model:
    variant: str
    name: str
    path: Path
    ok: bool = True
    export: str = "-"
    check: str = "-"
    engine: str = "-"
    search: str = "-"
    seconds: float = 0.0
    compare_with_st: bool = True  # False when --set made the placed model differ from the original
    notes: list[str] = field(default_factory=list)

    def fail(self, column: str, mark: str, note: str) -> None:
        setattr(self, column, mark)
        self.ok = False
        self.notes.append(note)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worst(report: dict, runner_prefix: str, reference: str) -> tuple[float, float]:
    """Worst cosine and max |diff| of a runner against a reference, over its outputs and sentences."""
    rows = [c for c in report["comparisons"] if c["runner"].startswith(runner_prefix) and c["reference"] == reference]
    return (min((c["min_cosine"] for c in rows), default=float("nan")),
            max((c["max_abs"] for c in rows), default=float("nan")))


class _Server:
    """``attnx serve`` in a subprocess on free loopback ports (HTTP + gRPC); always stopped."""

    def __init__(self, models: dict[str, Path], log: Path):
        self.http, self.grpc = _free_port(), _free_port()
        self.argv = [sys.executable, "-m", "attnx.cli.main", "serve",
                     *(f"{name}={path}" for name, path in models.items()),
                     "--port", str(self.http), "--grpc-port", str(self.grpc)]
        self.log_path = log
        self.proc = None

    def command(self) -> str:
        return " ".join(["attnx", *self.argv[3:]])

    def __enter__(self) -> "_Server":
        import tritonclient.http as httpclient

        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "NO_COLOR": "1"})
        try:
            self._wait_ready(httpclient.InferenceServerClient(f"127.0.0.1:{self.http}"))
        except BaseException:
            self.__exit__()  # `with` does not call __exit__ when __enter__ fails: stop the process here
            raise
        return self

    def _wait_ready(self, client) -> None:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log_path.read_text().strip().splitlines()[-1:] or ["(no output)"]
                raise RuntimeError(f"attnx serve exited with status {self.proc.returncode}: {tail[0]}")
            try:
                if client.is_server_ready():
                    return
            except Exception:  # noqa: BLE001 - not listening yet
                pass
            time.sleep(0.3)
        raise RuntimeError(f"attnx serve was not ready after 180 s (log: {self.log_path})")

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()  # SIGTERM: graceful shutdown
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def run(wd: Path, variants: list[str], options: dict[str, dict], target: str | None, queries: list[str],
        full_check: bool) -> bool:
    """The whole real-model demo; prints as it goes and returns whether everything matched."""
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    from attnx import engine as eng
    from attnx.cli._common import console, err_console, tensorrt_problem
    from attnx.cli.engine_cmd import build_engine_cmd, check_cmd
    from attnx.export.pretrained import export_pretrained
    from attnx.pretrained import minilm_path

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may come from a hub
    started = time.monotonic()
    source = minilm_path()
    texts = queries + CORPUS
    models = [_Model(v, f"minilm-{v}", wd / f"minilm-{v}.onnx") for v in variants]
    console.rule(f"attnx demo: all-MiniLM-L6-v2 with {', '.join(variants)} -> {escape(str(wd))}/")
    console.print(f"weights: {escape(str(source))}", highlight=False)

    trt_problem = tensorrt_problem()

    for m in models:
        t0 = time.monotonic()
        console.rule(f"[bold]{m.name}[/bold]")
        # 1. export: the real weights with the variant placed (neutral: it computes the original)
        try:
            with console.status(f"{m.name}: export"):
                res = export_pretrained(source, m.path, variant=m.variant, options=options.get(m.variant) or None)
            m.export = f"ok, {sum(p.numel() for p in res.model.parameters()) / 1e6:.1f}M"
            console.print(f"exported {escape(str(m.path))} in {time.monotonic() - t0:.0f}s", highlight=False)
        except Exception as e:  # noqa: BLE001 - one model failing must not stop the others
            m.fail("export", "[red]failed[/red]", f"export: {_line(e)}")
            m.seconds = time.monotonic() - t0
            continue
        # 2. check against sentence-transformers (and attnx's PyTorch reference) on real text
        try:
            report, report_path = check_cmd(m.path, None, None, [], no_engine=True, wd=wd, quiet=True,
                                            texts=None if full_check else texts)
            data = report.to_json()
            m.compare_with_st = bool(data["original"].get("used"))
            against = "original" if m.compare_with_st else "torch"
            cos, diff = _worst(data, "onnxrt", against)
            m.check = f"{'[green]pass[/green]' if report.passed else '[bold red]FAIL[/bold red]'} " \
                      f"cos {cos:.6f}, diff {diff:.1e}"
            console.print(f"check vs {'sentence-transformers' if m.compare_with_st else 'the PyTorch reference'} "
                          f"on {len(data['texts'])} texts: {report.verdict}; worst cosine {cos:.7f}, max |diff| "
                          f"{diff:.2e} in {report.seconds:.0f}s; report {escape(str(report_path))}", highlight=False)
            if not m.compare_with_st:
                console.print(f"[yellow]{escape(data['original'].get('note', ''))}[/yellow]", highlight=False)
            if not report.passed:
                m.ok = False
                m.notes.extend(report.mismatches())
        except Exception as e:  # noqa: BLE001
            m.fail("check", "[red]error[/red]", f"check: {_line(e)}")
        # 3. fp16 engine with TensorRT-RTX
        if trt_problem is None:
            try:
                built = build_engine_cmd(m.path, None, True, target, [], None, None, None, None, quiet=True)
                runs, why = eng.runnable_here(built.sidecar)
                m.engine = f"{_size(built.engine_bytes)}, {built.sidecar['target']}" + ("" if runs else ", not run")
                layers = f"{built.plugin_layers} plugin layer(s)" if built.custom_nodes else "no custom ops"
                console.print(f"fp16 engine {escape(str(built.engine_path))}: {_size(built.engine_bytes)}, {layers}, "
                              f"built in {built.sidecar['build_seconds']:.0f}s for {built.sidecar['target']}"
                              + ("" if runs else f"; built, not run: {escape(why)}"), highlight=False)
            except Exception as e:  # noqa: BLE001
                m.fail("engine", "[red]failed[/red]", f"build-engine: {_line(e)}")
        else:
            m.engine = "[yellow]skipped[/yellow]"
        m.seconds = time.monotonic() - t0

    # 4. serve every exported model and search over HTTP and gRPC
    served = {m.name: m for m in models if m.path.is_file() and m.export.startswith("ok")}
    if served:
        console.rule("[bold]serve + semantic search[/bold]")
        _serve_and_search(served, wd, queries, console, escape)

    table = Table(title=f"attnx demo: all-MiniLM-L6-v2, {len(models)} model(s) in {time.monotonic() - started:.0f}s",
                  header_style="bold", box=box.SIMPLE_HEAD)
    for col in ("model", "export", "check (worst)", "fp16 engine", "search", "time"):
        table.add_column(col, justify="right" if col == "time" else "left")
    for m in models:
        table.add_row(m.name, m.export, m.check, m.engine, m.search, f"{m.seconds:.0f}s")
    console.rule()
    console.print(table)
    console.print(f"[dim]check: ONNX Runtime (fp32 file) vs sentence-transformers, worst cosine and max |diff| over "
                  f"{'the built-in texts' if full_check else 'the demo texts'} and both outputs; search: top-{TOP_K} "
                  f"hits and every cosine within {SCORE_TOL:g} of sentence-transformers, over HTTP and gRPC; "
                  f"reports in {escape(str(wd / 'parity'))}/[/dim]", highlight=False)
    for m in models:
        for note in m.notes:
            err_console.print(f"[red]{m.name}:[/red] {escape(note)}", highlight=False)
    return all(m.ok for m in models)


def _serve_and_search(served: dict[str, _Model], wd: Path, queries: list[str], console, escape) -> None:
    from rich import box
    from rich.table import Table

    texts = queries + CORPUS
    st = _sentence_transformer()
    ref_scores, ref_top = search(*np.split(st.encode(texts, convert_to_numpy=True), [len(queries)]))
    server = _Server({name: m.path for name, m in served.items()}, wd / "serve.log")
    console.print(f"$ {escape(server.command())}", highlight=False)
    try:
        with server:
            for name, m in served.items():
                t0 = time.monotonic()
                context = context_inputs(f"127.0.0.1:{server.http}", name, len(texts))
                if context:
                    console.print(f"{name}: context inputs {', '.join(f'{k} {list(v.shape)}' for k, v in context.items())}"
                                  " sent with the text (seeded values: a neutral placed variant ignores them)",
                                  highlight=False)
                got = {p: embed(f"127.0.0.1:{port}", name, texts, p, context)
                       for p, port in (("http", server.http), ("grpc", server.grpc))}
                elapsed = time.monotonic() - t0
                want_scores, want_top = ref_scores, ref_top
                if not m.compare_with_st:  # options changed the model: compare with the same file run in-process
                    from attnx.runtime import TextModel

                    want_scores, want_top = search(*np.split(TextModel(m.path).encode(texts, context=context), [len(queries)]))
                problems = []
                for protocol, emb in got.items():
                    scores, top = search(emb[:len(queries)], emb[len(queries):])
                    problems += [f"{protocol}: {p}" for p in compare_search(scores, top, want_scores, want_top)]
                scores, top = search(got["http"][:len(queries)], got["http"][len(queries):])
                table = Table(title=f"{name}: top {TOP_K} of {len(CORPUS)} sentences ({len(texts)} texts per request, "
                              f"HTTP + gRPC in {elapsed:.1f}s)", box=box.SIMPLE_HEAD, header_style="bold")
                ref_name = "sentence-transformers" if m.compare_with_st else "in-process"
                for col in ("query", "#", "hit", "cosine (served)", f"cosine ({ref_name})"):
                    table.add_column(col, justify="right" if col.startswith(("#", "cos")) else "left")
                for q, query in enumerate(queries):
                    for r, i in enumerate(top[q]):
                        table.add_row(escape(query) if r == 0 else "", str(r + 1), escape(CORPUS[i]),
                                      f"{scores[q, i]:.5f}", f"{want_scores[q, i]:.5f}")
                console.print(table)
                worst = max(float(np.abs(search(e[:len(queries)], e[len(queries):])[0] - want_scores).max())
                            for e in got.values())
                if problems:
                    m.fail("search", "[bold red]MISMATCH[/bold red]", "search: " + "; ".join(problems))
                else:
                    m.search = f"[green]same ranking[/green], |d cos| {worst:.0e}"
                owner = "sentence-transformers'" if m.compare_with_st else "the in-process"
                console.print(f"{name}: {'matches' if not problems else 'does NOT match'} {owner} ranking; "
                              f"worst |cosine difference| {worst:.1e} (HTTP and gRPC)", highlight=False)
    except Exception as e:  # noqa: BLE001 - the table still shows what worked
        for m in served.values():
            if m.search == "-":
                m.fail("search", "[red]error[/red]", f"serve/search: {_line(e)}")


def _sentence_transformer():
    from sentence_transformers import SentenceTransformer

    from attnx.pretrained import minilm_path

    return SentenceTransformer(str(minilm_path()), device="cpu")


def _line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _size(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB" if n >= 1 << 20 else f"{n / 1024:.0f} KiB"
