"""`attnx triton-repo`: going past one machine (a Triton model repository, a KServe InferenceService)."""

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
        name: Optional[str] = typer.Option(None, help="Model name in the repository (default: file stem); a plain "
                                           "name: letters, digits, '_', '-', '.'."),
        max_batch: Optional[int] = typer.Option(None, "--max-batch", help="max_batch_size in config.pbtxt (default "
                                                "32, or an engine's batch profile maximum when lower)."),
        max_delay_us: int = typer.Option(2000, "--max-delay-us", help="dynamic_batching max_queue_delay_microseconds."),
        max_queue: Optional[int] = typer.Option(None, "--max-queue", help="dynamic_batching queue limit."),
        backend: Optional[str] = typer.Option(None, "--backend", help="What runs the model: onnxruntime (an .onnx's "
                                              "default), tensorrt (an engine's) or python (attnx's runtime in Triton's "
                                              "Python backend: no ONNX Runtime backend needed, custom ops, engines; "
                                              "requests of different lengths padded into one batch)."),
        instance_kind: str = typer.Option("KIND_AUTO", "--instance-kind", help="KIND_AUTO, KIND_GPU or KIND_CPU."),
        instances: int = typer.Option(1, help="Model instances per device."),
        plugin: Optional[Path] = typer.Option(None, help="TensorRT plugin library to ship with an engine (default: "
                                              "the built one)."),
        onnx: Optional[Path] = typer.Option(None, help="For an engine: the ONNX it was built from (I/O names, "
                                            "tokenizer)."),
        max_length: Optional[int] = typer.Option(None, "--max-length", help="Text models: truncate at this many "
                                                 "tokens instead of the export's maximum (e.g. an engine's seq max)."),
        pad_multiple: int = typer.Option(16, "--pad-multiple", help="Text models: pad each request to a multiple of "
                                         "this length, so Triton can batch requests of similar length."),
        kserve_uri: Optional[str] = typer.Option(None, "--kserve-uri", help="Also write kserve.yaml, a KServe "
                                                 "InferenceService serving the repository from this storage URI "
                                                 "(s3://, gs://, pvc://, ...)."),
        kserve_image: Optional[str] = typer.Option(None, "--kserve-image", help="Triton image for the "
                                                   "InferenceService (required for text models: the repository's "
                                                   "Dockerfile adds the tokenizers package)."),
        kserve_name: Optional[str] = typer.Option(None, "--kserve-name", help="InferenceService name (default: "
                                                  "from the model name)."),
        gpus: Optional[int] = typer.Option(None, "--gpus", help="GPUs per KServe replica (default: 1 for an engine "
                                           "or KIND_GPU, else 0)."),
    ) -> None:
        """Write a Triton Inference Server model repository: config.pbtxt checked with Triton's schema, and for a
        text model an ensemble of a tokenizer (Python backend) and the model, run by Triton's ONNX Runtime or
        TensorRT backend or (--backend python) by attnx's runtime. Optionally a KServe manifest."""
        from attnx.deploy.kserve import KServeOptions
        from attnx.deploy.repository import write_repository
        from attnx.deploy.triton import schema_problem

        path = model or latest_export()
        if not path.is_file():
            raise UserError(f"no model file at {path}")
        if backend is not None and backend not in ("onnxruntime", "tensorrt", "python"):
            raise UserError(f"--backend must be onnxruntime, tensorrt or python, got {backend!r}")
        if instance_kind not in ("KIND_AUTO", "KIND_GPU", "KIND_CPU"):
            raise UserError("--instance-kind must be KIND_AUTO, KIND_GPU or KIND_CPU")
        for flag, value, low in (("--max-delay-us", max_delay_us, 0), ("--instances", instances, 1),
                                 ("--max-queue", max_queue, 1), ("--max-length", max_length, 1),
                                 ("--pad-multiple", pad_multiple, 1), ("--gpus", gpus, 0), ("--max-batch", max_batch, 0)):
            if value is not None and value < low:
                raise UserError(f"{flag} must be >= {low}, got {value}")
        if kserve_uri is None and (kserve_image or kserve_name or gpus is not None):
            raise UserError("--kserve-image, --kserve-name and --gpus describe the KServe manifest: add --kserve-uri")
        kserve = KServeOptions(kserve_uri, kserve_image, kserve_name, gpus) if kserve_uri else None
        repo = output or workdir() / "triton-repo"
        written = write_repository(
            path, repo, name=name, max_batch_size=max_batch, max_queue_delay_us=max_delay_us,
            max_queue_size=max_queue, instance_kind=instance_kind, instance_count=instances,
            plugin_library=plugin, onnx_path=onnx, max_length=max_length, pad_to_multiple_of=pad_multiple,
            kserve=kserve, backend=backend,
        )
        problem = schema_problem()
        checked = "checked with Triton's schema" if written.validated else "NOT checked: " + str(problem)
        for model_name, folder in written.models.items():
            console.print(f"wrote {folder}/ ({checked})", highlight=False)
        if written.text is not None:
            console.print(f"text in: call [bold]{written.entry}[/bold] with a BYTES input 'text' (the tokenizer "
                          f"needs the tokenizers package in Triton's image: see {repo}/Dockerfile)", highlight=False)
        if written.backend == "python":
            console.print(f"{written.model_dir.name} runs attnx's runtime in Triton's Python backend: the stub's Python "
                          f"needs attnx, onnxruntime and numpy<2 (see {repo}/Dockerfile and README.md)", highlight=False)
        if written.plugin is not None:
            console.print(f"plugin library: {written.plugin}", highlight=False)
        elif path.suffix != ".onnx":
            err_console.print("[yellow]no plugin library shipped: pass --plugin (see the repository README)[/yellow]")
        if written.manifest is not None:
            how = "checked with kserve's types" if written.manifest_checked else "NOT checked: kserve is not installed"
            console.print(f"wrote {written.manifest} ({how}); copy the repository to {kserve_uri}, then "
                          f"kubectl apply -f {written.manifest}", highlight=False)
        console.print(f"start Triton with: tritonserver --model-repository={repo.resolve()}", highlight=False)
