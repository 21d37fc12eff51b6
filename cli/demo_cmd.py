"""`attnx demo`: the main job end to end.

Default: the real all-MiniLM-L6-v2 with mha and a placed variant, up to a served semantic search
(:mod:`attnx.cli.demo_minilm`). ``--toy``: every variant's small random encoder, export -> plugins
(built once) -> build-engine --fp16 -> check, then one summary table.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

import typer

from attnx.cli._common import UserError, console, err_console, guarded, tensorrt_problem


@dataclass
class _Row:
    variant: str
    export: str = "-"
    plugin_layers: str = "-"
    engine: str = "-"
    check: str = "-"
    errors: str = "-"
    seconds: float = 0.0
    ok: bool = True
    notes: list[str] = field(default_factory=list)

    def fail(self, column: str, mark: str, *notes: str) -> None:
        """A failed step: ``mark`` in its column, ``notes`` printed under the table."""
        setattr(self, column, mark)
        self.ok = False
        self.notes.extend(notes)


def _first_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text or type(e).__name__


def _reason(e: BaseException) -> str:
    """One line for a failed step: a user-fixable error's message; anything else with its type."""
    if isinstance(e, (UserError, typer.Exit)):
        return _first_line(e)
    return f"{type(e).__name__}: {_first_line(e)}"


def _size(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB" if n >= 1 << 20 else f"{n / 1024:.0f} KiB"


def _default_variant() -> str:
    """The variant the real-model demo places by default, read from the specs: the last registered one
    that replaces the attention of every layer and lowers to a custom op, so the engine shows plugin
    layers."""
    from attnx.models.spec import all_specs

    fits = [s.name for s in all_specs() if s.custom_ops and s.placement.default == "replace"]
    if not fits:
        raise UserError("no registered variant replaces attention with a custom op: pass --variants")
    return fits[-1]


def register(app: typer.Typer) -> None:
    @app.command("demo")
    @guarded
    def demo(
        wd: Path = typer.Option(Path("attnx-out"), "--workdir", help="Working folder for every output."),
        variants: List[str] = typer.Option([], "--variants", help="Variants (comma-separated or repeated): placed "
                                           "in MiniLM beside plain mha (default: the last registered variant "
                                           "with a custom op); with --toy, the encoders to run (default: all)."),
        sets: List[str] = typer.Option([], "--set", help="Variant option key=value (see `attnx variants`); with "
                                       "--toy for every encoder (default d_model 256, 4 heads, 2 layers)."),
        target: Optional[str] = typer.Option(None, "--target", help="Engine target (default: the local GPU, "
                                             "else sm89)."),
        queries: List[str] = typer.Option([], "--query", help="A search query (repeatable; default: three "
                                          "built-in ones)."),
        full_check: bool = typer.Option(False, "--full-check", help="Check on the built-in real sentences and "
                                        "long passages (slower) instead of the demo's own texts."),
        toy: bool = typer.Option(False, "--toy", help="The small random encoders of every variant instead of "
                                 "the real model: export -> plugins -> build-engine --fp16 -> check."),
    ) -> None:
        """The real all-MiniLM-L6-v2 with mha and a placed variant: export -> check vs sentence-transformers
        -> fp16 engine -> attnx serve -> semantic search with tritonclient (HTTP + gRPC) that must match
        sentence-transformers. --toy: every variant's small encoder instead."""
        from attnx.cli.export_cmd import parse_sets
        from attnx.models import VARIANTS

        names = [v.strip() for item in variants for v in item.split(",") if v.strip()]
        unknown = [v for v in names if v not in VARIANTS]
        if unknown:
            raise UserError(f"--variants: unknown {', '.join(unknown)}; valid: {', '.join(VARIANTS)}")
        if toy:
            if queries or full_check:
                raise UserError("--query and --full-check are for the real-model demo, not --toy")
            return _toy(wd, names or list(VARIANTS), sets, target)
        from attnx.cli import demo_minilm

        names = list(dict.fromkeys(["mha", *(names or [_default_variant()])]))  # plain mha first, always
        if any(not q.strip() for q in queries):
            raise UserError("--query: a query must not be empty")
        options = {v: parse_sets(v, sets) for v in names if v != "mha" or len(names) == 1} if sets else {}
        fixed = sorted({k for o in options.values() for k in o} & {"d_model", "n_heads"})
        if fixed:
            raise UserError(f"--set {', '.join(fixed)}: the pretrained model fixes it (--toy for the small encoders)")
        wd.mkdir(parents=True, exist_ok=True)
        os.environ["ATTNX_WORKDIR"] = str(wd)
        if not demo_minilm.run(wd, names, options, target, queries or list(demo_minilm.QUERIES), full_check):
            raise typer.Exit(1)


def _toy(wd: Path, names: list[str], sets: list[str], target: Optional[str]) -> None:
    """Every variant's small random encoder: export -> plugins -> build-engine --fp16 -> check."""
    from rich.markup import escape
    from rich.table import Table

    from attnx.cli.engine_cmd import build_engine_cmd, check_cmd
    from attnx.cli.export_cmd import parse_sets
    from attnx import engine as eng
    from attnx.export.exporter import default_path, export_variant

    overrides = {v: parse_sets(v, sets) for v in names}
    wd.mkdir(parents=True, exist_ok=True)
    os.environ["ATTNX_WORKDIR"] = str(wd)  # the commands' "most recent export" and parity folder
    started = time.monotonic()
    console.rule(f"attnx demo: {', '.join(names)} -> {escape(str(wd))}/")

    # TensorRT and the plugins once, up front: without them the demo still exports and checks.
    trt_problem = tensorrt_problem()
    plugin_problem = None
    if trt_problem is None:
        from attnx import engine as eng

        lib = None
        try:  # for the engines' target only: the demo's engines are built for that one GPU
            lib = eng.resolve_plugin_library(None, needed=True, console=console,
                                             target=eng.target_name(target or eng.default_target()))
        except eng.EngineBuildError as e:
            plugin_problem = _first_line(e)
            err_console.print(f"[yellow]plugin library not built:[/yellow] {escape(plugin_problem)}")
        if lib is not None:
            console.print(f"plugin library: {escape(str(lib))}")

    rows: list[_Row] = []
    engine_note = ""
    targets: set[str] = set()
    for variant in names:
        row = _Row(variant)
        rows.append(row)
        t0 = time.monotonic()
        console.rule(f"[bold]{variant}[/bold]")
        # 1. export (fp32, plugin lowering, default small config)
        try:
            with console.status(f"{variant}: export"):
                res = export_variant(variant, default_path(variant, "plugin", False, wd),
                                     overrides=overrides[variant])
            params = sum(p.numel() for p in res.model.parameters())
            row.export = f"ok, {params / 1e6:.2f}M"
            console.print(f"exported {escape(str(res.path))} in {time.monotonic() - t0:.1f}s", highlight=False)
        except Exception as e:  # noqa: BLE001 - one variant failing must not stop the others
            row.fail("export", "[red]failed[/red]", f"export: {_first_line(e)}")
            row.seconds = time.monotonic() - t0
            continue
        # 2. build-engine --fp16
        engine_path = None
        fp16_model = None
        if trt_problem is None:
            try:
                built = build_engine_cmd(res.path, None, True, target, [], None, None, None, None, quiet=True)
                engine_path, fp16_model = built.engine_path, built.onnx_path
                custom = built.custom_nodes
                row.plugin_layers = (f"{built.plugin_layers} of {custom}" if custom else "-")
                if built.inlined_custom_nodes:
                    row.plugin_layers += f" [yellow]{built.inlined_custom_nodes} inlined[/yellow]"
                row.engine = _size(built.engine_bytes)
                targets.add(built.sidecar["target"])
                console.print(f"engine {escape(str(engine_path))}: {_size(built.engine_bytes)}, "
                              f"{built.plugin_layers} plugin layer(s), built in {built.sidecar['build_seconds']:.1f}s",
                              highlight=False)
            except Exception as e:  # noqa: BLE001
                row.fail("engine", "[red]failed[/red]", f"build-engine: {_reason(e)}")
        else:
            row.engine = "[yellow]skipped[/yellow]"
        if fp16_model is None:  # no engine: still check the fp16 model
            try:
                fp16_model, _ = eng.ensure_fp16(res.path)
            except Exception as e:  # noqa: BLE001
                row.fail("check", "[red]failed[/red]", f"fp16: {_first_line(e)}")
                row.seconds = time.monotonic() - t0
                continue
        # 3. check (fp16 model, both lowerings, engine where it can run)
        try:
            report, report_path = check_cmd(fp16_model, engine_path, None, [], no_engine=engine_path is None,
                                            wd=wd, quiet=True)
            ties = f", {len(report.ties)} tie(s)" if report.ties else ""
            if report.passed:
                row.check = f"[green]pass[/green]{ties}"
            else:
                row.fail("check", "[bold red]FAIL[/bold red]", *report.mismatches())
            if report.engine is not None and not report.engine.get("ran"):
                row.check += "*"
                engine_note = report.engine.get("reason", "")
            exact = report.exact_outputs  # shown only where they differ (a passing check has them equal)
            row.errors = " ".join(f"({k} {v:g})" if k in exact else f"{v:.1e}"
                                  for k, v in report.max_errors().items() if k not in exact or v)
            console.print(f"check: {report.verdict} ({len(report.comparisons)} comparisons, "
                          f"{len(report.cases)} cases) in {report.seconds:.1f}s; report {escape(str(report_path))}",
                          highlight=False)
        except Exception as e:  # noqa: BLE001
            row.fail("check", "[red]error[/red]", f"check: {_reason(e)}")
        row.seconds = time.monotonic() - t0

    from rich import box

    title = f"attnx demo: {len(rows)} variant(s) in {time.monotonic() - started:.0f}s"
    if targets:
        title += f", engines for {', '.join(sorted(targets))}"
    table = Table(title=title, header_style="bold",
                  box=box.SIMPLE_HEAD)
    for col in ("variant", "export", "plugin layers", "engine (fp16)", "check", "max error", "time"):
        table.add_column(col, justify="right" if col == "time" else "left")
    for r in rows:
        table.add_row(r.variant, r.export, r.plugin_layers, r.engine, r.check, r.errors, f"{r.seconds:.0f}s")
    console.rule()
    console.print(table)
    if engine_note:
        console.print(f"* engine not run here: {escape(engine_note)}; check compared the PyTorch reference with "
                      "ONNX Runtime on both lowerings", highlight=False)
    console.print(f"[dim]export: parameters; plugin layers: of the attnx custom nodes; max error: worst "
                  f"|output - reference| over the runners (fp16 model vs the fp32 reference), exact outputs in "
                  f"brackets where they differ; reports in {escape(str(wd / 'parity'))}/[/dim]", highlight=False)
    for r in rows:
        for note in r.notes:
            err_console.print(f"[red]{r.variant}:[/red] {escape(note)}", highlight=False)
    if not all(r.ok for r in rows):
        raise typer.Exit(1)
