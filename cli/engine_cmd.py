"""`attnx build-engine` and `attnx check`."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import List, Optional

import typer

from attnx.cli._common import StageLines, UserError, console, err_console, guarded, latest_export, state, workdir

BUILD_STEPS = ("fp16", "plugins", "parse", "build", "write")
BUILD_LABELS = {"fp16": "fp16 ONNX", "plugins": "plugin library", "parse": "parse (plugin override)",
                "build": "build engine", "write": "write engine + sidecar"}
CHECK_STEPS = ("reference", "engine", "original", "lowering", "run", "compare")
CHECK_LABELS = {"reference": "PyTorch reference", "engine": "engine", "original": "original model",
                "lowering": "other lowering",
                "run": "run (Polygraphy Comparator)", "compare": "compare"}


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


@contextlib.contextmanager
def user_errors():
    """The contract/engine/parity exceptions as one-line :class:`UserError` s."""
    from attnx.contract import ContractError
    from attnx.engine.errors import TensorRTError, explain
    from attnx.parity.cases import ParityError

    try:
        yield
    except (ContractError, ParityError) as e:
        raise UserError(_one_line(e), code=2) from e
    except TensorRTError as e:
        raise UserError(explain(e), code=1) from e
    except FileNotFoundError as e:
        raise UserError(_one_line(e), code=2) from e


class _Steps:
    """A Rich progress line per run: the current step and the time spent."""

    def __init__(self, title: str, steps: tuple[str, ...], labels: dict[str, str], quiet: bool = False):
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        self.title = title
        self.steps = steps
        self.labels = labels
        self.progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                                 console=console, transient=True, disable=quiet or not console.is_terminal)
        self.task = None
        self.lines = None if quiet or console.is_terminal else StageLines(title)  # logs: a line per step
        self.times: dict[str, float] = {}
        self._current: str | None = None
        self._started = 0.0

    def __enter__(self):
        self.progress.__enter__()
        self.task = self.progress.add_task(self.title, total=len(self.steps))
        return self

    def __call__(self, name: str) -> None:
        now = time.monotonic()
        if self._current is not None:
            self.times[self._current] = self.times.get(self._current, 0.0) + now - self._started
        self._current, self._started = name, now
        done = self.steps.index(name) if name in self.steps else 0
        self.progress.update(self.task, description=f"{self.title}: {self.labels.get(name, name)}", completed=done)
        if self.lines is not None:
            self.lines(self.labels.get(name, name))

    def __exit__(self, *exc):
        if self._current is not None:
            self.times[self._current] = self.times.get(self._current, 0.0) + time.monotonic() - self._started
        if self.lines is not None and exc[0] is None:
            self.lines.finish()
        return self.progress.__exit__(*exc)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def build_engine_cmd(model: Optional[Path], output: Optional[Path], fp16: bool, target: Optional[str],
                     shapes: list[str], timing_cache: Optional[Path], workspace: Optional[str],
                     plugins: Optional[Path], opt_level: Optional[int], quiet: bool = False):
    """The body of `attnx build-engine` (also used by `attnx demo`); returns the EngineBuild."""
    from rich.markup import escape
    from rich.table import Table

    from attnx import engine as eng

    with user_errors():
        shape_overrides = eng.parse_shapes(shapes)
        eng.parse_size(workspace)
        model = model or latest_export()
        if output is not None and output.resolve() == Path(model).resolve():  # never destroy the source
            raise UserError(f"-o {output} is the model itself: the engine would overwrite it; choose another "
                            f"path (e.g. {Path(model).with_suffix('.engine')})", code=2)
        with _Steps(f"build-engine {model.name}", BUILD_STEPS, BUILD_LABELS, quiet=quiet) as steps:
            result = eng.build(model, output, fp16=fp16, target=target, shapes=shape_overrides,
                               timing_cache=timing_cache, workspace=workspace, plugins=plugins,
                               optimization_level=opt_level, console=console, progress=steps)
    sc = result.sidecar
    if quiet:
        return result
    if result.converted_fp16:
        console.print(f"wrote the fp16 model [bold]{escape(str(result.onnx_path))}[/bold] (to_fp16: softmax, "
                      "LayerNorm and reductions kept in fp32)", highlight=False)
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_row("engine", f"[bold]{escape(str(result.engine_path))}[/bold] ({_size(result.engine_bytes)})")
    table.add_row("sidecar", escape(str(result.sidecar_path)))
    table.add_row("from", f"{escape(str(result.onnx_path))} ({sc['precision']}, {sc.get('lowering') or '?'} lowering)")
    table.add_row("backend", f"{sc['backend_description']}, target {sc['target']}")
    table.add_row("profiles", ", ".join(f"{k}={'/'.join(map(str, v))}" for k, v in sc["profiles"].items()))
    custom = sum(sc["custom_nodes"].values())
    if custom:
        kinds = ", ".join(f"{k} x{v}" for k, v in sc["custom_nodes"].items())
        style = "green" if result.inlined_custom_nodes == 0 else "yellow"
        table.add_row("plugin layers", f"[{style}]{result.plugin_layers} plugin layers, "
                      f"{result.inlined_custom_nodes} inlined[/{style}] (custom nodes: {kinds})")
    else:
        table.add_row("plugin layers", "0 (no attnx custom ops in this model)")
    layers = sorted(result.layers.items(), key=lambda kv: -kv[1])
    table.add_row("layers", f"{sum(result.layers.values())}: " + ", ".join(f"{k} {v}" for k, v in layers[:8])
                  + (" ..." if len(layers) > 8 else ""))
    table.add_row("time", f"{result.seconds:.1f}s (TensorRT build {sc['build_seconds']:.1f}s)")
    console.print(table, highlight=False)
    if result.inlined_custom_nodes:
        err_console.print(f"[yellow]warning:[/yellow] {result.inlined_custom_nodes} attnx custom node(s) were "
                          "inlined instead of becoming plugin layers (is the plugin library loaded?)")
    if sc["precision"] == "fp16":
        _explain_fp16_clip_warnings(result.onnx_path)
    return result


def _explain_fp16_clip_warnings(onnx_path: Path) -> None:
    """TensorRT-RTX prints 'precision-lose casting' for each Clip without an upper bound in an fp16 graph;
    say once what it means (attnx.engine.fp16.unbounded_clips), so nobody chases it."""
    from attnx.engine.fp16 import unbounded_clips

    clips = unbounded_clips(onnx_path)
    if clips:
        err_console.print(f"[dim]note: TensorRT's 'precision-lose casting' warnings are about the {len(clips)} "
                          f"clamp(s) with only a lower bound ({', '.join(clips[:4])}{' ...' if len(clips) > 4 else ''}): "
                          "TensorRT gives them float32's largest value as the upper bound, which fp16 cannot hold. "
                          "No fp16 value reaches that bound, so the engine clamps exactly as the model does.[/dim]",
                          highlight=False)


def report_name(model: Path) -> str:
    """The default report's name: the file's stem, or for a file named after its folder's role (every with-past
    export is ``<folder>/model.onnx``, as onnxruntime-genai expects) the folder's name and a digest of its path, so
    two exports never share a report."""
    if model.stem != "model" and not (model.parent / "genai_config.json").is_file():
        return model.stem
    import hashlib

    digest = hashlib.sha256(str(model.resolve().parent).encode()).hexdigest()[:8]
    return f"{model.parent.name}-{model.stem}-{digest}"


def check_cmd(model: Optional[Path], engine: Optional[Path], report_path: Optional[Path], cases: list[str],
              no_engine: bool = False, wd: Optional[Path] = None, quiet: bool = False,
              texts: Optional[list[str]] = None, original: Optional[Path] = None):
    """The body of `attnx check` (also used by `attnx demo`); returns (report, report_path)."""
    from rich.markup import escape

    from attnx import parity

    wd = wd or workdir()
    with user_errors():
        if model is None and engine is not None:
            model = parity.onnx_for_engine(engine)
            if model is not None and not quiet:
                err_console.print(f"[dim]using the ONNX the engine was built from: {model}[/dim]")
        model = model or latest_export()
        if engine is None and not no_engine:
            engine = parity.find_engine_for(model)
            if engine is not None and not quiet:
                err_console.print(f"[dim]using the engine built from it: {engine}[/dim]")
        with _Steps(f"check {model.name}", CHECK_STEPS, CHECK_LABELS, quiet=quiet) as steps:
            report = parity.run_check(model, engine=engine, workdir=wd, case_specs=cases or None,
                                      verbose=state.verbose, progress=steps, texts=texts or None, original=original)
    if report_path is None:
        report_path = wd / "parity" / f"{report_name(model)}.parity.json"
    report.write(report_path)
    if not quiet:
        from attnx.parity.render import render

        render(report, console, report_path)
    if not report.passed and not quiet:
        err_console.print("[bold red]error:[/bold red] parity mismatch: " + escape("; ".join(report.mismatches())),
                          highlight=False)
    return report, report_path


def register(app: typer.Typer) -> None:
    @app.command("build-engine")
    @guarded
    def build_engine(
        model: Optional[Path] = typer.Argument(None, help="The .onnx (default: the most recent export)."),
        output: Optional[Path] = typer.Option(None, "-o", "--output",
                                              help="Engine file (default: <model>.engine beside the ONNX)."),
        fp16: bool = typer.Option(False, "--fp16", help="Build from the fp16 ONNX (written as <stem>-fp16.onnx when "
                                  "the model is fp32): TensorRT 11 / TensorRT-RTX have no FP16 flag."),
        target: Optional[str] = typer.Option(None, "--target", help="Compute capability to build for, e.g. sm89, "
                                             "sm86, sm120 (TensorRT-RTX; default: the local GPU, else sm89)."),
        shapes: List[str] = typer.Option([], "--shapes", help="Profile override axis=min,opt,max (repeatable), "
                                         "e.g. --shapes batch=1,4,16 --shapes seq=1,64,256."),
        timing_cache: Optional[Path] = typer.Option(None, "--timing-cache",
                                                    help="Timing cache file (read if present, written after)."),
        workspace: Optional[str] = typer.Option(None, "--workspace", help="Workspace memory limit, e.g. 1G, 512M."),
        plugins: Optional[Path] = typer.Option(None, "--plugins", help="Plugin library (default: the built "
                                               "libattnx_plugins.so, built if missing and needed)."),
        opt_level: Optional[int] = typer.Option(None, "--opt-level", min=0, max=5,
                                                help="Builder optimization level (0-5)."),
    ) -> None:
        """Build a TensorRT engine (our plugins inside) plus a JSON sidecar."""
        result = build_engine_cmd(model, output, fp16, target, shapes, timing_cache, workspace, plugins, opt_level)
        typer.echo(str(result.engine_path))

    @app.command("check")
    @guarded
    def check(
        model: Optional[Path] = typer.Argument(None, help="The .onnx (default: the most recent export, or the one "
                                               "--engine was built from)."),
        engine: Optional[Path] = typer.Option(None, "--engine", help="Engine to include (default: <model>.engine "
                                              "when it was built from this file)."),
        report: Optional[Path] = typer.Option(None, "--report", help="JSON report path (default: "
                                              "<workdir>/parity/<model>.parity.json; a with-past export's "
                                              "<folder>-model-<digest>.parity.json)."),
        cases: List[str] = typer.Option([], "--case", help="Input case BATCHxSEQ (repeatable; default: several "
                                        "inside the profiles)."),
        no_engine: bool = typer.Option(False, "--no-engine", help="Do not look for an engine."),
        texts: List[str] = typer.Option([], "--text", help="Pretrained exports: a text to check on (repeatable; "
                                        "default: built-in real sentences and passages)."),
        original: Optional[Path] = typer.Option(None, "--original", help="Pretrained exports: the original Hugging "
                                                "Face folder (default: the one the export was made from)."),
    ) -> None:
        """Parity with Polygraphy: the PyTorch reference vs ONNX Runtime (both lowerings) and the engine;
        pretrained exports on real text, also against the original transformers / sentence-transformers model.
        Exit status 1: a mismatch; 3: a pretrained export's engine could not run here (not verified)."""
        rep, _path = check_cmd(model, engine, report, cases, no_engine=no_engine, texts=texts, original=original)
        if not rep.passed:
            raise typer.Exit(1)
        if getattr(rep, "engine_unchecked", None):  # never a pass for an engine that was not run
            raise typer.Exit(3)
