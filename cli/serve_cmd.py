"""`attnx serve`, `attnx bench`: serving an exported model, and loading a server.

Heavy modules (onnxruntime, FastAPI, uvicorn, tritonclient) are imported inside
the command bodies so `attnx --help` stays fast.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import List, Optional

import typer

from attnx.cli._common import UserError, console, err_console, guarded, latest_export


def _seq_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.replace(" ", "").split(",") if v]
    except ValueError:
        raise UserError(f"--seq takes comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise UserError(f"--seq needs positive lengths, got {text!r}")
    return values


def _batching(max_batch, max_delay_ms, max_queue, timeout_ms, max_length_ratio, max_batch_tokens):
    from attnx.runtime.core.batcher import BatcherConfig

    try:
        return BatcherConfig(
            max_batch_size=max_batch,
            max_queue_delay_ms=max_delay_ms,
            max_queue_size=max_queue,
            timeout_ms=timeout_ms if timeout_ms else None,
            max_length_ratio=max_length_ratio or None,
            max_batch_tokens=max_batch_tokens or None,
        )
    except ValueError as e:
        raise UserError(str(e)) from None


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
    @guarded
    def serve(
        models: Optional[List[str]] = typer.Argument(
            None, help="Model files (.onnx/.engine), each optionally as name=path. Default: the latest export."
        ),
        host: str = typer.Option("127.0.0.1", help="Address to listen on (loopback by default)."),
        port: int = typer.Option(8000, help="TCP port (0 = any free port)."),
        max_batch: int = typer.Option(32, "--max-batch", help="Max rows per batch (1 disables batching)."),
        max_delay_ms: float = typer.Option(2.0, "--max-delay-ms", help="Max time a request waits for others."),
        max_queue: int = typer.Option(1024, "--max-queue", help="Waiting requests per model before 503."),
        timeout_ms: float = typer.Option(30000.0, "--timeout-ms", help="Max time a request may wait in queue."),
        max_body_mb: float = typer.Option(64.0, "--max-body-mb", help="Largest request body accepted (MiB)."),
        max_seq: Optional[int] = typer.Option(None, "--max-seq", help="Longest seq accepted (default: profile max)."),
        max_length_ratio: float = typer.Option(
            1.5, "--max-length-ratio", help="Longest/shortest sequence in one batch (0 = pad anything)."
        ),
        max_batch_tokens: int = typer.Option(
            8192, "--max-batch-tokens", help="Cap on rows x padded length per batch (0 = none). On a CPU, requests "
                                             "this long gain nothing from sharing a run, and their activations add up; "
                                             "raise it on a GPU."),
        device: str = typer.Option("auto", help="ONNX Runtime device: auto, cpu or cuda."),
        threads: Optional[int] = typer.Option(None, help="Intra-op threads per model (default: all CPUs)."),
        log_level: str = typer.Option("warning", "--log-level", help="uvicorn log level."),
        grpc_port: Optional[int] = typer.Option(
            None, "--grpc-port", help="Also serve KServe v2 over gRPC on this port (0 = any free port)."),
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
        max_header_kb: float = typer.Option(
            64.0, "--max-header-kb", help="Largest HTTP request head (request line + headers, KiB); 431 beyond."),
        max_headers: int = typer.Option(100, "--max-headers", help="Most HTTP request headers; 431 beyond."),
        head_timeout_s: float = typer.Option(
            10.0, "--head-timeout-s", help="Seconds a connection may take to send a complete request head; 408 "
                                           "and closed beyond."),
        api_key: Optional[str] = typer.Option(
            None, "--api-key", envvar="ATTNX_API_KEY", show_envvar=True, show_default=False,
            help="Require 'Authorization: Bearer KEY' on every route but the health checks (HTTP and gRPC). "
                 "Prefer the environment variable: a flag shows in ps."),
        dimensions: Optional[List[str]] = typer.Option(
            None, "--dimensions", help="Let /v1/embeddings and /embed cut embeddings to fewer dimensions (the "
                                       "first k, renormalised: for Matryoshka-trained models): 'any' or sizes like "
                                       "64,128,256, for every model or as NAME=..."),
        body_timeout_s: float = typer.Option(
            10.0, "--body-timeout-s", help="Seconds an HTTP request body may take, plus 1 s per --min-body-rate-kb "
                                           "KiB received; 408 and closed beyond."),
        min_body_rate_kb: float = typer.Option(
            16.0, "--min-body-rate-kb", help="KiB/s a body must keep up past --body-timeout-s (0: that is a total "
                                             "deadline)."),
        max_inputs: int = typer.Option(1024, "--max-inputs", help="Most texts in one request (all APIs)."),
        max_request_tokens: int = typer.Option(
            300000, "--max-request-tokens", help="Most tokens in one request, summed over its texts (413 beyond)."),
        max_new_tokens: Optional[int] = typer.Option(
            None, "--max-new-tokens", help="Generating models: most tokens one completion generates; the default "
                                           "when a request sets no max_tokens, and larger ones are clamped to it "
                                           "(as vLLM's max_new_tokens override; finish_reason 'length')."),
        chat_template: Optional[List[str]] = typer.Option(
            None, "--chat-template", help="A Jinja chat template for generating models whose files carry none "
                                          "(or to replace theirs): FILE for every generating model, or NAME=FILE."),
        max_positions: Optional[int] = typer.Option(
            None, "--max-positions", help="Generating models: most positions (prompt + generated tokens) per "
                                          "sequence, which bounds the KV cache (vLLM's --max-model-len); 400 beyond."),
    ) -> None:
        """Serve models over HTTP (and gRPC) with the KServe v2 protocol (tritonclient works), with dynamic
        batching that pads requests of different lengths; text in for models with a tokenizer."""
        from rich.markup import escape

        from attnx.runtime.core.axes import AxisError, AxisFlags
        from attnx.runtime.server import InferenceServer, check_ports
        from attnx.runtime.wire.auth import ENV_VAR, ApiKey
        from attnx.runtime.wire.limits import Limits

        files = _model_files(models)
        batching = _batching(max_batch, max_delay_ms, max_queue, timeout_ms, max_length_ratio, max_batch_tokens)
        # Limits that would refuse every request are refused now, not once per request.
        if not max_body_mb * (1 << 20) >= 1:
            raise UserError(f"--max-body-mb must be positive, got {max_body_mb}")
        if max_seq is not None and max_seq < 1:
            raise UserError(f"--max-seq must be >= 1, got {max_seq}")
        for flag, value in (("--port", port), ("--grpc-port", grpc_port)):
            if value is not None and not 0 <= value <= 65535:
                raise UserError(f"{flag} must be 0..65535, got {value}")
        if max_new_tokens is not None and max_new_tokens < 1:
            raise UserError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
        templates = _chat_template_files(chat_template, files)
        if max_positions is not None and max_positions < 2:
            raise UserError(f"--max-positions must be >= 2 (a prompt token and a generated one), got {max_positions}")
        for flag, value in (("--max-inputs", max_inputs), ("--max-request-tokens", max_request_tokens)):
            if value < 1:
                raise UserError(f"{flag} must be >= 1, got {value}")
        limits = Limits(max_body_bytes=int(max_body_mb * (1 << 20)), max_seq=max_seq, max_texts=max_inputs,
                        max_request_tokens=max_request_tokens, max_positions=max_positions,
                        **_body_deadline(body_timeout_s, min_body_rate_kb))
        if api_key is None and os.environ.get(ENV_VAR) == "":
            api_key = ""  # set but empty: refused below, never read as "no key"
        if api_key is not None:
            try:
                ApiKey(api_key)
            except ValueError as e:
                raise UserError(f"--api-key / {ENV_VAR}: {e}") from None
        from attnx.runtime.apis.encoding import Dimensions

        try:
            dims = Dimensions.parse(dimensions, files)
        except ValueError as e:
            raise UserError(str(e)) from None
        try:
            axes = AxisFlags.parse(batch_axis, seq_axis)
        except AxisError as e:
            raise UserError(str(e)) from None
        from attnx.runtime.wire.http_guard import HttpLimits

        try:
            http_limits = HttpLimits(max_header_bytes=int(max_header_kb * 1024), max_headers=max_headers,
                                     head_timeout_s=head_timeout_s)
        except ValueError as e:
            raise UserError(f"--max-header-kb / --max-headers / --head-timeout-s: {e}") from None
        if not describe:  # a busy port is found now, not after every model has loaded
            try:
                check_ports(host, port, grpc_port)
            except OSError as e:
                raise UserError(str(e.strerror or e)) from None
        server = InferenceServer(
            files, host=host, port=port, grpc_port=grpc_port, batching=batching, limits=limits, device=device,
            threads=threads, log_level=log_level, tokenizers=_tokenizer_dirs(tokenizer, files), axes=axes,
            on_warning=lambda m: err_console.print(f"[yellow]warning:[/yellow] {escape(m)}", highlight=False),
            api_key=api_key, dimensions=dims, http_limits=http_limits,
        )
        _configure_generators(server, max_new_tokens, templates)
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
            f"max batch {max_batch}, max delay {max_delay_ms} ms, queue {max_queue}; "
            "Ctrl-C stops after in-flight requests finish"
        )
        # One plain line with the real address (port 0 picks one), for people and for scripts.
        if server.grpc_address:
            err_console.print(f"gRPC listening on {server.grpc_address}", highlight=False, soft_wrap=True)
        err_console.print("APIs: KServe v2 (/v2), OpenAI (/v1/embeddings), TEI (/embed, /predict, /rerank), "
                          "Cohere/Jina (/v1/rerank), Infinity (/classify)"
                          + ("; generation: Triton (/v2/models/{m}/generate[_stream]), OpenAI (/v1/completions, "
                             "/v1/chat/completions), vLLM (/tokenize, /detokenize)" if server.generators else "")
                          + ("; API key required" if api_key else ""), highlight=False)
        err_console.print(f"listening on {server.url}", highlight=False, soft_wrap=True)
        server.serve()

    @app.command("bench")
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
        max_batch: int = typer.Option(32, "--max-batch", help="In-process: max rows per batch."),
        max_delay_ms: float = typer.Option(2.0, "--max-delay-ms", help="In-process: max queue delay."),
        max_queue: int = typer.Option(1024, "--max-queue", help="In-process: queue limit."),
        max_length_ratio: float = typer.Option(1.5, "--max-length-ratio", help="In-process: see serve."),
        max_batch_tokens: int = typer.Option(0, "--max-batch-tokens", help="In-process: see serve."),
        device: str = typer.Option("auto", help="In-process: auto, cpu or cuda."),
        threads: Optional[int] = typer.Option(None, help="In-process: intra-op threads."),
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
    ) -> None:
        """Load-test a model: throughput and p50/p95/p99 latency at a given concurrency. With --text: texts
        of --min-tokens..--max-tokens, every answer checked against the same text run alone, the
        (server's) RSS before and after."""
        import json

        from attnx.deploy import loadtest as b

        lengths = _seq_list(seq)
        if concurrency < 1 or duration <= 0 or batch < 1:
            raise UserError("--concurrency and --batch must be >= 1 and --duration > 0")
        if text:
            from attnx.cli.bench_text import bench_text

            config = _batching(max_batch, max_delay_ms, max_queue, None, max_length_ratio, max_batch_tokens)
            numbers = bench_text(model, url=url, concurrency=concurrency, duration=duration, min_tokens=min_tokens,
                                 max_tokens=max_tokens, count=texts, outputs=output, tokenizer=tokenizer,
                                 batching=config, device=device, threads=threads, compare_batch_1=compare_batch_1,
                                 rounds=rounds)
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
            specs = _specs_from_metadata(meta)
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
            session = load(path, device=device, threads=threads)
            pool = b.request_pool(session.inputs, lengths, batch=batch)
            config = _batching(max_batch, max_delay_ms, max_queue, None, max_length_ratio, max_batch_tokens)
            with DynamicBatcher(session, config) as batcher:
                b.run_load(lambda: batcher.infer, pool[:1], concurrency=1, duration_s=0.5)  # warm-up
                warm = batcher.stats.batches, batcher.stats.rows
                result = b.run_load(
                    lambda: batcher.infer, pool, concurrency=concurrency, duration_s=duration,
                    label=f"{path.name} in-process (max batch {max_batch})",
                )
                batches = batcher.stats.batches - warm[0]
                result.mean_batch_rows = (batcher.stats.rows - warm[1]) / batches if batches else None
        console.print(b.render([result], title=f"attnx bench: seq {lengths}, batch {batch}"))
        if report:
            report.write_text(json.dumps(result.summary(), indent=2))
        if result.ok == 0:
            raise UserError(f"no request succeeded; errors: {dict(result.errors)}", code=1)


def _specs_from_metadata(meta: dict):
    """TensorSpecs from KServe model metadata (-1 dims: batch first, then seq where the rank says so)."""
    import numpy as np

    from attnx.contract import BATCH, SEQ, default_role
    from attnx.runtime.apis.kserve_tensors import TRITON_TO_NUMPY
    from attnx.runtime.core.session import TensorSpec

    specs = []
    for t in meta.get("inputs", []):
        if t["datatype"] == "BYTES":  # a text model's text input: its token-id inputs are used instead
            continue
        dims: list = []
        for axis, d in enumerate(t["shape"]):
            if d != -1:
                dims.append(d)
            else:
                dims.append(BATCH if axis == 0 else SEQ if SEQ not in dims else "?")
        specs.append(TensorSpec(t["name"], np.dtype(TRITON_TO_NUMPY[t["datatype"]]), tuple(dims),
                                default_role(t["name"], True)))
    return specs


def _body_deadline(timeout_s: float, rate_kb: float) -> dict:
    """``--body-timeout-s`` / ``--min-body-rate-kb`` as Limits fields, refused now when they would refuse every body."""
    if not timeout_s > 0 or not rate_kb >= 0:
        raise UserError(f"--body-timeout-s must be > 0 and --min-body-rate-kb >= 0, got {timeout_s} and {rate_kb}")
    return {"body_timeout_s": timeout_s, "min_body_rate": int(rate_kb * 1024) or None}


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


def _configure_generators(server, max_new_tokens: int | None, templates: dict[str | None, Path]) -> None:
    """The serve options of generating models, set on each once loaded; a template naming an encoder is refused."""
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
        model.configure(max_new_tokens=max_new_tokens, chat_template=template)
