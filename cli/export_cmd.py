"""Work in progress: this command group is being written (see the open issues)."""

import typer


def register(app: typer.Typer) -> None:
    pass
