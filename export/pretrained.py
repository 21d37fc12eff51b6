"""Export a real pretrained model (a Hugging Face folder) with a variant placed in it, from token ids.

    attnx export --from-pretrained path/to/all-MiniLM-L6-v2 --variant smal

writes ``<name>.onnx`` (inputs ``input_ids``, ``attention_mask``, ``token_type_ids`` where the model
has them, then the variant's context inputs; outputs by task, :mod:`attnx.pretrained.host`:
``last_hidden_state`` and, for sentence-transformers folders, ``sentence_embedding``; ``logits`` of
a causal LM or a classifier; its weights in ``<name>.onnx.data`` past ~1.8 GB), ``<name>.safetensors``
and ``<name>.tokenizer/`` (the folder's tokenizer files, ``tokenizer.json`` rewritten without the
source's fixed padding and with truncation at the export's maximum length). The metadata names the
tokenizer folder, the maximum length (sentence-transformers' ``max_seq_length`` where set: it
truncates there, not at the tokenizer file's own limit), the truncation side and the pad id.

The reference ``attnx check`` rebuilds reads the pretrained weights from the source folder itself
(``attnx.reference``: its path, and each weight file's size and sha256, checked when read), so
``<name>.safetensors`` holds only what the folder lacks: the placed variant's parameters.
``copy_weights=True`` (``--copy-weights``) stores every weight there instead, for checking where the
source folder is not.

What cannot be served is refused before any work, in one line: tokenizer files without a
``tokenizer.json`` (serving tokenises with the tokenizers library), a maximum length that leaves no
room for text beside the special tokens. The files appear as a whole or not at all
(:mod:`attnx.export.staging`).
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from pathlib import Path

from attnx.contract import BATCH, SEQ
from attnx.export.exporter import ExportResult, Progress, export_encoder, export_names
from attnx.export.staging import Staging, check_room


def default_name(folder, variant: str, lowering: str = "plugin", fp16: bool = False) -> str:
    suffix = ("" if lowering == "plugin" else f"-{lowering}") + ("-fp16" if fp16 else "")
    return f"{folder.name}-{variant}{suffix}"


def _tokenizer_config(folder) -> dict:
    cfg_path = folder.path / "tokenizer_config.json"
    if not cfg_path.is_file():
        return {}
    try:
        cfg = json.loads(cfg_path.read_text())
    except ValueError as e:
        raise ValueError(f"{cfg_path}: not valid JSON ({e})") from None
    return cfg if isinstance(cfg, dict) else {}


def _read_tokenizer(path: Path):
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # the tokenizers library raises its own exception type
        raise ValueError(f"{path}: the tokenizers library cannot read it ({str(e).splitlines()[0][:160]})") from None


def check_servable(folder, max_length: int | None) -> None:
    """What ``attnx serve`` would refuse, refused now: tokenizer files without ``tokenizer.json``, an
    unreadable one, a maximum length that leaves no room for text (one line each)."""
    if not folder.tokenizer_files:
        return  # a model of token ids (serve takes ids, or --tokenizer)
    file = folder.path / "tokenizer.json"
    if not file.is_file():
        found = ", ".join(sorted(f.name for f in folder.tokenizer_files))
        raise ValueError(f"{folder.path} has tokenizer files ({found}) but no tokenizer.json: attnx serves text "
                         "through the tokenizers library's tokenizer.json. Write it with transformers "
                         f"(AutoTokenizer.from_pretrained(folder).save_pretrained(folder)), then export again")
    tok = _read_tokenizer(file)
    if max_length is None:
        return
    tok.no_truncation()
    tok.no_padding()  # a tokenizer.json that pads to a fixed length would count its padding as specials
    specials = len(tok.encode("").ids)  # the special tokens every text gets ([CLS] .. [SEP], <s> ...)
    if max_length <= specials:
        where = ("sentence_bert_config.json's max_seq_length" if folder.sentence_transformer is not None
                 and folder.sentence_transformer.max_seq_length else "tokenizer_config.json's model_max_length")
        raise ValueError(f"{folder.path}: {where} {max_length} leaves no room for text (the tokenizer adds "
                         f"{specials} special token(s) to every text): set it above {specials}")


def tokenizer_info(folder, max_length: int, directory: str) -> dict:
    """How serving must tokenise: the files' folder, truncation to ``max_length`` on the recorded side,
    the pad id (the tokenizer's own padding and truncation settings are not used: see the module doc)."""
    cfg = _tokenizer_config(folder)
    pad_id = folder.config.get("pad_token_id")
    if (folder.path / "tokenizer.json").is_file():
        tok = _read_tokenizer(folder.path / "tokenizer.json")
        pad_token = cfg.get("pad_token")
        pad_token = pad_token.get("content") if isinstance(pad_token, dict) else pad_token
        if isinstance(pad_token, str) and tok.token_to_id(pad_token) is not None:
            pad_id = tok.token_to_id(pad_token)
    if pad_id is None:
        pad_id = folder.config.get("eos_token_id") or 0
    side = cfg.get("truncation_side", "right")
    if side not in ("left", "right"):
        raise ValueError(f"{folder.path / 'tokenizer_config.json'}: truncation_side {side!r} must be left or right")
    return {"dir": directory, "file": "tokenizer.json", "max_length": int(max_length), "truncation_side": side,
            "pad_id": int(pad_id), "model_type": folder.model_type}


def source_reference(folder) -> dict:
    """``attnx.reference``: the source folder and a fingerprint of its weight files (size, sha256)."""
    files = []
    for f in folder.weights:
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 22), b""):
                h.update(chunk)
        files.append({"name": f.name, "bytes": f.stat().st_size, "sha256": h.hexdigest()})
    return {"source": str(folder.path.resolve()), "files": files}


def _weights_estimate(folder, fp16: bool, int8: bool, weight_bits: int | None = None) -> int:
    """Bytes of the export's weights, from the checkpoint's headers (nothing loaded)."""
    from attnx.pretrained.tensors import source_of

    source = source_of(folder)
    try:
        n = sum(math.prod(info.shape) for info in source.infos().values())
    finally:
        source.close()
    per = weight_bits / 8 * 1.25 if weight_bits else 2 if fp16 else 4  # blocks: scales and zero points beside
    return int(n * per) + (n if int8 else 0) + sum(f.stat().st_size for f in folder.tokenizer_files)


def _export_folder(path: Path) -> bool:
    """Whether a with-past export may own ``path.parent`` as a whole (new, empty, or a previous export's,
    and not the working directory)."""
    folder = path.parent
    if not folder.exists():
        return True
    if not folder.is_dir() or Path.cwd().resolve().is_relative_to(folder.resolve()):
        return False
    return (folder / "genai_config.json").is_file() or not any(folder.iterdir())


def export_pretrained(source, path: str | Path | None = None, *, variant: str | None = None, layers=None,
                      append: int | None = None, options: dict | None = None, checkpoint=None, task: str | None = None,
                      lowering: str = "plugin", fp16: bool = False, profiles: dict | None = None,
                      folder_out: str | Path = "attnx-out", attention_outputs=None, head_mask: bool = False,
                      progress: Progress | None = None, fuse: bool = True, with_past: bool = False,
                      copy_weights: bool = False, int8_weight_bits: int | None = None,
                      weight_only_bits: int | None = None, weight_only_options: dict | None = None) -> ExportResult:
    """Load ``source`` (a folder path) with ``variant`` placed in it and export it (see module doc).
    ``with_past``: a causal LM that generates, its KV cache in and out (:mod:`attnx.export.with_past`);
    ``weight_only_bits`` (4 or 8, with ``with_past``): its MatMul weights block-quantized (:mod:`attnx.export.weight_only`;
    ``weight_only_options``: ``block_size``, ``lm_head_bits``)."""
    from attnx import pretrained
    from attnx.pretrained.host import check_task, task_of

    step = progress or (lambda name, done=None, total=None: None)
    if variant is not None and not str(variant).strip():
        raise ValueError("the variant name is empty; valid variants: see `attnx variants` (default mha)")
    if weight_only_bits is not None and (not with_past or fp16 or int8_weight_bits is not None):
        raise ValueError("weight-only quantization (MatMulNBits) is for an fp32 --with-past decoder: not with "
                         "--fp16 or --int8, nor for a full-sequence export")
    folder = pretrained.read_folder(source)
    name = variant or (folder.placement or {}).get("variant") or "mha"
    chosen = check_task(task) if task else task_of(folder.architectures)
    if with_past:
        from attnx.export import with_past as past

        past.check(chosen, attention_outputs, head_mask, folder.path)
        path = Path(path) if path is not None else \
            Path(folder_out) / f"{default_name(folder, name, lowering, fp16)}-with-past" / "model.onnx"
    path = Path(path) if path is not None else Path(folder_out) / f"{default_name(folder, name, lowering, fp16)}.onnx"
    if path.suffix.lower() != ".onnx":
        raise ValueError(f"the output must be a .onnx file, got {path.name}")
    check_servable(folder, folder.max_length)
    owned = export_names(path)
    if with_past:
        from attnx.export.genai import CONFIG_NAME, TOKENIZER_FILES

        owned |= {CONFIG_NAME, *TOKENIZER_FILES}
    whole_folder = with_past and _export_folder(path)
    with Staging(path.parent if whole_folder else path, folder=whole_folder, owned=owned) as stage:
        check_room(path.parent if path.parent.exists() else stage.dest,
                   _weights_estimate(folder, fp16, int8_weight_bits is not None, weight_only_bits))
        step("load")
        # A decoder exported with its cache reads each pretrained weight from the folder when it writes it
        # (attnx.pretrained.streamed); --int8 calibrates on the model and --copy-weights stores every weight.
        streamed = with_past and int8_weight_bits is None and not copy_weights
        host = pretrained.load(folder, variant, layers=layers, append=append, options=options, checkpoint=checkpoint,
                               task=task, streamed=streamed)
        if with_past:
            host, profiles = past.prepare(host, profiles)
        max_length = host.max_length
        if profiles is None:
            profiles = {BATCH: (1, 8, 32), SEQ: (1, min(128, max_length), max_length)}
        elif SEQ in profiles and int(profiles[SEQ][2]) > host.max_seq:
            raise ValueError(f"seq profile max {profiles[SEQ][2]} exceeds the model's {host.max_seq} positions")
        tok_dir = path.with_name(f"{path.stem}.tokenizer")
        tokenizer = None
        if folder.tokenizer_files:
            tokenizer = tokenizer_info(folder, max_length, tok_dir.name)
            staged_tok = stage.path(tok_dir.name)
            staged_tok.mkdir()
            for f in folder.tokenizer_files:
                shutil.copyfile(f, staged_tok / f.name)  # the content, never a link
            if (staged_tok / "tokenizer.json").is_file():
                _export_tokenizer_json(staged_tok / "tokenizer.json", max_length, tokenizer["truncation_side"])
        reference = None if copy_weights else source_reference(folder)
        own = None if copy_weights else sorted(set(host.state_dict()) - host.pretrained_names)
        result = export_encoder(host, path, lowering=lowering, fp16=fp16, profiles=profiles, progress=step,
                                tokenizer=tokenizer, attention_outputs=attention_outputs, head_mask=head_mask,
                                fuse=fuse, staging=stage, weight_names=own, reference=reference,
                                int8_weight_bits=int8_weight_bits, weight_only_bits=weight_only_bits,
                                weight_only_options=weight_only_options)
        result.notes = list(folder.notes)
        if with_past:
            result.notes += past.finish(stage.path(path.name), result.info, folder.config,
                                        stage.path(tok_dir.name) if tokenizer is not None else None, path.parent)
        step("commit")
        stage.commit()
    return result


def _export_tokenizer_json(path: Path, max_length: int, side: str) -> None:
    """The source's own padding (all-MiniLM-L6-v2's pads every text to 128) off, truncation at the
    export's max length: the file says what the model takes, for any tool that reads it."""
    tok = _read_tokenizer(path)
    tok.no_padding()
    tok.enable_truncation(max_length, direction=side)
    tok.save(str(path))
