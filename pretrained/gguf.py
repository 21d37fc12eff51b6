"""GGUF files in: a ``.gguf`` (llama.cpp's format, how most small LLMs ship) read as a Hugging Face folder.

    attnx export --from-pretrained SmolLM2-135M-Instruct.Q4_1.gguf --with-past
    attnx generate path/to/folder-holding-one.gguf "Once upon a time"

transformers' own GGUF loader (``from_pretrained(dir, gguf_file=...)``) reads the file, dequantized to fp32, with
its tokenizer and chat template. Three of its quirks are handled here: the config it builds has no
``architectures`` (set from the model class it loads), it keeps a ``quantization_config`` of type gguf (dropped:
the weights are plain fp32 tensors, and a saved folder carrying it is refused by other tools) and it refuses
``save_pretrained`` of the loaded model (its weights go into a fresh model of the same class, whose tied
embeddings stay tied). The result is an ordinary folder (``config.json``, ``model.safetensors``, the tokenizer
files, ``chat_template.jinja``) in attnx's cache (:func:`cache_root`), keyed on the file's content, so the
export, ``attnx check`` (transformers' reference) and ``attnx generate`` all read the same folder and a second
run reuses it. The folder is fp32: 4 bytes per parameter on disk (538 MB for SmolLM2-135M).

A GGUF is data, not code: the ``gguf`` package reads it through a memory map. Its sizes are checked against
:data:`attnx.pretrained.folder.LIMITS` before any tensor is read, and any file transformers cannot read is one
``ValueError`` naming the file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

SUFFIX = ".gguf"
#: bytes of the file hashed per read (the cache key is its full content)
_CHUNK = 1 << 22
#: the GGUF header's magic number
_MAGIC = b"GGUF"


def gguf_source(path: str | os.PathLike) -> Path | None:
    """The GGUF file ``path`` names: ``path`` itself (a ``.gguf`` file), or the one ``.gguf`` of a folder without
    a ``config.json``; None for anything else (a Hugging Face folder, a missing path)."""
    path = Path(path).expanduser()
    if path.is_file() and path.suffix.lower() == SUFFIX:
        return path
    if path.is_dir() and not (path / "config.json").is_file():
        found = sorted(p for p in path.iterdir() if p.suffix.lower() == SUFFIX and p.is_file())
        if len(found) > 1:
            raise ValueError(f"{path}: holds {len(found)} GGUF files ({', '.join(p.name for p in found[:4])}"
                             f"{', ...' if len(found) > 4 else ''}); name the one to use")
        return found[0] if found else None
    return None


def cache_root() -> Path:
    """Where dequantized GGUF folders live: ``$ATTNX_CACHE``, else ``$XDG_CACHE_HOME/attnx``, else
    ``~/.cache/attnx``; then ``gguf/``."""
    base = os.environ.get("ATTNX_CACHE") or (Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "attnx")
    return Path(base).expanduser() / "gguf"


def content_key(file: Path) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()[:16]


def as_folder(gguf: str | os.PathLike) -> Path:
    """The Hugging Face folder of ``gguf`` (see the module doc): built once per file content, atomically (a
    failure leaves nothing in the cache), then reused."""
    gguf = Path(gguf).expanduser()
    try:
        with open(gguf, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise FileNotFoundError(f"{gguf}: cannot read it ({e.strerror or e})") from None
    if magic != _MAGIC:
        raise ValueError(f"{gguf}: not a GGUF file (it does not start with the GGUF magic number)")
    name = gguf.name[: -len(SUFFIX)] or "model"
    out = cache_root() / content_key(gguf) / name
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    staging = out.with_name(f".{name}.{os.getpid()}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        _dequantize(gguf, staging)
        (staging / "attnx-gguf.json").write_text(json.dumps({"gguf": str(gguf.resolve()), "name": gguf.name}))
        shutil.rmtree(out, ignore_errors=True)
        os.replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def _one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"


def _dequantize(gguf: Path, out: Path) -> None:
    """transformers' loader -> a fresh model of the same class (fp32) -> ``save_pretrained`` into ``out``, with
    the tokenizer and chat template read from the same file."""
    import torch
    import transformers

    from attnx.pretrained.folder import check_limits

    transformers.utils.logging.disable_progress_bar()
    quiet = logging.getLogger("transformers")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # the loader logs every metadata key it does not map
    from transformers import modeling_gguf_pytorch_utils as loader

    import gguf as gguf_package

    bar, reader_class = loader.tqdm, gguf_package.GGUFReader
    loader.tqdm = lambda it, **kw: it  # its own progress bar per tensor: attnx's CLI shows its own progress
    readers: dict = {}
    # config, weights and tokenizer each parse the whole metadata again (~100k tokenizer strings, seconds each):
    # one read-only reader (a memory map) serves the three
    gguf_package.GGUFReader = lambda path, *a, **kw: readers.get(str(path)) or readers.setdefault(
        str(path), reader_class(path, *a, **kw))
    try:
        try:
            config = transformers.AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                             local_files_only=True)
        except Exception as e:  # the gguf reader and transformers raise many types on a broken file
            raise ValueError(f"{gguf}: transformers cannot read it as a GGUF model ({_one_line(e)})") from None
        check_limits(config.to_dict(), gguf)  # before any tensor is dequantized
        try:
            cls = transformers.AutoModelForCausalLM._model_mapping[type(config)]
        except (KeyError, ValueError):
            raise ValueError(f"{gguf}: transformers has no causal LM for its model_type {config.model_type!r}") \
                from None
        try:
            loaded = cls.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32,
                                         local_files_only=True)
            tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                                   local_files_only=True)
        except Exception as e:  # as above: one line, never a traceback
            raise ValueError(f"{gguf}: transformers cannot load its weights or tokenizer ({_one_line(e)})") from None
    finally:
        quiet.setLevel(level)
        loader.tqdm, gguf_package.GGUFReader = bar, reader_class
    config = loaded.config
    config.architectures = [cls.__name__]
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # fp32 tensors now, not a quantized model
    fresh = cls(config).eval()
    missing, unexpected = fresh.load_state_dict(loaded.state_dict(), strict=False)
    tied = {k for k in missing if config.tie_word_embeddings and k.endswith("lm_head.weight")}
    if unexpected or set(missing) - tied:
        raise ValueError(f"{gguf}: its tensors do not fill transformers' {cls.__name__} (missing "
                         f"{sorted(set(missing) - tied)[:3]}, unexpected {sorted(unexpected)[:3]})")
    if tied:
        fresh.tie_weights()
    del loaded
    fresh.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
