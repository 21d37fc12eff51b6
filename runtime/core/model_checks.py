"""Load-time checks: what a file's metadata and tokenizer promise, held against the model itself.

Metadata is file content, and a file can be changed after export. A tokenizer ``max_length`` beyond
the model's position table, a ``pad_id`` outside its vocabulary or an id ``range`` wider than the
embedding table it indexes would otherwise pass every request check and surface as an ONNX Runtime
error inside some request (or in every padded batch). Each is refused here, when the model loads,
with one line naming the file and the value (:class:`~attnx.contract.ContractError`).
"""

from __future__ import annotations

import json
from pathlib import Path

from attnx.contract import SEQ, ContractError, ModelInfo, Role, read_profiles
from attnx.runtime.core.session import ID_ROLES, Session, TensorSpec

#: Config keys holding a model's position-table size (most families; GPT-2 names it n_positions).
POSITION_KEYS = ("max_position_embeddings", "n_positions", "n_ctx")


def check_metadata(session: Session) -> None:
    """The ``attnx.*`` metadata of a loaded file parses, its profiles are valid, and each id input's
    declared range fits the embedding table the graph indexes with it."""
    info = ModelInfo.from_props(session.metadata)  # raises ContractError for broken JSON or entries
    if info is None:
        return
    read_profiles(session.metadata)
    declared = {s.name: s.range for s in session.inputs if s.role in ID_ROLES and s.range is not None}
    if declared and str(session.path).lower().endswith(".onnx"):
        from attnx.runtime.core.axes import infer_id_ranges

        for name, (low, high) in infer_id_ranges(session.path, list(declared)).items():
            if declared[name][0] < low or declared[name][1] > high:
                raise ContractError(f"{session.path.name}: its metadata gives {name!r} the range "
                                    f"{list(declared[name])}, but the table it indexes has {high} rows (the "
                                    "file's metadata was changed; re-export it)")


def position_limit(session: Session, tokenizer_folder: str | Path | None = None) -> int | None:
    """The longest sequence the model can take: its position table (the export's recorded config, or a
    Hugging Face ``config.json`` beside the tokenizer), within an engine's seq profile; None: unknown."""
    limits = []
    info = session.info
    hf = (info.config or {}).get("hf_config") if info is not None else None
    if not isinstance(hf, dict) and tokenizer_folder is not None:
        hf = _json_object(Path(tokenizer_folder) / "config.json")
    for key in POSITION_KEYS:
        value = (hf or {}).get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            limits.append(value)
            break
    if session.platform == "tensorrt_plan":  # an engine cannot run past its profile
        seq = (session.profiles or {}).get(SEQ)
        if isinstance(seq, list) and seq and isinstance(seq[-1], int):
            limits.append(seq[-1])
    return min(limits) if limits else None


def check_pad_id(spec: TensorSpec, pad_id: int, where: str) -> None:
    """A pad id must be a token the model has: padded batches feed it to the embedding table."""
    low, high = spec.range if spec.range is not None else (0, None)
    if pad_id < low or (high is not None and pad_id >= high):
        bounds = f"[{low}, {high})" if high is not None else f">= {low}"
        raise ContractError(f"{where}: pad id {pad_id} is outside the model's token ids {bounds} (the metadata "
                            "or tokenizer was changed; re-export it or fix the tokenizer folder)")


def check_text_model(session: Session, tokenizer, folder: str | Path | None = None) -> None:
    """A tokenizer fits the model it feeds: its pad id is in the vocabulary and its max length within the
    position table. A tokenizer that states no max length is given the model's (else long texts fail)."""
    ids = next((s for s in session.inputs if s.role == Role.INPUT_IDS), None)
    if ids is None:
        return
    name = session.path.name
    high = ids.range[1] if ids.range is not None else tokenizer.vocab_size
    check_pad_id(TensorSpec(ids.name, ids.dtype, ids.shape, ids.role, (0, high)), tokenizer.pad_id, name)
    limit = position_limit(session, folder if folder is not None else tokenizer.file.parent)
    if limit is None:
        return
    if tokenizer.max_length is None:
        tokenizer.limit(limit)
    elif tokenizer.max_length > limit:
        raise ContractError(f"{name}: the tokenizer's max length {tokenizer.max_length} is beyond the model's "
                            f"{limit} positions, so longer texts could not run (the metadata or tokenizer was "
                            "changed; re-export it, or fix the tokenizer folder)")


def _json_object(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # a config we cannot read states no limit; the tokenizer's own checks still apply
    return data if isinstance(data, dict) else None
