"""Export a real pretrained model (a Hugging Face folder) with a variant placed in it, from token ids.

    attnx export --from-pretrained path/to/all-MiniLM-L6-v2 --variant smal

writes ``<name>.onnx`` (inputs ``input_ids``, ``attention_mask``, ``token_type_ids`` where the model
has them, then the variant's context inputs; outputs by task, :mod:`attnx.pretrained.host`:
``last_hidden_state`` and, for sentence-transformers folders, ``sentence_embedding``; ``logits`` of
a causal LM or a classifier), ``<name>.safetensors`` (the placed model's weights, for ``attnx
check``) and ``<name>.tokenizer/`` (the folder's tokenizer files, ``tokenizer.json`` rewritten
without the source's fixed padding and with truncation at the export's maximum length). The
metadata names the tokenizer folder, the maximum length (sentence-transformers' ``max_seq_length``
where set: it truncates there, not at the tokenizer file's own limit), the truncation side and the
pad id. Nothing is left behind when a step fails.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Callable

from attnx.contract import BATCH, SEQ
from attnx.export.exporter import ExportResult, export_encoder


def default_name(folder, variant: str, lowering: str = "plugin", fp16: bool = False) -> str:
    suffix = ("" if lowering == "plugin" else f"-{lowering}") + ("-fp16" if fp16 else "")
    return f"{folder.name}-{variant}{suffix}"


def tokenizer_info(folder, max_length: int, directory: str) -> dict:
    """How serving must tokenise: the files' folder, truncation to ``max_length`` on the recorded side,
    the pad id (the tokenizer's own padding and truncation settings are not used: see the module doc)."""
    cfg = {}
    cfg_path = folder.path / "tokenizer_config.json"
    if cfg_path.is_file():
        try:
            cfg = json.loads(cfg_path.read_text())
        except ValueError as e:
            raise ValueError(f"{cfg_path}: not valid JSON ({e})") from None
    pad_id = folder.config.get("pad_token_id")
    if (folder.path / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        try:
            tok = Tokenizer.from_file(str(folder.path / "tokenizer.json"))
        except Exception as e:  # the tokenizers library raises its own exception type
            raise ValueError(f"{folder.path / 'tokenizer.json'}: the tokenizers library cannot read it "
                             f"({str(e).splitlines()[0][:160]})") from None
        pad_token = cfg.get("pad_token")
        pad_token = pad_token.get("content") if isinstance(pad_token, dict) else pad_token
        if isinstance(pad_token, str) and tok.token_to_id(pad_token) is not None:
            pad_id = tok.token_to_id(pad_token)
    if pad_id is None:
        pad_id = folder.config.get("eos_token_id") or 0
    side = cfg.get("truncation_side", "right")
    if side not in ("left", "right"):
        raise ValueError(f"{cfg_path}: truncation_side {side!r} must be left or right")
    return {"dir": directory, "file": "tokenizer.json", "max_length": int(max_length), "truncation_side": side,
            "pad_id": int(pad_id), "model_type": folder.model_type}


def export_pretrained(source, path: str | Path | None = None, *, variant: str | None = None, layers=None,
                      append: int | None = None, options: dict | None = None, checkpoint=None, task: str | None = None,
                      lowering: str = "plugin", fp16: bool = False, profiles: dict | None = None,
                      folder_out: str | Path = "attnx-out", attention_outputs=None, head_mask: bool = False,
                      progress: Callable[[str], None] | None = None, fuse: bool = True,
                      with_past: bool = False) -> ExportResult:
    """Load ``source`` (a folder path) with ``variant`` placed in it and export it (see module doc).
    ``with_past``: a causal LM that generates, its KV cache in and out (:mod:`attnx.export.with_past`)."""
    from attnx import pretrained

    folder = pretrained.read_folder(source)
    host = pretrained.load(folder, variant, layers=layers, append=append, options=options, checkpoint=checkpoint,
                           task=task)
    name = host.variant if variant is None else variant
    if with_past:
        from attnx.export import with_past as past

        host, path, profiles = past.prepare(host, path, profiles, folder_out, default_name(folder, name, lowering, fp16),
                                            attention_outputs, head_mask)
    path = Path(path) if path is not None else Path(folder_out) / f"{default_name(folder, name, lowering, fp16)}.onnx"
    if path.suffix.lower() != ".onnx":
        raise ValueError(f"the output must be a .onnx file, got {path.name}")
    max_length = host.max_length
    positions = host.max_seq
    if profiles is None:
        profiles = {BATCH: (1, 8, 32), SEQ: (1, min(128, max_length), max_length)}
    elif SEQ in profiles and int(profiles[SEQ][2]) > positions:
        raise ValueError(f"seq profile max {profiles[SEQ][2]} exceeds the model's {positions} positions")
    tok_dir = path.with_name(f"{path.stem}.tokenizer")
    staging = path.with_name(f".{path.stem}.tokenizer.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        tokenizer = None
        if folder.tokenizer_files:
            tokenizer = tokenizer_info(folder, max_length, tok_dir.name)
            staging.mkdir(parents=True)
            for f in folder.tokenizer_files:
                shutil.copyfile(f, staging / f.name)  # the content, never a link
            if (staging / "tokenizer.json").is_file():
                _export_tokenizer_json(staging / "tokenizer.json", max_length, tokenizer["truncation_side"])
        result = export_encoder(host, path, lowering=lowering, fp16=fp16, profiles=profiles, progress=progress,
                                tokenizer=tokenizer, attention_outputs=attention_outputs, head_mask=head_mask,
                                fuse=fuse)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if tokenizer is not None:
        shutil.rmtree(tok_dir, ignore_errors=True)
        os.replace(staging, tok_dir)
    result.notes = list(folder.notes)
    if with_past:
        result.notes += past.finish(result, folder.config, tok_dir if tokenizer is not None else None)
    return result


def _export_tokenizer_json(path: Path, max_length: int, side: str) -> None:
    """The source's own padding (all-MiniLM-L6-v2's pads every text to 128) off, truncation at the
    export's max length: the file says what the model takes, for any tool that reads it."""
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # the tokenizers library raises its own exception type
        raise ValueError(f"tokenizer.json: cannot be read by the tokenizers library ({str(e).splitlines()[0][:160]})") \
            from None
    tok.no_padding()
    tok.enable_truncation(max_length, direction=side)
    tok.save(str(path))
