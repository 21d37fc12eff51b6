"""`attnx plugins build | path`: compile and locate the TensorRT plugin library."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from attnx.cli._common import UserError, console, guarded


def register(app: typer.Typer) -> None:
    plugins_app = typer.Typer(
        name="plugins",
        help="The TensorRT plugin library for attnx's custom ops (MawDepthSelect, TtaDistance).",
        no_args_is_help=True,
    )

    @plugins_app.command("build")
    @guarded
    def build(
        arch: List[str] = typer.Option([], "--arch", help="SM to compile for (repeatable, e.g. --arch 89); "
                                                          "default: 80 86 89 90 120."),
        clean: bool = typer.Option(False, "--clean", help="Wipe the build folder first (downloaded headers are kept)."),
        tensorrt_include: Optional[Path] = typer.Option(
            None, "--tensorrt-include",
            help="TensorRT's include folder (default: $TENSORRT_INCLUDE_DIR, $TensorRT_ROOT/include, a TensorRT "
                 "install, else NVIDIA's public headers downloaded at build time)."),
        verbose_build: bool = typer.Option(False, "--verbose-build", help="Show the full CMake/compiler output."),
    ) -> None:
        """Compile libattnx_plugins.so with CMake + nvcc (incremental) and print its path."""
        from attnx import plugins

        try:
            path = plugins.build(archs=arch or None, clean=clean, tensorrt_include=tensorrt_include, console=console,
                                 verbose=verbose_build)
        except plugins.PluginBuildError as e:
            raise UserError(str(e), code=1) from None
        typer.echo(str(path))

    @plugins_app.command("path")
    @guarded
    def path() -> None:
        """Print the built plugin library's path (exit status 1 when it is not built)."""
        from attnx import plugins

        lib = plugins.library_path()
        if lib is None:
            raise UserError("the attnx plugin library is not built: run `attnx plugins build`", code=1)
        typer.echo(str(lib))

    app.add_typer(plugins_app, name="plugins")
