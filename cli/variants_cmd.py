"""`attnx variants`: each variant, its options with defaults, its context inputs with shapes."""

from __future__ import annotations

import json

import typer

from attnx.cli._common import console, guarded


def register(app: typer.Typer) -> None:
    @app.command("variants")
    @guarded
    def variants(as_json: bool = typer.Option(False, "--json", help="Machine-readable output.")) -> None:
        """List the attention variants, their options (with defaults) and context inputs."""
        from rich.markup import escape
        from rich.table import Table

        from attnx.models.build import ENCODER_OPTIONS, describe_variants
        from attnx.models.encoder import EncoderConfig

        info = describe_variants()
        if as_json:
            typer.echo(json.dumps(info, indent=2))
            return
        for v in info:
            table = Table(title=f"[bold]{v['name']}[/bold] — {v['summary']}", title_justify="left",
                          show_header=True, header_style="bold")
            table.add_column("option")
            table.add_column("default")
            for k, d in v["options"].items():
                table.add_row(k, repr(d))
            console.print(table)
            inputs = ", ".join(f"{c['name']} [{', '.join(map(str, c['shape']))}] {c['dtype']}" for c in v["context"])
            console.print(escape("  inputs: hidden_states [batch, seq, d_model], attention_mask [batch, seq]"
                                 + (f", {inputs}" if inputs else "")))
            console.print(f"  outputs: {', '.join(v['outputs'])}")
            if v["custom_ops"]:
                console.print(f"  custom ops: {', '.join('attnx::' + op for op in v['custom_ops'])}")
            console.print(escape(f"  decoding with a KV cache (--with-past): {v['kv_cache']}"))
            console.print()
        enc = EncoderConfig()
        console.print("encoder options (every variant): "
                      + ", ".join(f"{k}={getattr(enc, k)!r}" for k in ENCODER_OPTIONS))
