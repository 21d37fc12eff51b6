"""`attnx export` and `attnx inspect`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

from attnx.cli._common import UserError, console, guarded, workdir


def parse_sets(variant: str, sets: list[str]) -> dict:
    """``key=value`` pairs, each validated and typed against the variant's (and encoder's) config."""
    from dataclasses import fields

    from attnx.models.encoder import EncoderConfig
    from attnx.models.spec import get_spec

    defaults = {**get_spec(variant).options(), **{f.name: f.default for f in fields(EncoderConfig)}}
    out = {}
    for item in sets:
        if "=" not in item:
            raise UserError(f"--set {item!r}: expected key=value")
        key, raw = (s.strip() for s in item.split("=", 1))
        if key not in defaults:
            raise UserError(f"--set {key}: unknown option for variant {variant!r}; valid: {', '.join(sorted(defaults))}")
        default = defaults[key]
        try:
            if isinstance(default, bool):
                low = raw.lower()
                if low not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
                    raise ValueError
                value = low in ("true", "1", "yes", "on")
            elif isinstance(default, int):
                value = int(raw)
            elif isinstance(default, float):
                value = float(raw)
            elif isinstance(default, str):
                value = raw
            else:  # tuple | None (layer_variants)
                value = tuple(v.strip() for v in raw.split(",")) if raw else None
        except ValueError:
            raise UserError(f"--set {key}={raw}: expected {type(default).__name__} (default {default!r})") from None
        out[key] = value
    return out


def register(app: typer.Typer) -> None:
    @app.command("export")
    @guarded
    def export(
        variant: str = typer.Option(..., "--variant", help="A registered variant (see `attnx variants`)."),
        output: Optional[Path] = typer.Option(None, "-o", "--output", help="Output .onnx (default: attnx-out/<variant>.onnx)."),
        lowering: str = typer.Option("plugin", "--lowering", help="plugin (custom ops) | rewrite (standard ops only)"),
        fp16: bool = typer.Option(False, "--fp16", help="fp16 weights/activations; softmax, LayerNorm, reductions in fp32."),
        sets: List[str] = typer.Option([], "--set", help="Config option key=value (repeatable); see `attnx variants`."),
        checkpoint: Optional[Path] = typer.Option(None, "--checkpoint", help="safetensors weights to load."),
        layers: Optional[int] = typer.Option(None, "--layers", help="Number of encoder layers (default 2)."),
        opset: int = typer.Option(23, "--opset", help="ONNX opset (default 23: plain attention is one Attention op)."),
        seed: int = typer.Option(0, "--seed", help="Seed for the initial weights."),
        batch: Optional[str] = typer.Option(None, "--batch", help="Batch profile min,opt,max for engines (default 1,8,32)."),
        seq: Optional[str] = typer.Option(None, "--seq", help="Sequence profile min,opt,max (default 1,128,512)."),
    ) -> None:
        """Export a variant's encoder stack to ONNX (custom ops in domain attnx)."""
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        from attnx.contract import DEFAULT_PROFILES, parse_profile
        from attnx.export.exporter import LOWERINGS, STEPS, default_path, export_variant

        if lowering not in LOWERINGS:
            raise UserError(f"--lowering {lowering!r}: valid: {', '.join(LOWERINGS)}")
        overrides = parse_sets(variant, sets)
        if layers is not None and layers < 1:
            raise UserError(f"--layers must be >= 1, got {layers}")
        profiles = dict(DEFAULT_PROFILES)
        for axis, text in (("batch", batch), ("seq", seq)):
            if text is not None:
                profiles[axis] = parse_profile(text, f"--{axis}")
        path = output or default_path(variant, lowering, fp16, workdir())
        with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console,
                      transient=False) as progress:
            task = progress.add_task(f"export {variant}", total=len(STEPS))

            def step(name: str) -> None:
                progress.update(task, description=f"export {variant}: {name}", completed=STEPS.index(name))

            result = export_variant(variant, path, overrides=overrides, n_layers=layers, lowering=lowering, fp16=fp16,
                                    checkpoint=checkpoint, opset=opset, seed=seed, profiles=profiles, progress=step)
            progress.update(task, description=f"export {variant}: done", completed=len(STEPS))
        info = result.info
        console.print(f"wrote [bold]{result.path}[/bold] ({info.lowering}, {info.precision}, "
                      f"{sum(p.numel() for p in result.model.parameters()):,} parameters)", highlight=False)
        typer.echo(str(result.path))

    @app.command("inspect")
    @guarded
    def inspect(model: Path = typer.Argument(..., help="Any .onnx file."),
                as_json: bool = typer.Option(False, "--json", help="Machine-readable output.")) -> None:
        """Show an ONNX file's inputs/outputs, opsets, custom ops, metadata and size."""
        from rich.markup import escape
        from rich.table import Table

        from attnx.export.describe import describe_model

        info = describe_model(model)
        if as_json:
            typer.echo(json.dumps(info, indent=2))
            return
        console.print(f"[bold]{escape(info['path'])}[/bold]  IR {info['ir_version']}  producer {escape(info['producer'] or '?')}")
        console.print("opsets: " + ", ".join(f"{d} {v}" for d, v in info["opsets"].items()))
        table = Table("", "name", "dtype", "shape", header_style="bold")
        for kind in ("inputs", "outputs"):
            for t in info[kind]:
                table.add_row(kind[:-1], t["name"], t["dtype"], escape(str(t["shape"])))
        console.print(table)
        if info["custom_ops"]:
            ct = Table("custom op", "count", "function body", "schema registered", header_style="bold")
            for c in info["custom_ops"]:
                ct.add_row(f"{c['domain']}::{c['op']}", str(c["count"]), "yes" if c["function_body"] else "NO",
                           "yes" if c["schema"] else "no")
            console.print(ct)
        else:
            console.print("custom ops: none")
        console.print(f"nodes: {info['nodes']}  parameters: {info['parameters']:,}"
                      + ("  (external data)" if info["external_data"] else ""))
        console.print("ops: " + ", ".join(f"{k} x{v}" for k, v in info["op_counts"].items()), highlight=False)
        if info["metadata"]:
            mt = Table("metadata key", "value", header_style="bold")
            for k, v in info["metadata"].items():
                mt.add_row(k, escape(v if len(v) <= 160 else v[:157] + "..."))
            console.print(mt)
