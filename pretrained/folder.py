"""Read a local Hugging Face model folder, offline and safely (a stranger's folder runs no code and
reads nothing outside itself).

What a folder may hold, and what attnx reads of it:

- a ``.gguf`` file instead (or a folder holding one): read as a weightless folder of its config and tokenizer,
  the weights read from the file tensor by tensor (:mod:`attnx.pretrained.gguf`);
- ``config.json``: its numbers are checked against sane limits first (:mod:`attnx.pretrained.limits`: one line
  each, before anything is built), then read through ``transformers.AutoConfig`` (``local_files_only``, never
  remote code: an ``auto_map`` is ignored, and :attr:`HFFolder.notes` says so);
- weights: ``model.safetensors``, a sharded ``model.safetensors.index.json`` (every shard a file of
  the folder itself), or ``pytorch_model.bin`` (loaded with ``weights_only``: no pickled code runs);
  every weight must be a float tensor (an int8 or bool one is refused, not silently cast);
- the tokenizer files (``tokenizer.json`` and friends), which travel beside an export;
- for sentence-transformers folders: ``modules.json``, the pooling module's ``config.json``
  (e.g. ``1_Pooling/config.json``), a ``Normalize`` module, ``sentence_bert_config.json``
  (``max_seq_length``: sentence-transformers truncates there, not at the tokenizer's own limit).

A file that is a link leaving the folder is refused (a Hugging Face cache snapshot's links into its
own ``blobs/`` are the one exception). Every problem is one ``ValueError``/``FileNotFoundError``
naming the file, key and expected value.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attnx.pretrained.limits import check_limits

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt",
                   "vocab.json", "merges.txt", "tokenizer.model", "sentencepiece.bpe.model", "spiece.model",
                   "added_tokens.json", "chat_template.jinja")
POOLING_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
                 "pooling_mode_max_tokens": "max", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
                 "pooling_mode_lasttoken": "lasttoken"}
#: Integer tensors a checkpoint may hold (index buffers), by name ending.
_INTEGER_OK = ("position_ids", "token_type_ids", "_ids")
_NO_LIMIT = 1_000_000  # transformers' "no limit" placeholder for model_max_length is far above this


@dataclass
class SentenceTransformerInfo:
    """What a sentence-transformers folder adds on top of the transformer: pooling and normalisation."""

    pooling: str  # cls | mean | max | mean_sqrt_len | lasttoken
    normalize: bool
    max_seq_length: int | None

    def to_dict(self) -> dict:
        return {"pooling": self.pooling, "normalize": self.normalize, "max_seq_length": self.max_seq_length}


@dataclass
class HFFolder:
    path: Path
    config: dict  # config.json with transformers' defaults filled in
    sentence_transformer: SentenceTransformerInfo | None = None
    tokenizer_files: list[Path] = field(default_factory=list)
    weights: list[Path] = field(default_factory=list)  # the checkpoint files, checked to be inside the folder
    notes: list[str] = field(default_factory=list)  # one line each, for the user (e.g. auto_map ignored)

    @property
    def model_type(self) -> str:
        return str(self.config.get("model_type"))

    @property
    def architectures(self) -> list[str]:
        return list(self.config.get("architectures") or [])

    @property
    def placement(self) -> dict | None:
        """The placement recorded by ``save_pretrained`` of a placed model (None for a plain folder)."""
        attnx = self.config.get("attnx")
        return attnx.get("placement") if isinstance(attnx, dict) else None

    @property
    def max_length(self) -> int | None:
        """The longest input to tokenise: sentence-transformers' ``max_seq_length``, else the tokenizer's
        ``model_max_length`` (None: the model's positions decide)."""
        if self.sentence_transformer is not None and self.sentence_transformer.max_seq_length:
            return self.sentence_transformer.max_seq_length
        cfg = self.path / "tokenizer_config.json"
        if cfg.is_file():
            value = _json(cfg).get("model_max_length")
            if isinstance(value, (int, float)) and 0 < value < _NO_LIMIT:
                return int(value)
        return None

    @property
    def name(self) -> str:
        """A short name for output files: the folder's own, the repo name of a Hugging Face cache
        snapshot (``models--org--name/snapshots/<hash>``), or the README's title for a folder named
        generically (``model``, as packaged copies are)."""
        path = self.path.resolve()
        if _is_snapshot(path):
            return path.parent.parent.name.split("--")[-1]
        if path.name.lower() in ("model", "models", "weights", "checkpoint") and (path / "README.md").is_file():
            for line in (path / "README.md").read_text(errors="replace").splitlines():
                title = line[2:].strip() if line.startswith("# ") else ""
                if title and all(c.isalnum() or c in "-_." for c in title):
                    return title
        return path.name


def read_folder(path: str | os.PathLike) -> HFFolder:
    """Read and check ``path`` (see the module doc); nothing is built or loaded yet. A ``.gguf`` file (or a
    folder holding one) is read as its weightless folder (:mod:`attnx.pretrained.gguf`)."""
    from attnx.pretrained.gguf import as_folder, gguf_source

    gguf = gguf_source(path)
    folder = as_folder(gguf) if gguf is not None else Path(path).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(f"no model folder at {folder}")
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{folder}: no config.json (expected a Hugging Face model folder)")
    inside(folder, config_path)
    raw = _json(config_path)
    if not isinstance(raw, dict):
        raise ValueError(f"{config_path}: expected a JSON object")
    notes = []
    model_type = raw.get("model_type")
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        remote = " (its auto_map names remote code, which attnx never runs)" if "auto_map" in raw else ""
        raise ValueError(f"{config_path}: model_type {model_type!r} is not a transformers family{remote}")
    if "auto_map" in raw:
        notes.append(f"config.json's auto_map (remote code) is ignored: attnx runs transformers' own "
                     f"{model_type} code")
    check_limits(raw, config_path)
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False).to_dict()
    except Exception as e:  # transformers raises many types; one line is what the user needs
        raise ValueError(f"{config_path}: transformers cannot read it ({type(e).__name__}: "
                         f"{str(e).splitlines()[0][:160]})") from None
    config["model_type"] = model_type
    config.pop("auto_map", None)
    tokenizer_files = [inside(folder, folder / n) for n in TOKENIZER_FILES if (folder / n).is_file()]
    return HFFolder(folder, config, _sentence_transformer(folder), tokenizer_files, weight_files(folder), notes)


def _is_snapshot(path: Path) -> bool:
    return path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--")


def inside(folder: Path, file: Path) -> Path:
    """``file`` if it is a file of ``folder`` (no link leaving it; a hub snapshot's links into its own
    ``blobs/`` allowed), else one error."""
    root = folder.resolve()
    target = file.resolve()
    allowed = [root]
    if _is_snapshot(root):
        allowed.append(root.parent.parent / "blobs")
    if not any(target == a or a in target.parents for a in allowed):
        raise ValueError(f"{file}: points outside the model folder ({target}); attnx reads only the folder's own "
                         "files")
    return file


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def _sentence_transformer(folder: Path) -> SentenceTransformerInfo | None:
    modules_path = folder / "modules.json"
    if not modules_path.is_file():
        return None
    try:
        modules = json.loads(modules_path.read_text())
    except ValueError as e:
        raise ValueError(f"{modules_path}: not valid JSON ({e})") from None
    pooling, normalize = None, False
    for module in modules:
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Transformer":
            if module.get("path", "") not in ("", "."):
                raise ValueError(f"{modules_path}: the Transformer module lives in {module['path']!r}; attnx reads "
                                 "the transformer from the folder itself")
        elif kind == "Pooling":
            pooling_config = folder / str(module.get("path", "")) / "config.json"
            if pooling_config.is_file():
                inside(folder, pooling_config)
            pooling = _pooling_mode(pooling_config)
        elif kind == "Normalize":
            normalize = True
        else:
            raise ValueError(f"{modules_path}: module type {module.get('type')!r} is not supported (attnx supports "
                             "Transformer, Pooling and Normalize)")
    if pooling is None:
        raise ValueError(f"{modules_path}: no Pooling module (a sentence-transformers folder needs one)")
    max_len = None
    st_config = folder / "sentence_bert_config.json"
    if st_config.is_file():
        try:
            max_len = json.loads(st_config.read_text()).get("max_seq_length")
        except ValueError as e:
            raise ValueError(f"{st_config}: not valid JSON ({e})") from None
    return SentenceTransformerInfo(pooling, normalize, int(max_len) if max_len else None)


#: sentence-transformers 5+ names (``"pooling_mode": "mean"``) -> attnx's pooling names.
_POOLING_NAMES = {"cls": "cls", "mean": "mean", "max": "max", "mean_sqrt_len_tokens": "mean_sqrt_len",
                  "lasttoken": "lasttoken"}


def _pooling_mode(path: Path) -> str:
    """The pooling of a sentence-transformers Pooling config: its flags (``pooling_mode_mean_tokens: true``,
    sentence-transformers < 5) or its ``pooling_mode`` name (5 and later)."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: the pooling module's config.json is missing")
    cfg = _json(path)
    supported = ", ".join(POOLING_MODES.values())
    mode = cfg.get("pooling_mode")
    if mode is not None:
        modes = [mode] if isinstance(mode, str) else list(mode) if isinstance(mode, list) else [mode]
        if len(modes) != 1 or modes[0] not in _POOLING_NAMES:
            raise ValueError(f"{path}: pooling mode {mode!r} is not supported; attnx pools with exactly one of "
                             f"{supported}")
        if cfg.get("include_prompt") is False:
            raise ValueError(f"{path}: include_prompt false (pooling that skips a prompt) is not supported")
        return _POOLING_NAMES[modes[0]]
    on = [mode for key, mode in POOLING_MODES.items() if cfg.get(key)]
    unknown = [k for k, v in cfg.items() if k.startswith("pooling_mode") and v and k not in POOLING_MODES]
    if unknown or len(on) != 1:
        raise ValueError(f"{path}: pooling mode {', '.join(unknown or on) or 'none'} is not supported; attnx pools "
                         f"with exactly one of {supported}")
    return on[0]


# --------------------------------------------------------------------------- weights

def weight_files(folder: Path) -> list[Path]:
    """The checkpoint files transformers will read, each checked to be a file of the folder."""
    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    if single.is_file():
        return [inside(folder, single)]
    if index.is_file():  # sharded
        inside(folder, index)
        weight_map = _json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index}: no weight_map")
        shards = []
        for shard in sorted(set(map(str, weight_map.values()))):
            if Path(shard).name != shard or shard in (".", ".."):
                raise ValueError(f"{index}: shard {shard!r} is not a file name of the folder; attnx reads only the "
                                 "folder's own files")
            if not (folder / shard).is_file():
                raise FileNotFoundError(f"{folder}: shard {shard} listed in {index.name} is missing")
            shards.append(inside(folder, folder / shard))
        return shards
    binary = folder / "pytorch_model.bin"
    if binary.is_file():
        return [inside(folder, binary)]
    if (folder / "attnx-gguf.json").is_file():  # a GGUF-backed folder: the weights stay in the GGUF
        return []
    found = ", ".join(sorted(p.name for p in folder.iterdir())) or "nothing"
    raise FileNotFoundError(f"{folder}: no model.safetensors or pytorch_model.bin (found: {found})")


def _weight_headers(files: list[Path]) -> dict[str, tuple[str, list[int]]]:
    """Tensor name -> (dtype, shape) of every weight, from the safetensors headers (nothing loaded) or,
    for a ``.bin``, a ``weights_only`` memory-mapped load."""
    out: dict[str, tuple[str, list[int]]] = {}
    for path in files:
        if path.suffix == ".safetensors":
            try:
                with open(path, "rb") as f:
                    (size,) = struct.unpack("<Q", f.read(8))
                    if not 0 < size <= 100 << 20:
                        raise ValueError(f"header size {size}")
                    header = json.loads(f.read(size))
            except (OSError, ValueError, struct.error) as e:
                raise ValueError(f"{path}: not a safetensors file ({type(e).__name__}: {e})") from None
            out.update({k: (str(v.get("dtype")), list(v.get("shape") or [])) for k, v in header.items()
                        if k != "__metadata__" and isinstance(v, dict)})
        else:
            import torch

            try:
                state = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
            except Exception as e:  # a pickle with code in it, a truncated file
                raise ValueError(f"{path}: cannot read it safely ({type(e).__name__}: "
                                 f"{str(e).splitlines()[0][:160]})") from None
            out.update({k: (str(v.dtype).replace("torch.", ""), list(v.shape)) for k, v in state.items()
                        if hasattr(v, "dtype")})
    return out


def weight_dtypes(files: list[Path]) -> dict[str, str]:
    """Tensor name -> dtype of every weight (:func:`_weight_headers`: nothing loaded)."""
    return {k: dtype for k, (dtype, _shape) in _weight_headers(files).items()}


def weight_numel(files: list[Path]) -> dict[str, int]:
    """Tensor name -> number of elements of every weight (nothing loaded)."""
    out = {}
    for k, (_dtype, shape) in _weight_headers(files).items():
        n = 1
        for d in shape:
            n *= int(d)
        out[k] = n
    return out


def check_weight_dtypes(files: list[Path]) -> None:
    """Every weight a float tensor; integer ones only for index buffers (``position_ids``...)."""
    for name, dtype in weight_dtypes(files).items():
        floating = dtype.upper() in ("F16", "BF16", "F32", "F64") or dtype in ("float16", "bfloat16", "float32",
                                                                                "float64")
        if not floating and not name.endswith(_INTEGER_OK):
            raise ValueError(f"weight {name} is {dtype}, expected a float tensor (quantized or corrupt checkpoints "
                             "are not supported)")


def read_tensors(files: list[Path], names) -> dict:
    """The named tensors of the checkpoint (e.g. a saved placement's variant parameters)."""
    import torch

    wanted, out = set(names), {}
    for path in files:
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as f:
                for key in wanted & set(f.keys()):
                    out[key] = f.get_tensor(key)
        else:
            state = torch.load(str(path), map_location="cpu", weights_only=True)
            out.update({k: v for k, v in state.items() if k in wanted})
    return out
