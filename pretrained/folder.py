"""Read a local Hugging Face model folder, offline and safely.

What a folder may hold, and what attnx reads of it:

- ``config.json`` (through ``transformers.AutoConfig`` with ``local_files_only``, so every field a
  user's transformers would default is defaulted the same way);
- weights: ``model.safetensors`` (or a sharded ``model.safetensors.index.json``), else
  ``pytorch_model.bin`` loaded with ``torch.load(weights_only=True)`` (no pickled code runs);
- the tokenizer files (``tokenizer.json`` and friends), which travel beside an export;
- for sentence-transformers folders: ``modules.json``, the pooling module's ``config.json``
  (e.g. ``1_Pooling/config.json``), a ``Normalize`` module, ``sentence_bert_config.json``
  (``max_seq_length``: sentence-transformers truncates there, not at the tokenizer's own limit).

Every problem is one ``ValueError``/``FileNotFoundError`` naming the file, key and expected shape.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

#: model_type -> the host that runs it (attnx.pretrained.<host>).
SUPPORTED_MODEL_TYPES = ("bert", "gpt2")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt",
                   "vocab.json", "merges.txt")
POOLING_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
                 "pooling_mode_max_tokens": "max", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len"}


@dataclass
class SentenceTransformerInfo:
    """What a sentence-transformers folder adds on top of the transformer: pooling and normalisation."""

    pooling: str  # cls | mean | max | mean_sqrt_len
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

    @property
    def model_type(self) -> str:
        return str(self.config.get("model_type"))

    @property
    def name(self) -> str:
        """A short name for output files: the folder's own, the repo name of a Hugging Face cache
        snapshot (``models--org--name/snapshots/<hash>``), or the README's title for a folder named
        generically (``model``, as packaged copies are)."""
        path = self.path.resolve()
        if len(path.name) == 40 and all(c in "0123456789abcdef" for c in path.name):
            repo = path.parent.parent.name
            if repo.startswith("models--"):
                return repo.split("--")[-1]
        if path.name.lower() in ("model", "models", "weights", "checkpoint") and (path / "README.md").is_file():
            for line in (path / "README.md").read_text(errors="replace").splitlines():
                title = line[2:].strip() if line.startswith("# ") else ""
                if title and all(c.isalnum() or c in "-_." for c in title):
                    return title
        return path.name

    def state_dict(self) -> dict[str, torch.Tensor]:
        return read_weights(self.path)


def read_folder(path: str | os.PathLike) -> HFFolder:
    """Read ``config.json``, the tokenizer file list and the sentence-transformers modules of ``path``."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(f"no model folder at {folder}")
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder}: no config.json (expected a Hugging Face model folder)")
    try:
        raw = json.loads((folder / "config.json").read_text())
    except ValueError as e:
        raise ValueError(f"{folder / 'config.json'}: not valid JSON ({e})") from None
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"{folder / 'config.json'}: model_type {model_type!r} is not supported; attnx loads "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)} (BERT-family encoders and GPT-2)")
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(folder), local_files_only=True).to_dict()
    except Exception as e:  # transformers raises many types; one line is what the user needs
        raise ValueError(f"{folder / 'config.json'}: transformers cannot read it ({type(e).__name__}: "
                         f"{str(e).splitlines()[0][:160]})") from None
    config["model_type"] = model_type
    tokenizer_files = [folder / n for n in TOKENIZER_FILES if (folder / n).is_file()]
    return HFFolder(folder, config, _sentence_transformer(folder), tokenizer_files)


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
            pooling = _pooling_mode(folder / module.get("path", "") / "config.json")
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


def _pooling_mode(path: Path) -> str:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: the pooling module's config.json is missing")
    try:
        cfg = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    on = [mode for key, mode in POOLING_MODES.items() if cfg.get(key)]
    unknown = [k for k, v in cfg.items() if k.startswith("pooling_mode") and v and k not in POOLING_MODES]
    if unknown or len(on) != 1:
        raise ValueError(f"{path}: pooling mode {', '.join(unknown or on) or 'none'} is not supported; attnx pools "
                         f"with exactly one of {', '.join(POOLING_MODES.values())}")
    return on[0]


# --------------------------------------------------------------------------- weights

def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of the folder's checkpoint (safetensors preferred; .bin without running pickled code)."""
    from safetensors.torch import load_file

    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    try:
        if single.is_file():
            return load_file(str(single))
        if index.is_file():  # sharded
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            tensors: dict[str, torch.Tensor] = {}
            for shard in shards:
                if not (folder / shard).is_file():
                    raise FileNotFoundError(f"{folder}: shard {shard} listed in {index.name} is missing")
                tensors.update(load_file(str(folder / shard)))
            return tensors
        binary = folder / "pytorch_model.bin"
        if binary.is_file():
            state = torch.load(str(binary), map_location="cpu", weights_only=True)
            return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    except (OSError, RuntimeError, ValueError, KeyError) as e:
        if isinstance(e, FileNotFoundError):
            raise
        raise ValueError(f"{folder}: cannot read the checkpoint ({type(e).__name__}: {str(e).splitlines()[0][:160]})") \
            from None
    found = ", ".join(sorted(p.name for p in folder.iterdir())) or "nothing"
    raise FileNotFoundError(f"{folder}: no model.safetensors or pytorch_model.bin (found: {found})")


class Weights:
    """Checkpoint tensors taken by name and expected shape, with one clear error per problem;
    :meth:`leftover` lists what was never taken."""

    def __init__(self, tensors: dict[str, torch.Tensor], source: Path, prefixes: tuple[str, ...] = ()):
        self.source = source
        self.tensors = {}
        for name, value in tensors.items():
            for prefix in prefixes:  # e.g. "bert." of a task-model checkpoint
                if name.startswith(prefix):
                    name = name[len(prefix):]
                    break
            self.tensors[name] = value
        self.taken: set[str] = set()

    def take(self, name: str, shape: tuple[int, ...], *alternatives: str) -> torch.Tensor:
        for candidate in (name, *alternatives):
            if candidate in self.tensors:
                value = self.tensors[candidate]
                if tuple(value.shape) != tuple(shape):
                    raise ValueError(f"{self.source}: weight {candidate} has shape {list(value.shape)}, expected "
                                     f"{list(shape)} (from config.json)")
                self.taken.add(candidate)
                return value.to(torch.float32)
        raise ValueError(f"{self.source}: missing weight {name} (expected shape {list(shape)}); the checkpoint has "
                         f"e.g. {', '.join(sorted(self.tensors)[:5])}")

    def skip(self, *names: str) -> None:
        self.taken.update(n for n in names if n in self.tensors)

    def leftover(self) -> list[str]:
        return sorted(set(self.tensors) - self.taken)


def config_int(config: dict[str, Any], key: str, source) -> int:
    value = config.get(key)
    if not isinstance(value, int) or value <= 0:
        raise ValueError(f"{source}: config {key} must be a positive integer, got {value!r}")
    return value
