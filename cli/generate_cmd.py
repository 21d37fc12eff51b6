"""`attnx generate`: text from a decoder, streamed to the terminal."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import List, Optional

import typer

from attnx.cli._common import UserError, err_console, guarded, workdir


def _is_hf_folder(path: Path) -> bool:
    from attnx.pretrained.gguf import gguf_source

    if path.is_dir() and any(path.glob("*.onnx")):
        return False
    return (path.is_dir() and (path / "config.json").is_file()) or gguf_source(path) is not None


def model_file(model: Path, variant: Optional[str], lowering: str) -> Path:
    """The with-past file to run: ``model`` itself (``.onnx`` / ``.engine``), the one model in its folder, or,
    for a Hugging Face folder, its with-past export (made now, or reused when it is already in the working
    folder and newer than the folder's weights)."""
    from attnx.runtime.core.encode import find_model_file

    if not model.exists():
        raise UserError(f"no model file or folder at {model}")
    if not _is_hf_folder(model):
        if variant is not None:
            raise UserError("--variant places a variant in a Hugging Face folder; this is an export already")
        return find_model_file(model)
    from attnx.export.pretrained import default_name, export_pretrained
    from attnx.pretrained import read_folder, task_of

    folder = read_folder(model)
    if task_of(folder.architectures) != "causal-lm":  # said before any export starts
        arch = ", ".join(folder.architectures) or f"a {folder.model_type} model without 'architectures' in config.json"
        raise UserError(f"{model} holds {arch}, not a causal language model, so it cannot generate text: "
                        "`attnx generate` needs a decoder (config.json's architectures ending in ForCausalLM)")
    name = variant or (folder.placement or {}).get("variant") or "mha"
    target = workdir() / f"{default_name(folder, name, lowering)}-with-past" / "model.onnx"
    newest = max((w.stat().st_mtime for w in folder.weights), default=0.0)
    if target.is_file() and target.stat().st_mtime >= newest and _exported_from(target, folder.path):
        err_console.print(f"[dim]using {target} (exported earlier from {model})[/dim]", highlight=False)
        return target
    err_console.print(f"[dim]exporting {model} with {name} and its KV cache to {target} ...[/dim]", highlight=False)
    started = time.monotonic()
    export_pretrained(model, target, variant=None if folder.placement and variant is None else name,
                      lowering=lowering, with_past=True, folder_out=workdir())
    err_console.print(f"[dim]exported in {time.monotonic() - started:.1f}s[/dim]", highlight=False)
    return target


def _exported_from(path: Path, folder: Path) -> bool:
    from attnx.contract import ModelInfo

    try:
        info = ModelInfo.read(path)
    except ValueError:
        return False
    return bool(info and info.cache and (info.config or {}).get("source") == str(folder.resolve()))


def register(app: typer.Typer) -> None:
    @app.command("generate")
    @guarded
    def generate(
        model: Path = typer.Argument(..., help="A with-past export (.onnx, or its folder), its engine, or a Hugging "
                                               "Face folder or GGUF file (exported with its KV cache on first use)."),
        prompt: str = typer.Argument(..., help="The text to continue."),
        max_new_tokens: int = typer.Option(64, "--max-new-tokens", "-n", help="Most tokens to generate."),
        temperature: Optional[float] = typer.Option(None, "--temperature", help="Sample at this temperature "
                                                    "(0: greedy). Greedy unless a sampling option is given."),
        top_k: Optional[int] = typer.Option(None, "--top-k", help="Sample among the k most likely tokens."),
        top_p: Optional[float] = typer.Option(None, "--top-p", help="Sample among the most likely tokens whose "
                                              "probability reaches p (nucleus)."),
        repetition_penalty: Optional[float] = typer.Option(None, "--repetition-penalty", help="Divide the logits "
                                                           "of tokens already seen by this (> 1 repeats less)."),
        stop: Optional[List[str]] = typer.Option(None, "--stop", help="Stop at this string (repeatable; it is not "
                                                 "printed)."),
        seed: Optional[int] = typer.Option(None, "--seed", help="Seed for sampling (the same text every run)."),
        sample: bool = typer.Option(False, "--sample", help="Sample (temperature 1) instead of greedy."),
        variant: Optional[str] = typer.Option(None, "--variant", help="With a Hugging Face folder: the variant to "
                                              "place (default mha)."),
        lowering: str = typer.Option("plugin", "--lowering", help="With a Hugging Face folder: plugin | rewrite."),
        device: str = typer.Option("auto", help="ONNX Runtime device: auto, cpu or cuda."),
        threads: Optional[int] = typer.Option(None, help="Intra-op threads (default: all CPUs)."),
        max_positions: Optional[int] = typer.Option(
            None, "--max-positions", help="Most positions (prompt + generated tokens) to serve, which bounds the KV "
                                          "cache (vLLM's --max-model-len, llama.cpp's -c). Default: the model's."),
    ) -> None:
        """Generate text from a decoder with its KV cache, streamed as it is made (greedy by default)."""
        from attnx.runtime.core.decoding import NotAGenerator
        from attnx.runtime.core.encode import TextModel
        from attnx.runtime.core.sampling import SamplingError, sampling_params

        try:
            params = sampling_params(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                                     top_p=top_p, repetition_penalty=repetition_penalty, stop=stop, seed=seed,
                                     do_sample=True if sample else None)
        except SamplingError as e:
            raise UserError(f"--{(e.param or 'option').replace('_', '-')}: {e}") from None
        if max_positions is not None and max_positions < 2:
            raise UserError(f"--max-positions must be >= 2 (a prompt token and a generated one), got {max_positions}")
        path = model_file(model, variant, lowering)
        from attnx.runtime.core.decoding import Decoder, memory_warning

        try:
            text_model = TextModel(path, device=device, threads=threads)
            decoder = Decoder(text_model.session, max_positions=max_positions, bound_by="--max-positions")
        except NotAGenerator as e:
            raise UserError(str(e)) from None
        footprint = decoder.kv_footprint()
        err_console.print(f"[dim]{footprint.describe()}[/dim]", highlight=False)
        warning = memory_warning(footprint, 1, "--max-positions")
        if warning:
            err_console.print(f"[yellow]warning:[/yellow] {warning}", highlight=False)
        ids = text_model.tokenizer.tokenize([prompt], truncate=False)[0].ids
        if decoder.max_positions and len(ids) >= decoder.max_positions:
            raise UserError(f"the prompt has {len(ids)} tokens; {decoder.positions_text} are served, so a prompt "
                            f"must be shorter than {decoder.max_positions} tokens")
        from attnx.runtime.core.generate import stream

        started, first, count, reason = time.monotonic(), None, 0, None
        for piece in stream(decoder, text_model.tokenizer, ids, params):
            if piece.token is not None:
                count += 1
                first = first or time.monotonic()
            if piece.text:
                sys.stdout.write(piece.text)
                sys.stdout.flush()
            reason = piece.finish_reason or reason
        sys.stdout.write("\n")
        elapsed = time.monotonic() - started
        decode = (time.monotonic() - first) / max(1, count - 1) * 1000 if first and count > 1 else None
        err_console.print(f"[dim]{count} tokens ({reason}), prompt {len(ids)} tokens, {elapsed:.2f}s"
                          + (f", {decode:.1f} ms/token after the first" if decode else "") + "[/dim]",
                          highlight=False)
