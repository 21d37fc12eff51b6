"""The `attnx` command: one Typer app; each command group lives in its own module."""

from __future__ import annotations

import typer

from attnx.cli import _common

app = typer.Typer(
    name="attnx",
    help="Research attention variants from PyTorch to production inference.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root(verbose: bool = typer.Option(False, "--verbose", "-v", help="Show tracebacks on errors.")) -> None:
    _common.state.verbose = verbose


def _register_all() -> None:
    # Each module adds its commands with register(app); imports inside commands stay lazy.
    from attnx.cli import (demo_cmd, deploy_cmd, engine_cmd, explain_cmd, export_cmd, generate_cmd, plugins_cmd, serve_cmd,
                           variants_cmd)

    for module in (variants_cmd, export_cmd, explain_cmd, plugins_cmd, engine_cmd, generate_cmd, serve_cmd, deploy_cmd,
                   demo_cmd):
        module.register(app)


_register_all()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
