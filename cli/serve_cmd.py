"""`attnx serve`, `attnx bench`: serving an exported model, and loading a server.

Their serving options are generated from :class:`attnx.runtime.config.ServingConfig` (``cli/serving_options.py``);
what is declared here is per model (files, tokenizer folders, axes, templates) or the load test's own. Heavy modules
(onnxruntime, FastAPI, uvicorn, tritonclient) are imported inside the command bodies so `attnx --help` stays fast.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, List, Optional

import typer

from attnx.cli._common import UserError, console, err_console, guarded, latest_export
from attnx.cli.serving_options import serving_config, with_settings


def _seq_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.replace(" ", "").split(",") if v]
    except ValueError:
        raise UserError(f"--seq takes comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise UserError(f"--seq needs positive lengths, got {text!r}")
    return values


def _model_files(models: list[str] | None) -> dict[str, Path]:
    from attnx.runtime.server import parse_model_args

    if not models:
        path = latest_export()
        return {path.stem: path}
    named = parse_model_args(models)
    out: dict[str, Path] = {}
    for name, path in named:
        if not path.is_file():
            raise UserError(f"no model file at {path}")
        if name in out:
            raise UserError(f"two models named {name!r}: rename one with name=path")
        out[name] = path
    return out


def _tokenizer_dirs(items: list[str] | None, files: dict[str, Path]) -> dict[str | None, Path]:
    """``--tokenizer DIR`` (every model) / ``--tokenizer NAME=DIR`` -> ``{name or None: folder}``."""
    out: dict[str | None, Path] = {}
    for item in items or ():
        name, sep, folder = item.partition("=")
        key = name if sep and name in files else None
        path = Path(folder if key is not None else item)
        if not path.exists():
            raise UserError(f"--tokenizer {item}: no such folder")
        out[key] = path
    return out


def register(app: typer.Typer) -> None:
    @app.command("serve")
    @with_settings("serve")
    @guarded
    def serve(
        models: Optional[List[str]] = typer.Argument(
            None, help="Model files (.onnx/.engine), each optionally as name=path. Default: the latest export."
        ),
        tokenizer: Optional[List[str]] = typer.Option(
            None, "--tokenizer", help="Tokenizer folder (tokenizer.json) giving a model a text input: DIR for "
                                      "every model, or NAME=DIR. attnx exports carry their own."),
        batch_axis: Optional[List[str]] = typer.Option(
            None, "--batch-axis", help="Batch axis for tensors whose dim names do not say: NAME=AXIS, or AXIS "
                                       "for every tensor."),
        seq_axis: Optional[List[str]] = typer.Option(
            None, "--seq-axis", help="Sequence axis for tensors whose dim names do not say: NAME=AXIS or AXIS."),
        describe: bool = typer.Option(
            False, "--describe", help="Print each input's and output's batch/sequence axes and how requests "
                                      "will be batched, then exit."),
        dimensions: Optional[List[str]] = typer.Option(
            None, "--dimensions", help="Let /v1/embeddings and /embed cut embeddings to fewer dimensions (the "
                                       "first k, renormalised: for Matryoshka-trained models): 'any' or sizes like "
                                       "64,128,256, for every model or as NAME=..."),
        chat_template: Optional[List[str]] = typer.Option(
            None, "--chat-template", help="A Jinja chat template for generating models whose files carry none "
                                          "(or to replace theirs): FILE for every generating model, or NAME=FILE."),
        **settings: Any,
    ) -> None:
        """Serve models over HTTP (and gRPC) with the KServe v2 protocol (tritonclient works), with dynamic
        batching that pads requests of different lengths; text in for models with a tokenizer."""
        from rich.markup import escape

        from attnx.runtime.serving.encoding import Dimensions
        from attnx.runtime.core.axes import AxisError, AxisFlags
        from attnx.runtime.server import InferenceServer, check_ports
        from attnx.runtime.wire.auth import ENV_VAR

        if settings["api_key"] is None and os.environ.get(ENV_VAR) == "":
            settings["api_key"] = ""  # set but empty: refused, never read as "no key"
        config = serving_config(settings)  # every setting checked before any model loads
        files = _model_files(models)
        templates = _chat_template_files(chat_template, files)
        try:
            dims = Dimensions.parse(dimensions, files)
            axes = AxisFlags.parse(batch_axis, seq_axis)
        except (ValueError, AxisError) as e:
            raise UserError(str(e)) from None
        if not describe:  # a busy port is found now, not after every model has loaded
            try:
                check_ports(config.host, config.port, config.grpc_port)
            except OSError as e:
                raise UserError(str(e.strerror or e)) from None
        server = InferenceServer(
            files, config, tokenizers=_tokenizer_dirs(tokenizer, files), axes=axes, dimensions=dims,
            on_warning=lambda m: err_console.print(f"[yellow]warning:[/yellow] {escape(m)}", highlight=False),
        )
        _configure_generators(server, templates)
        if describe:
            console.print(server.describe(), markup=False, highlight=False, soft_wrap=True)
            return
        try:
            server.bind()
        except OSError as e:
            raise UserError(str(e.strerror or e)) from None
        from attnx.runtime.core.decoding import memory_warning

        for name, model in server.models.items():
            if name in server.generators:
                err_console.print(f"model [bold]{name}[/bold]: {model.session.path} ({model.session.provider}) "
                                  f"generates text (up to {model.scheduler.max_batch} sequences per decoding step"
                                  f"{', chat template' if model.chat else ''}"
                                  f"{f', at most {model.max_new_tokens} new tokens' if model.max_new_tokens else ''}); "
                                  f"{model.decoder.kv_footprint().describe(model.scheduler.max_batch)}",
                                  highlight=False)
                warning = memory_warning(model.decoder.kv_footprint(), model.scheduler.max_batch, "--max-positions")
                if warning:
                    err_console.print(f"[yellow]warning:[/yellow] model {name}: {warning}", highlight=False)
            else:
                text = " text in" if model.tokenizer is not None else ""
                err_console.print(f"model [bold]{name}[/bold]: {model.session.path} ({model.session.provider}){text}")
        err_console.print(
            f"max batch {config.max_batch}, max delay {config.max_delay_ms} ms, queue {config.max_queue}; "
            "Ctrl-C stops after in-flight requests finish"
        )
        # One plain line with the real address (port 0 picks one), for people and for scripts.
        if server.grpc_address:
            err_console.print(f"gRPC listening on {server.grpc_address}", highlight=False, soft_wrap=True)
        err_console.print("APIs: KServe v2 (/v2), OpenAI (/v1/embeddings), TEI (/embed, /predict, /rerank), "
                          "Cohere/Jina (/v1/rerank), Infinity (/classify)"
                          + ("; generation: Triton (/v2/models/{m}/generate[_stream]), OpenAI (/v1/completions, "
                             "/v1/chat/completions), vLLM (/tokenize, /detokenize)" if server.generators else "")
                          + ("; API key required" if config.api_key else ""), highlight=False)
        err_console.print(f"listening on {server.url}", highlight=False, soft_wrap=True)
        server.serve()

    @app.command("bench")
    @with_settings("bench", defaults={"max_batch_tokens": 0}, help_prefix="In-process: ")
    @guarded
    def bench(
        model: Optional[str] = typer.Argument(
            None, help="Model file (in-process), or the model name on the server with --url. Default: latest export."
        ),
        url: Optional[str] = typer.Option(None, help="A running server (http://host:port); else in-process."),
        concurrency: int = typer.Option(32, help="Concurrent clients."),
        duration: float = typer.Option(10.0, help="Seconds of load."),
        seq: str = typer.Option("16,64,128", help="Sequence lengths to mix (uniformly)."),
        batch: int = typer.Option(1, help="Rows per request."),
        report: Optional[Path] = typer.Option(None, help="Also write the numbers as JSON here."),
        text: bool = typer.Option(False, "--text", help="Send text (the model's tokenizer) instead of tensors."),
        min_tokens: int = typer.Option(3, "--min-tokens", help="Text: shortest text, in tokens."),
        max_tokens: int = typer.Option(300, "--max-tokens", help="Text: longest text, in tokens (truncated at the "
                                                                 "model's max length)."),
        texts: int = typer.Option(64, "--texts", help="Text: distinct texts in the pool."),
        output: Optional[List[str]] = typer.Option(None, "--output", help="Text: outputs to ask for "
                                                                          "(default: sentence_embedding if any)."),
        tokenizer: Optional[Path] = typer.Option(None, "--tokenizer", help="Text: tokenizer folder (with --url, "
                                                                           "or for a file that carries none)."),
        compare_batch_1: bool = typer.Option(False, "--compare-batch-1", help="Text, in-process: also run with "
                                             "--max-batch 1, interleaved, and print the throughput ratio."),
        rounds: int = typer.Option(3, "--rounds", help="Text: interleaved rounds per configuration."),
        **settings: Any,
    ) -> None:
        """Load-test a model: throughput and p50/p95/p99 latency at a given concurrency. With --text: texts
        of --min-tokens..--max-tokens, every answer checked against the same text run alone, the
        (server's) RSS before and after."""
        import json

        from attnx.deploy import loadtest as b

        config = serving_config(settings)
        batching = dataclasses.replace(config.batching, timeout_ms=None)  # a load test's requests wait their turn
        lengths = _seq_list(seq)
        if concurrency < 1 or duration <= 0 or batch < 1:
            raise UserError("--concurrency and --batch must be >= 1 and --duration > 0")
        if text:
            from attnx.cli.bench_text import bench_text

            numbers = bench_text(model, url=url, concurrency=concurrency, duration=duration, min_tokens=min_tokens,
                                 max_tokens=max_tokens, count=texts, outputs=output, tokenizer=tokenizer,
                                 batching=batching, device=config.device, threads=config.threads,
                                 compare_batch_1=compare_batch_1, rounds=rounds)
            if report:
                report.write_text(json.dumps(numbers, indent=2))
            return
        if url:
            import tritonclient.http as httpclient

            address = url.split("://", 1)[-1].rstrip("/")
            client = httpclient.InferenceServerClient(address)
            try:
                if model is None:
                    index = client.get_model_repository_index()
                    if not index:
                        raise UserError(f"the server at {url} lists no models")
                    model = index[0]["name"]
                    err_console.print(f"[dim]using model {model} from {url}[/dim]")
                meta = client.get_model_metadata(model)
            finally:
                client.close()
            from attnx.cli.bench_text import specs_from_metadata

            specs = specs_from_metadata(meta)
            pool = b.request_pool(specs, lengths, batch=batch)
            target = b.HttpTarget(url, model)
            result = b.run_load(
                target.factory, pool, concurrency=concurrency, duration_s=duration, label=f"{model} @ {url}"
            )
        else:
            from attnx.runtime import DynamicBatcher, load

            path = Path(model) if model else latest_export()
            if not path.is_file():
                raise UserError(f"no model file at {path}")
            session = load(path, device=config.device, threads=config.threads)
            pool = b.request_pool(session.inputs, lengths, batch=batch)
            with DynamicBatcher(session, batching) as batcher:
                b.run_load(lambda: batcher.infer, pool[:1], concurrency=1, duration_s=0.5)  # warm-up
                warm = batcher.stats.batches, batcher.stats.rows
                result = b.run_load(
                    lambda: batcher.infer, pool, concurrency=concurrency, duration_s=duration,
                    label=f"{path.name} in-process (max batch {config.max_batch})",
                )
                batches = batcher.stats.batches - warm[0]
                result.mean_batch_rows = (batcher.stats.rows - warm[1]) / batches if batches else None
        console.print(b.render([result], title=f"attnx bench: seq {lengths}, batch {batch}"))
        if report:
            report.write_text(json.dumps(result.summary(), indent=2))
        if result.ok == 0:
            raise UserError(f"no request succeeded; errors: {dict(result.errors)}", code=1)


def _chat_template_files(items: list[str] | None, files: dict[str, Path]) -> dict[str | None, Path]:
    """``--chat-template FILE`` (every generating model) / ``--chat-template NAME=FILE`` -> ``{name or None: file}``
    (the syntax of ``--tokenizer``)."""
    out: dict[str | None, Path] = {}
    for item in items or ():
        name, sep, file = item.partition("=")
        key = name if sep and name in files else None
        path = Path(file if key is not None else item)
        if not path.is_file():
            raise UserError(f"--chat-template {item}: no such file")
        out[key] = path
    return out


def _configure_generators(server, templates: dict[str | None, Path]) -> None:
    """``--chat-template``, set on each generating model once loaded; a template naming an encoder is refused."""
    from attnx.runtime.core.chat import ChatTemplate

    for name in templates:
        if name is not None and name not in server.generators:
            raise UserError(f"--chat-template {name}=...: model {name!r} does not generate text")
    for name, model in server.generators.items():
        file = templates.get(name, templates.get(None))
        try:
            template = ChatTemplate.from_file(file, model.tokenizer.file.parent) if file is not None else None
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise UserError(f"--chat-template {file}: {e}") from None
        model.configure(chat_template=template)
