"""The largest sizes attnx accepts in a model's config (:data:`LIMITS`), checked before anything is built from it.

A leaf of :mod:`attnx.pretrained`: a Hugging Face folder's ``config.json`` (:mod:`attnx.pretrained.folder`) and a
GGUF's metadata (:mod:`attnx.pretrained.gguf`, :mod:`attnx.pretrained.gguf_tensors`) are held to the same limits.
"""

from __future__ import annotations

from pathlib import Path

#: config.json keys (any of a family's names for them) and the largest value attnx accepts.
LIMITS = {("num_hidden_layers", "n_layer", "n_layers", "num_layers"): 1024,
          ("hidden_size", "n_embd", "d_model", "dim"): 65536,
          ("num_attention_heads", "n_head", "n_heads"): 1024,
          ("num_key_value_heads",): 1024,
          ("intermediate_size", "n_inner", "hidden_dim", "ffn_dim"): 1 << 20,
          ("vocab_size",): 1 << 23,
          ("max_position_embeddings", "n_positions"): 1 << 24,
          ("head_dim",): 4096}


def check_limits(raw: dict, where: Path) -> None:
    """Every size in config.json a positive integer under attnx's limit (one line naming the key)."""
    for keys, limit in LIMITS.items():
        for key in keys:
            if key not in raw or raw[key] is None:
                continue
            value = raw[key]
            if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= limit:
                raise ValueError(f"{where}: {key} must be an integer in [1, {limit}], got {value!r}")
    for key in ("text_config",):  # composite configs nest the text model's sizes
        if isinstance(raw.get(key), dict):
            check_limits(raw[key], where)
