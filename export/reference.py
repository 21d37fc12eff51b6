"""The PyTorch reference of an export: the model rebuilt from its ``attnx.config`` and the weights
file beside it (what ``attnx check`` compares every runtime with). A pretrained export that records
``attnx.reference`` takes its pretrained weights from that source folder (checked against the recorded
sizes and sha256) and only the placed variant's from the file beside it."""

from __future__ import annotations

import os
from pathlib import Path

from torch import nn

from attnx.contract import ContractError, ModelInfo, contained


def model_from_config(config: dict) -> nn.Module:
    """An untrained model of the architecture ``config`` describes (attnx encoders, pretrained hosts,
    and the attention-output wrapper around either)."""
    if config.get("kind") == "pretrained":
        from attnx.pretrained.host import Host
        from attnx.pretrained.legacy import host_from_legacy, is_legacy

        if config.get("with_past"):  # a decoder exported with its KV cache (attnx.export.with_past)
            from attnx.pretrained.cached import CachedHost

            model = CachedHost.from_config(config)
        else:
            model = host_from_legacy(config) if is_legacy(config) else Host.from_config(config)
    else:
        from attnx.models.build import encoder_from_config

        model = encoder_from_config(config, seed=None)
    if config.get("attention_outputs") or config.get("head_mask"):
        from attnx.export.attention_outputs import WithAttentionOutputs

        model = WithAttentionOutputs(model, list(config.get("attention_outputs") or []), bool(config.get("head_mask")))
    return model.eval()


def load_reference(path: str | os.PathLike, source: str | os.PathLike | None = None) -> tuple[nn.Module, ModelInfo]:
    """``(model with the export's weights, its metadata)``; one clear error when it cannot be rebuilt.
    ``source``: the folder a pretrained export was made from, where it is not at the recorded path."""
    from attnx.models.checkpoint import load_checkpoint

    path = Path(path)
    info = ModelInfo.read(path)
    if info is None:
        raise ContractError(f"{path} has no attnx metadata (not an `attnx export` file): the PyTorch reference "
                            "cannot be rebuilt")
    if not info.weights:
        raise ContractError(f"{path} names no weights file (attnx.weights): re-export it with `attnx export`")
    weights = contained(path.parent, info.weights, "the weights file named by attnx.weights")
    if not weights.is_file():
        raise ContractError(f"the reference weights {weights} named by {path.name} are missing (they are written "
                            "beside the file by `attnx export`)")
    if info.reference:
        return _from_source(path, info, weights, source), info
    try:
        model = model_from_config(info.config)
    except (KeyError, TypeError, ValueError) as e:
        raise ContractError(f"{path}: cannot rebuild the model from its attnx.config ({e})") from None
    target = getattr(model, "model", model)
    from attnx.pretrained.legacy import is_legacy, load_legacy

    if is_legacy(info.config):
        from safetensors.torch import load_file

        try:
            load_legacy(target, load_file(str(weights)), info.config["host"])
        except (KeyError, ValueError) as e:
            raise ContractError(f"{path}: cannot rebuild its attnx 0.1 reference ({e})") from None
    else:
        load_checkpoint(target, weights)
    return model.eval(), info


def check_source(folder: Path, reference: dict, export: Path, given: bool = False) -> None:
    """The source folder's weight files are the ones the export recorded (names, sizes, sha256). ``given``: the
    folder came from ``--original`` (the error then says that folder is not the export's model)."""
    import hashlib

    for entry in reference.get("files") or []:
        f = folder / str(entry["name"])
        if Path(entry["name"]).name != entry["name"] or not f.is_file():
            raise ContractError(f"{export.name}: its reference weights come from {folder}, which has no "
                                f"{entry['name']} any more: pass the folder it was exported from (--original) or "
                                "re-export")
        same = f.stat().st_size == int(entry["bytes"])
        if same:
            h = hashlib.sha256()
            with open(f, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 22), b""):
                    h.update(chunk)
            same = h.hexdigest() == entry["sha256"]
        if not same and given:
            raise ContractError(f"{export.name}: --original {folder} is not the model this export was made from "
                                f"({entry['name']} differs from the one recorded at export: its sha256)")
        if not same:
            raise ContractError(f"{export.name}: {f} changed since the export (its sha256 differs), so it is not the "
                                "model that was exported: pass the folder it was exported from (--original), or "
                                "re-export")


def _from_source(path: Path, info: ModelInfo, weights: Path, source) -> nn.Module:
    """A pretrained export's reference: the source folder's model, the variant placed as recorded, the
    weights file's tensors (the variant's) on top."""
    from attnx import pretrained
    from attnx.models.checkpoint import read_checkpoint
    from attnx.pretrained.folder import SentenceTransformerInfo
    from attnx.pretrained.placing import Placement, place

    config = info.config
    folder = Path(source or info.reference.get("source") or "")
    if not folder.is_dir():
        raise ContractError(f"{path.name}: its reference weights come from the folder it was exported from, "
                            f"{folder}, which is not there: pass that folder (attnx check --original DIR), or "
                            "re-export with --copy-weights")
    check_source(folder, info.reference, path, given=source is not None)
    try:
        hf = pretrained.load_model(pretrained.read_folder(folder), config["task"])
        if type(hf).__name__ != config["architecture"]:
            raise ValueError(f"{folder} holds a {type(hf).__name__}, the export a {config['architecture']}")
        place(hf, Placement.from_dict(config.get("placement")))
        st = config.get("sentence_transformers")
        if config.get("with_past"):
            from attnx.pretrained.cached import CachedHost as cls
        else:
            from attnx.pretrained.host import Host as cls
        host = cls(hf, config["task"], SentenceTransformerInfo(**st) if st else None, config.get("source"),
                   config.get("max_length"))
        own = sorted(set(host.state_dict()) - host.pretrained_names)
        host.load_state_dict(read_checkpoint(host, weights, required=own, what="export's placement"), strict=False)
    except (KeyError, TypeError, ValueError, FileNotFoundError) as e:
        where = f"--original {folder}" if source else str(folder)
        raise ContractError(f"{path}: cannot rebuild its reference from {where} ({e})") from None
    model = host
    if config.get("attention_outputs") or config.get("head_mask"):
        from attnx.export.attention_outputs import WithAttentionOutputs

        model = WithAttentionOutputs(host, list(config.get("attention_outputs") or []), bool(config.get("head_mask")))
    return model.eval()
