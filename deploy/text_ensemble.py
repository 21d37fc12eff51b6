"""Text in, model outputs out, on Triton: the configs of a tokenizer model and the ensemble around it.

For an export that carries a tokenizer, ``attnx triton-repo`` writes three models:

- ``<name>_model``: the ONNX Runtime or TensorRT model itself (token ids in), with dynamic batching;
- ``<name>_tokenizer``: a Python-backend model (:mod:`attnx.deploy.tokenizer_model`, shipped as its
  ``model.py``) that turns the ``text`` input (``TYPE_STRING``) into the model's id inputs, with the
  export's maximum length, truncation side and pad id, padding each request to a length bucket;
- ``<name>``: the ensemble clients call: ``text`` (plus any context input the variant declares,
  passed through) in, the model's outputs out, and ``attention_mask`` as well when an output is
  per token, so a client can drop the padded positions.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version as package_version
from typing import Any, Mapping

from attnx.contract import SEQ, Role
from attnx.deploy.triton import ConfigError, Enum, check_model_name
from attnx.runtime.core.text import TEXT_INPUT  # the name `attnx serve` gives its text input too
from attnx.runtime.core.session import TensorSpec
#: The inputs the tokenizer makes, by role (the names are the model's own).
ID_ROLES = (Role.INPUT_IDS, Role.ATTENTION_MASK, Role.TOKEN_TYPE_IDS)
#: Where the tokenizer files go inside the tokenizer model's version folder.
TOKENIZER_FOLDER = "tokenizer"


@dataclass(frozen=True)
class TextNames:
    """The three model names of a text ensemble called ``name``."""

    ensemble: str
    tokenizer: str
    model: str

    @classmethod
    def of(cls, name: str) -> "TextNames":
        return cls(check_model_name(name), check_model_name(f"{name}_tokenizer"), check_model_name(f"{name}_model"))


@dataclass(frozen=True)
class Tokenization:
    """How the tokenizer model tokenises (from the export's ``attnx.tokenizer`` metadata)."""

    file: str  # the tokenizer.json's name inside the tokenizer folder
    max_length: int
    truncation_side: str
    pad_id: int
    pad_to_multiple_of: int = 16

    @classmethod
    def from_metadata(cls, tokenizer: Mapping[str, Any], *, max_length: int | None = None,
                      pad_to_multiple_of: int = 16) -> "Tokenization":
        """From ``ModelInfo.tokenizer``; ``max_length`` may lower the export's (never raise it)."""
        try:
            exported = int(tokenizer["max_length"])
            side, pad_id = str(tokenizer.get("truncation_side", "right")), int(tokenizer["pad_id"])
            file = str(tokenizer.get("file") or "tokenizer.json")
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"the export's attnx.tokenizer metadata is incomplete ({e!r})") from None
        if max_length is not None and not 1 <= max_length <= exported:
            raise ConfigError(f"max length {max_length} must be between 1 and the export's {exported}")
        if pad_to_multiple_of < 1:
            raise ConfigError(f"pad multiple must be >= 1, got {pad_to_multiple_of}")
        if side not in ("left", "right"):
            raise ConfigError(f"truncation side {side!r} in the export's metadata must be left or right")
        return cls(file, max_length or exported, side, pad_id, pad_to_multiple_of)


def id_inputs(inputs: list[TensorSpec]) -> dict[str, str]:
    """``{input name: role}`` of the model's inputs that the tokenizer makes; it needs ``input_ids``."""
    found = {s.name: s.role for s in inputs if s.role in ID_ROLES}
    if Role.INPUT_IDS not in found.values():
        raise ConfigError("the model takes no input_ids: a tokenizer cannot feed it")
    return found


def tokenizer_config(names: TextNames, model_config: Mapping[str, Any], roles: Mapping[str, str],
                     tokenization: Tokenization, *, max_queue_delay_us: int, instance_count: int) -> dict[str, Any]:
    """The Python-backend tokenizer model's config: ``text`` in, the model's id inputs out (same
    names, types and dims as the model declares them), tokenisation settings as ``parameters``."""
    batched = model_config["max_batch_size"] > 0
    by_name = {t["name"]: t for t in model_config["input"]}
    config: dict[str, Any] = {
        "name": names.tokenizer,
        "backend": "python",
        "max_batch_size": model_config["max_batch_size"],
        "input": [_text_input(batched)],
        "output": [dict(by_name[n]) for n in roles],
    }
    if batched:
        config["dynamic_batching"] = {"max_queue_delay_microseconds": int(max_queue_delay_us)}
    config["instance_group"] = [{"kind": Enum("KIND_CPU"), "count": int(instance_count)}]
    config["parameters"] = {k: {"string_value": v} for k, v in {
        "tokenizer_file": f"{TOKENIZER_FOLDER}/{tokenization.file}",
        "max_length": str(tokenization.max_length),
        "truncation_side": tokenization.truncation_side,
        "pad_id": str(tokenization.pad_id),
        "pad_to_multiple_of": str(tokenization.pad_to_multiple_of),
        "text_input": TEXT_INPUT,
        "outputs": json.dumps(dict(roles)),
    }.items()}
    return config


def ensemble_config(names: TextNames, model_config: Mapping[str, Any], roles: Mapping[str, str],
                    outputs: list[TensorSpec]) -> dict[str, Any]:
    """The ensemble: ``text`` and the model's other inputs in, the model's outputs (and the attention
    mask, when an output is per token) out."""
    batched = model_config["max_batch_size"] > 0
    passed = [dict(t) for t in model_config["input"] if t["name"] not in roles]
    out = [dict(t) for t in model_config["output"]]
    per_token = any(len(s.shape) > 1 and s.shape[1] == SEQ for s in outputs)
    mask = next((n for n, r in roles.items() if r == Role.ATTENTION_MASK), None)
    expose_mask = per_token and mask is not None and mask not in {t["name"] for t in out}
    if expose_mask:
        out.append(dict(next(t for t in model_config["input"] if t["name"] == mask)))
    if TEXT_INPUT in {t["name"] for t in passed + out}:
        raise ConfigError(f"the model already has a tensor named {TEXT_INPUT!r}")
    return {
        "name": names.ensemble,
        "platform": "ensemble",
        "max_batch_size": model_config["max_batch_size"],
        "input": [_text_input(batched), *passed],
        "output": out,
        "ensemble_scheduling": {"step": [
            {"model_name": names.tokenizer, "model_version": -1,
             "input_map": {TEXT_INPUT: TEXT_INPUT}, "output_map": {n: n for n in roles}},
            {"model_name": names.model, "model_version": -1,
             "input_map": {t["name"]: t["name"] for t in model_config["input"]},
             "output_map": {t["name"]: t["name"] for t in model_config["output"]}},
        ]},
    }


def _text_input(batched: bool) -> dict[str, Any]:
    # Batched: one string per batch row (dims [1]); unbatched: a list of strings.
    return {"name": TEXT_INPUT, "data_type": Enum("TYPE_STRING"), "dims": [1] if batched else [-1]}


def dockerfile() -> str:
    """Triton's image plus the ``tokenizers`` package (this attnx's version) that the tokenizer model needs."""
    try:
        tokenizers = f"=={package_version('tokenizers')}"
    except PackageNotFoundError:
        tokenizers = ""
    return f"""# Written by attnx triton-repo: Triton's image plus the `tokenizers` package that the
# Python-backend tokenizer models of this repository need. Pick a Triton release whose ONNX Runtime
# is 1.22 or newer (the attnx files use opset 23):
#   docker build --build-arg TRITON_IMAGE=nvcr.io/nvidia/tritonserver:<release>-py3 -t attnx-triton .
ARG TRITON_IMAGE
FROM ${{TRITON_IMAGE}}
RUN pip install --no-cache-dir "tokenizers{tokenizers}"
"""
