"""The PyTorch reference of an export: the model rebuilt from its ``attnx.config`` and the weights
file beside it (what ``attnx check`` compares every runtime with)."""

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


def load_reference(path: str | os.PathLike) -> tuple[nn.Module, ModelInfo]:
    """``(model with the export's weights, its metadata)``; one clear error when it cannot be rebuilt."""
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
