"""`attnx triton-repo`: going past one machine (a Triton Inference Server model repository)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from attnx.cli._common import UserError, console, err_console, guarded, latest_export, workdir


def register(app: typer.Typer) -> None:
    @app.command("triton-repo")
    @guarded
    def triton_repo(
        model: Optional[Path] = typer.Argument(None, help="model.onnx or model.engine. Default: the latest export."),
        output: Optional[Path] = typer.Option(None, "-o", "--output", help="Repository folder (default: <workdir>/triton-repo)."),
        name: Optional[str] = typer.Option(None, help="Model name in the repository (default: file stem)."),
        max_batch: int = typer.Option(32, "--max-batch", help="max_batch_size in config.pbtxt."),
        max_delay_us: int = typer.Option(2000, "--max-delay-us", help="dynamic_batching max_queue_delay_microseconds."),
        max_queue: Optional[int] = typer.Option(None, "--max-queue", help="dynamic_batching queue limit."),
        instance_kind: str = typer.Option("KIND_AUTO", "--instance-kind", help="KIND_AUTO, KIND_GPU or KIND_CPU."),
        instances: int = typer.Option(1, help="Model instances per device."),
        plugin: Optional[Path] = typer.Option(None, help="TensorRT plugin library to ship (default: the built one)."),
        onnx: Optional[Path] = typer.Option(None, help="For an engine: the ONNX it was built from (I/O names)."),
    ) -> None:
        """Write a Triton Inference Server model repository (config.pbtxt checked with Triton's schema)."""
        from attnx.deploy.triton import schema_problem, write_repository

        path = model or latest_export()
        if not path.is_file():
            raise UserError(f"no model file at {path}")
        if instance_kind not in ("KIND_AUTO", "KIND_GPU", "KIND_CPU"):
            raise UserError("--instance-kind must be KIND_AUTO, KIND_GPU or KIND_CPU")
        repo = output or workdir() / "triton-repo"
        model_dir = write_repository(
            path, repo, name=name, max_batch_size=max_batch, max_queue_delay_us=max_delay_us,
            max_queue_size=max_queue, instance_kind=instance_kind, instance_count=instances,
            plugin_library=plugin, onnx_path=onnx,
        )
        problem = schema_problem()
        checked = "checked with Triton's schema" if problem is None else "NOT checked: " + problem
        console.print(f"wrote {model_dir}/config.pbtxt ({checked}) and {model_dir}/1/")
        plugins = sorted((repo / "plugins").glob("*.so*")) if (repo / "plugins").is_dir() else []
        if plugins:
            console.print(f"plugin library: {plugins[0]}")
        elif path.suffix != ".onnx":
            err_console.print("[yellow]no plugin library shipped: pass --plugin (see the repository README)[/yellow]")
        console.print(f"start Triton with: tritonserver --model-repository={repo.resolve()}")
