"""Sentence pooling for a text model that gives only token embeddings: which one, and doing it.

An attnx export of a sentence-transformers model carries its own pooled ``sentence_embedding``
output. A plain ONNX file (``last_hidden_state`` only) served or embedded with a tokenizer folder
(``TextModel(path, tokenizer=DIR)``, ``attnx serve model.onnx --tokenizer DIR``) is pooled here, the way
the folder's sentence-transformers modules say: ``modules.json`` names a ``Pooling`` module whose
``config.json`` (e.g. ``1_Pooling/config.json``; ``pooling_mode``, or the older ``pooling_mode_*_token(s)``
flags) picks CLS, mean, max, mean-sqrt-len, weighted-mean or last-token pooling (several: concatenated,
as sentence-transformers does), and a ``Normalize`` module L2-normalises. A folder without them gets mean pooling (what
sentence-transformers itself does for a plain transformer), and whoever loads it hears so once.

:mod:`attnx.pretrained.folder` reads the same files for the exporter; it imports torch, which serving
never does, so the few lines of reading are repeated here.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from attnx.contract import BATCH, ContractError, Role, contained
from attnx.runtime.core.session import Session, TensorSpec

#: sentence-transformers' pooling modes (``pooling_mode`` in its Pooling config), and the older flag keys.
MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")
LEGACY_KEYS = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max", "pooling_mode_mean_tokens": "mean",
               "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
               "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}
#: attnx's own spelling (attnx.pretrained.folder, an export's ``config.sentence_transformers.pooling``).
ALIASES = {"mean_sqrt_len": "mean_sqrt_len_tokens"}


@dataclass(frozen=True)
class Pooling:
    """How token embeddings become one sentence embedding (:func:`pool_batch`): ``modes`` (several are
    concatenated), then optional L2 normalisation; ``source`` says who said so."""

    modes: tuple[str, ...] = ("mean",)
    normalize: bool = False
    source: str = "no pooling config"

    def describe(self) -> str:
        return f"{'+'.join(self.modes)} pooling{', normalized' if self.normalize else ''} ({self.source})"


#: What a folder without sentence-transformers modules gets (what sentence-transformers does for a transformer).
DEFAULT = Pooling()


def read_pooling(folder: str | os.PathLike | None) -> Pooling | None:
    """The pooling a sentence-transformers folder declares (``modules.json``); None when it declares none.

    Module paths are file contents: each must stay inside ``folder``. Anything unreadable or unknown is
    one :class:`~attnx.contract.ContractError` naming the file."""
    if folder is None:
        return None
    root = Path(folder)
    root = root if root.is_dir() else root.parent
    modules_path = root / "modules.json"
    if not modules_path.is_file():
        return None
    modules = _json(modules_path)
    if not isinstance(modules, list):
        raise ContractError(f"{modules_path}: expected a list of modules")
    mode, normalize = None, False
    for module in modules:
        kind = str(module.get("type", "")).rsplit(".", 1)[-1] if isinstance(module, dict) else ""
        if kind == "Pooling":
            config = contained(root, str(module.get("path", "")), "the pooling module") / "config.json"
            mode = _mode(config)
        elif kind == "Normalize":
            normalize = True
        elif kind != "Transformer":  # a Dense or other layer after pooling: its output is not ours to give
            raise ContractError(f"{modules_path}: module {module.get('type') if isinstance(module, dict) else module!r} "
                                "is not one attnx applies (it pools and normalises only)")
    if mode is None:
        return None
    return Pooling(mode, normalize, f"{root / 'modules.json'}")


def _mode(path: Path) -> tuple[str, ...]:
    if not path.is_file():
        raise ContractError(f"{path}: the pooling module's config.json is missing")
    config = _json(path)
    if not isinstance(config, dict):
        raise ContractError(f"{path}: expected a JSON object")
    found = config.get("pooling_mode")
    if found is None:  # sentence-transformers before 5: one boolean key per mode
        unknown = [k for k, v in config.items() if k.startswith("pooling_mode_") and v and k not in LEGACY_KEYS]
        if unknown:
            raise ContractError(f"{path}: pooling {', '.join(unknown)} is not supported (attnx pools with "
                                f"{', '.join(MODES)})")
        found = [mode for key, mode in LEGACY_KEYS.items() if config.get(key)]
    modes = [found] if isinstance(found, str) else list(found) if isinstance(found, list) else None
    modes = [ALIASES.get(m, m) for m in modes or ()]
    if not modes or not all(isinstance(m, str) and m in MODES for m in modes):
        raise ContractError(f"{path}: pooling mode {found!r} is not supported (attnx pools with {', '.join(MODES)})")
    return tuple(modes)


def _json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ContractError(f"{path}: not valid JSON ({e})") from None


# --------------------------------------------------------------------------------------
# A model without a sentence_embedding output, given one
# --------------------------------------------------------------------------------------

#: The pooled output, and the token embeddings it is pooled from (sentence-transformers' and attnx's names).
OUTPUT = "sentence_embedding"
HIDDEN = "last_hidden_state"


def pool_batch(hidden: np.ndarray, mask: np.ndarray | None, pooling: Pooling) -> np.ndarray:
    """``[batch, seq, d]`` token embeddings of a right-padded batch -> ``[batch, d * modes]``, padded positions
    (mask 0) left out, as sentence-transformers' Pooling computes each mode."""
    hidden = np.asarray(hidden, dtype=np.float32)
    keep = np.ones(hidden.shape[:2], np.float32) if mask is None else (np.asarray(mask) > 0).astype(np.float32)
    lengths = np.maximum(keep.sum(axis=1, keepdims=True), 1.0)
    parts = []
    for mode in pooling.modes:
        if mode == "cls":
            parts.append(hidden[:, 0])
        elif mode == "lasttoken":
            parts.append(hidden[np.arange(hidden.shape[0]), lengths[:, 0].astype(np.int64) - 1])
        elif mode == "max":
            parts.append(np.where(keep[..., None] > 0, hidden, -np.inf).max(axis=1))
        elif mode == "weightedmean":  # position weights 1, 2, ... over each text's tokens
            weights = keep * np.arange(1, hidden.shape[1] + 1, dtype=np.float32)
            parts.append((hidden * weights[..., None]).sum(axis=1) / np.maximum(weights.sum(1, keepdims=True), 1e-9))
        else:
            summed = (hidden * keep[..., None]).sum(axis=1)
            parts.append(summed / (np.sqrt(lengths) if mode == "mean_sqrt_len_tokens" else lengths))
    out = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)
    if pooling.normalize:
        out = out / np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)
    return out.astype(np.float32, copy=False)


def export_pooling(info) -> Pooling | None:
    """The pooling an attnx export's metadata records for its source (``config.sentence_transformers``)."""
    recorded = (info.config or {}).get("sentence_transformers") if info is not None else None
    st = recorded if isinstance(recorded, dict) else {}
    named = st.get("pooling")
    mode = ALIASES.get(named, named) if isinstance(named, str) else None  # not a string: no pooling stated
    if mode in MODES:
        return Pooling((mode,), bool(st.get("normalize")), "the export's metadata")
    return None


def with_pooling(session, folder: str | os.PathLike | None, on_note=None):
    """``session`` itself when it has a ``sentence_embedding`` output (or no ``last_hidden_state`` to pool),
    else a :class:`PooledSession` that adds one, pooled as the export's metadata or ``folder``'s
    sentence-transformers modules say; failing both, mean pooling, which ``on_note`` hears about once."""
    names = session.output_names
    if OUTPUT in names or HIDDEN not in names:
        return session
    hidden = session.output(HIDDEN)
    if hidden.rank != 3 or hidden.batch_axis != 0 or hidden.seq_axis != 1:
        return session  # not [batch, seq, d]: nothing a sentence pooling can read
    try:
        pooling = export_pooling(session.info) or read_pooling(folder)
    except ContractError as e:  # the token embeddings still serve; a sentence embedding would be wrong
        if on_note is not None:
            on_note(f"{session.path.name}: no {OUTPUT!r} output: {e}")
        return session
    if pooling is None:
        pooling = DEFAULT
        if on_note is not None:
            where = f"{folder} has no sentence-transformers modules.json" if folder else "no pooling is recorded"
            on_note(f"{session.path.name} gives no {OUTPUT!r} output and {where}: its {OUTPUT!r} is the mean of "
                    f"{HIDDEN!r} over each text's tokens (put modules.json and 1_Pooling/config.json in the "
                    "tokenizer folder to pool otherwise)")
    return PooledSession(session, pooling)


class PooledSession(Session):
    """A session plus a ``sentence_embedding [batch, d]`` output pooled from its ``last_hidden_state``
    with the batch's own attention mask (so a padded batch pools each text over its own tokens)."""

    def __init__(self, inner: Session, pooling: Pooling):
        self.inner, self.pooling = inner, pooling
        self.path, self.metadata = inner.path, inner.metadata
        self.provider, self.platform = inner.provider, inner.platform
        self.axis_decisions = inner.axis_decisions
        self.inputs = inner.inputs
        d = inner.output(HIDDEN).shape[2]
        d = d * len(pooling.modes) if isinstance(d, int) else d
        self.outputs = [*inner.outputs, TensorSpec(OUTPUT, np.dtype(np.float32), (BATCH, d), Role.OUTPUT)]

    @property
    def profiles(self):
        return self.inner.profiles

    def _run(self, feeds, output_names):
        wanted = [n for n in output_names if n != OUTPUT]
        run = wanted + ([HIDDEN] if OUTPUT in output_names and HIDDEN not in wanted else [])
        out = self.inner._run(feeds, run)
        if OUTPUT in output_names:
            mask = feeds.get(self.mask_input.name) if self.mask_input is not None else None
            out[OUTPUT] = pool_batch(out[HIDDEN], mask, self.pooling)
        return {n: out[n] for n in output_names}

    def close(self) -> None:
        self.inner.close()
