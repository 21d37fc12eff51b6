"""GGUF files in: a ``.gguf`` (llama.cpp's format, how most small LLMs ship) read as a Hugging Face folder
without weights.

    attnx export --from-pretrained SmolLM2-135M-Instruct.Q4_1.gguf --with-past
    attnx generate path/to/folder-holding-one.gguf "Once upon a time"

The folder (:func:`as_folder`, in attnx's cache: :func:`cache_root`) holds what transformers' own GGUF
loaders read from the file's metadata, no tensor dequantized: ``config.json`` (with ``architectures`` set from
the causal LM class transformers maps it to, and without the ``quantization_config`` of type gguf it keeps),
``generation_config.json``, the tokenizer files and ``chat_template.jinja``; and the marker
(:mod:`attnx.pretrained.gguf_marker`),
``{"gguf": <absolute path>, "size": <bytes>, "mtime_ns": <int>}``, naming the file the weights stay in. The
export, ``attnx check`` (transformers' reference) and ``attnx generate`` read the weights from the GGUF one
tensor at a time through :class:`attnx.pretrained.gguf_tensors.GgufSource` (what
:func:`attnx.pretrained.tensors.source_of` returns for such a folder): a few MB on disk for any model size,
where an fp32 copy took 4 bytes a parameter (517 MB for SmolLM2-135M, ~32 GB for an 8B model).

The folder is keyed on the file's content (a second run reuses it; the marker follows the file if a copy of
the same bytes is used from elsewhere) and named after the file without its quantization tag
(``SmolLM2-135M-Instruct.Q4_1.gguf`` -> ``SmolLM2-135M-Instruct``, :func:`model_name`): the name of an export
from it says what the export holds (fp32 unless ``--weights``/``--fp16`` says otherwise), not the GGUF's blocks.

A GGUF is data, not code: the ``gguf`` package reads its metadata through a memory map, tensors are read with
``pread``. Its sizes are checked against :data:`attnx.pretrained.limits.LIMITS` before any tensor is read, the
file's tensors must fill transformers' model (names and sizes, from the tensor table), and any file
transformers cannot read is one ``ValueError`` naming the file.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import numpy as np

# gguf_of re-exported: which GGUF a folder reads is asked of this module
from attnx.pretrained.gguf_marker import MARKER, gguf_of, marker_of, read_marker, write_marker  # noqa: F401
from attnx.pretrained.limits import check_limits

SUFFIX = ".gguf"
#: bytes of the file hashed per read (the cache key is its full content)
_CHUNK = 1 << 22
#: the GGUF header's magic number
_MAGIC = b"GGUF"
#: a quantization tag ending a GGUF's name, as llama.cpp and GGUF-my-repo write them: .Q4_1, -q4_k_m, .IQ4_XS,
#: -f16, .BF16, _Q8_0 ...
_QUANT_TAG = re.compile(r"[._-](?:I?Q\d(?:_[A-Z0-9]+)*|T?Q\d_\d|F16|F32|BF16|FP16|FP32)$", re.IGNORECASE)


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
    """Where GGUF-backed folders live: ``$ATTNX_CACHE``, else ``$XDG_CACHE_HOME/attnx``, else
    ``~/.cache/attnx``; then ``gguf/``."""
    base = os.environ.get("ATTNX_CACHE") or (Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "attnx")
    return Path(base).expanduser() / "gguf"


def content_key(file: Path) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()[:16]


def model_name(gguf: Path) -> str:
    """The file's name without ``.gguf`` and without a quantization tag: what the folder (and so an export's
    default name) is called."""
    stem = gguf.name[: -len(SUFFIX)] if gguf.name.lower().endswith(SUFFIX) else gguf.name
    return _QUANT_TAG.sub("", stem) or stem or "model"


def as_folder(gguf: str | os.PathLike) -> Path:
    """The weightless Hugging Face folder of ``gguf`` (see the module doc): built once per file content,
    atomically (a failure leaves nothing in the cache), then reused."""
    gguf = Path(gguf).expanduser()
    try:
        with open(gguf, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise FileNotFoundError(f"{gguf}: cannot read it ({e.strerror or e})") from None
    if magic != _MAGIC:
        raise ValueError(f"{gguf}: not a GGUF file (it does not start with the GGUF magic number)")
    name = model_name(gguf)
    keyed = cache_root() / content_key(gguf)
    out = keyed / name
    if (out / "config.json").is_file() and (out / MARKER).is_file():
        if read_marker(out) != marker_of(gguf):
            write_marker(out, gguf)  # the same bytes at another path (or touched): the weights are read there
        return out
    staging = keyed / f".{name}.{os.getpid()}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        _extract(gguf, staging)
        write_marker(staging, gguf)
        shutil.rmtree(out, ignore_errors=True)
        os.replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    for old in keyed.iterdir():  # an older attnx's fp32 folder of this file (named with its quant tag)
        if old.name != name and not old.name.startswith(".") and (old / "model.safetensors").is_file():
            shutil.rmtree(old, ignore_errors=True)
    return out


def _one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"


def _extract(gguf: Path, out: Path) -> None:
    """config.json, generation_config.json and the tokenizer (with its chat template) from the file's metadata,
    through transformers' GGUF loaders sharing one reader; the tensor table checked to fill the model."""
    import transformers

    from attnx.pretrained.gguf_tensors import GgufSource, causal_lm_class, reader_of, transformers_reading

    try:
        reader = reader_of(gguf)  # kept: the export's tensor source of this file reuses the parse
    except Exception as e:  # numpy, struct and ValueError on a broken file
        raise ValueError(f"{gguf}: transformers cannot read it as a GGUF model ({_one_line(e)})") from None
    with transformers_reading(reader):
        try:
            config = transformers.AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                             local_files_only=True)
        except Exception as e:  # the gguf reader and transformers raise many types on a broken file
            raise ValueError(f"{gguf}: transformers cannot read it as a GGUF model ({_one_line(e)})") from None
        check_limits(config.to_dict(), gguf)  # before anything is built from it
        cls = causal_lm_class(config, gguf)
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                                   local_files_only=True)
        except Exception as e:  # as above: one line, never a traceback
            raise ValueError(f"{gguf}: transformers cannot read its tokenizer ({_one_line(e)})") from None
    config.architectures = [cls.__name__]
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the export reads float tensors from it, not a quantized model
    config.dtype = "float32"  # what transformers' loader gives (every GGUF tensor dequantized to float32)
    with GgufSource(gguf, config=config, reader=reader) as source:
        _check_fills(source, config, cls, gguf)
    config.save_pretrained(str(out))
    transformers.GenerationConfig.from_model_config(config).save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))


def _check_fills(source, config, cls, gguf: Path) -> None:
    """Every weight of transformers' model is a tensor of the file (a tied head excepted)."""
    import torch

    with torch.device("meta"):
        wanted = set(cls(config).state_dict())
    missing = sorted(k for k in wanted - set(source.infos())
                     if not (config.tie_word_embeddings and k.endswith("lm_head.weight")))
    if missing:
        raise ValueError(f"{gguf}: its tensors do not fill transformers' {cls.__name__} (missing {missing[:3]}"
                         f"{' and %d more' % (len(missing) - 3) if len(missing) > 3 else ''})")


def fp32_folder(gguf: str | os.PathLike, out: str | os.PathLike) -> Path:
    """A plain fp32 Hugging Face folder of ``gguf`` at ``out`` (the GGUF-backed folder's files plus a
    ``model.safetensors`` written tensor by tensor), for tools that read only Hugging Face folders (the
    benchmarks' peers: onnxruntime-genai's builder, CTranslate2, transformers). attnx itself never needs one.
    Reused when ``out`` already holds it."""
    import torch

    from attnx.pretrained.gguf_tensors import GgufSource

    out = Path(out)
    if (out / "model.safetensors").is_file() and (out / "config.json").is_file():
        return out
    folder = as_folder(gguf)
    staging = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        for file in folder.iterdir():
            if file.name != MARKER:
                shutil.copy(file, staging / file.name)
        with GgufSource.for_folder(folder) as source:
            infos = source.infos()
            header, offset = {}, 0
            for name, info in infos.items():
                size = 4 * int(np.prod(info.shape, dtype=np.int64))
                header[name] = {"dtype": "F32", "shape": list(info.shape), "data_offsets": [offset, offset + size]}
                offset += size
            blob = json.dumps(header, separators=(",", ":")).encode()
            blob += b" " * (-len(blob) % 8)
            with open(staging / "model.safetensors", "wb") as f:
                f.write(len(blob).to_bytes(8, "little") + blob)
                for name in infos:  # in the header's order, one tensor in memory at a time
                    f.write(np.ascontiguousarray(source.read(name).to(torch.float32).numpy()).data)
        shutil.rmtree(out, ignore_errors=True)
        os.replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out
