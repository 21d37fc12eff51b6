"""Text in, model outputs out, on Triton: the configs of a tokenizer model and the ensemble around it.

For an export that carries a tokenizer, ``attnx triton-repo`` writes three models:

- ``<name>_model``: the ONNX Runtime or TensorRT model itself (token ids in), with dynamic batching;
- ``<name>_tokenizer``: a Python-backend model (:mod:`attnx.deploy.tokenizer_model`, shipped as its
  ``model.py``) that turns the ``text`` input (``TYPE_STRING``) into the model's id inputs, with the
  export's maximum length, truncation side and pad id, padding each request to a length bucket;
- ``<name>``: the ensemble clients call: ``text`` (plus ``text_pair`` for a classifier, and any
  context input the variant declares) in, the model's outputs out, and ``attention_mask`` as well
  when an output is per token, so a client can drop the padded positions.

A context input whose export metadata gives it a default (``zeros``/``ones``: a neutral placed
variant's ``self_state``, ``trace``) is optional, as ``attnx serve`` treats it: the ensemble marks it
``optional``, maps it to the tokenizer step's optional input of the same name, and the tokenizer
passes it on or fills the default (Triton 2.51 runs a step whose optional input the request left
out without it). The model step then always receives it, whichever backend runs the model: ONNX
Runtime and TensorRT do not fill a missing input. A context input without a default, or whose dims
other than batch and sequence are not fixed, goes straight to the model step, required.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version as package_version
from typing import Any, Mapping

from attnx.contract import BATCH, SEQ, Role, TokenizerSettings
from attnx.deploy.triton import ConfigError, Enum, check_model_name
from attnx.runtime.core.session import TensorSpec
from attnx.runtime.core.text import TEXT_INPUT, TEXT_PAIR_INPUT  # the names `attnx serve` gives its text inputs too

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
    def from_metadata(cls, tokenizer: TokenizerSettings, *, max_length: int | None = None,
                      pad_to_multiple_of: int = 16) -> "Tokenization":
        """From ``ModelInfo.tokenizer`` (checked when read); ``max_length`` may lower the export's (never raise it)."""
        exported = tokenizer.max_length
        if max_length is not None and not 1 <= max_length <= exported:
            raise ConfigError(f"max length {max_length} must be between 1 and the export's {exported}")
        if pad_to_multiple_of < 1:
            raise ConfigError(f"pad multiple must be >= 1, got {pad_to_multiple_of}")
        return cls(tokenizer.file, max_length or exported, tokenizer.truncation_side, tokenizer.pad_id,
                   pad_to_multiple_of)


def id_inputs(inputs: list[TensorSpec]) -> dict[str, str]:
    """``{input name: role}`` of the model's inputs that the tokenizer makes; it needs ``input_ids``."""
    found = {s.name: s.role for s in inputs if s.role in ID_ROLES}
    if Role.INPUT_IDS not in found.values():
        raise ConfigError("the model takes no input_ids: a tokenizer cannot feed it")
    return found


def defaulted_context(inputs: list[TensorSpec]) -> dict[str, str]:
    """``{name: default}`` of the context inputs a text request may leave out: a ``zeros``/``ones``
    default in the export's metadata, and no dim but batch and sequence left open."""
    return {s.name: s.default for s in inputs
            if s.role == Role.CONTEXT and s.default in ("zeros", "ones") and s.batch_axis == 0
            and all(isinstance(d, int) or d in (BATCH, SEQ) for d in s.shape)}


def scores_pairs(outputs: list[TensorSpec]) -> bool:
    """A classifier (a cross-encoder among them): ``logits [batch, labels]``. Its ensemble takes
    ``text_pair`` beside ``text``, as ``attnx serve`` does."""
    return any(s.name == "logits" and len(s.shape) == 2 and s.shape[0] == BATCH and isinstance(s.shape[1], int)
               for s in outputs)


def filled(name: str) -> str:
    """The ensemble's name for a context input once the tokenizer step has passed it on or filled it."""
    return f"{name}.filled"


def tokenizer_config(names: TextNames, model_config: Mapping[str, Any], roles: Mapping[str, str],
                     tokenization: Tokenization, *, max_queue_delay_us: int, instance_count: int,
                     context: Mapping[str, str] | None = None, pairs: bool = False) -> dict[str, Any]:
    """The Python-backend tokenizer model's config: ``text`` (and ``text_pair``) in, the model's id
    inputs out (same names, types and dims as the model declares them), tokenisation settings as
    ``parameters``; each of ``context`` (``{name: default}``) an optional input and an output."""
    batched = model_config["max_batch_size"] > 0
    context = dict(context or {})
    by_name = {t["name"]: _declared(t) for t in model_config["input"]}
    config: dict[str, Any] = {
        "name": names.tokenizer,
        "backend": "python",
        "max_batch_size": model_config["max_batch_size"],
        "input": [_text_input(batched), *([_text_input(batched, TEXT_PAIR_INPUT)] if pairs else []),
                  *({**by_name[n], "optional": True} for n in context)],
        "output": [dict(by_name[n]) for n in [*roles, *context]],
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
        **({"pair_input": TEXT_PAIR_INPUT} if pairs else {}),
        **({"context": json.dumps(context)} if context else {}),
    }.items()}
    return config


def ensemble_config(names: TextNames, model_config: Mapping[str, Any], roles: Mapping[str, str],
                    outputs: list[TensorSpec], *, context: Mapping[str, str] | None = None,
                    pairs: bool = False) -> dict[str, Any]:
    """The ensemble: ``text`` and the model's other inputs in (``context`` optional, through the
    tokenizer step), the model's outputs (and the attention mask, when an output is per token) out."""
    batched = model_config["max_batch_size"] > 0
    context = dict(context or {})
    passed = [{**_declared(t), "optional": True} if t["name"] in context else _declared(t)
              for t in model_config["input"] if t["name"] not in roles]
    out = [dict(t) for t in model_config["output"]]
    per_token = any(len(s.shape) > 1 and s.shape[1] == SEQ for s in outputs)
    mask = next((n for n, r in roles.items() if r == Role.ATTENTION_MASK), None)
    expose_mask = per_token and mask is not None and mask not in {t["name"] for t in out}
    if expose_mask:
        out.append(_declared(next(t for t in model_config["input"] if t["name"] == mask)))
    texts = [TEXT_INPUT, *([TEXT_PAIR_INPUT] if pairs else [])]
    model_tensors = {t["name"] for t in model_config["input"] + model_config["output"]}
    clash = sorted(set(texts) & {t["name"] for t in passed + out}) + sorted({filled(n) for n in context} & model_tensors)
    if clash:
        raise ConfigError(f"the model already has a tensor named {clash[0]!r}")
    feeds = {t["name"]: filled(t["name"]) if t["name"] in context else t["name"] for t in model_config["input"]}
    return {
        "name": names.ensemble,
        "platform": "ensemble",
        "max_batch_size": model_config["max_batch_size"],
        "input": [*(_text_input(batched, n) for n in texts), *passed],
        "output": out,
        "ensemble_scheduling": {"step": [
            {"model_name": names.tokenizer, "model_version": -1,
             "input_map": {n: n for n in [*texts, *context]},
             "output_map": {**{n: n for n in roles}, **{n: filled(n) for n in context}}},
            {"model_name": names.model, "model_version": -1,
             "input_map": feeds,
             "output_map": {t["name"]: t["name"] for t in model_config["output"]}},
        ]},
    }


def _declared(tensor: Mapping[str, Any]) -> dict[str, Any]:
    """A model input's name, type and dims, without how that model takes it (optional, ragged)."""
    return {k: v for k, v in tensor.items() if k not in ("optional", "allow_ragged_batch")}


def _text_input(batched: bool, name: str = TEXT_INPUT) -> dict[str, Any]:
    # Batched: one string per batch row (dims [1]); unbatched: a list of strings. text_pair, where a
    # classifier takes it, may be left out (a text alone is then classified).
    entry = {"name": name, "data_type": Enum("TYPE_STRING"), "dims": [1] if batched else [-1]}
    return {**entry, "optional": True} if name == TEXT_PAIR_INPUT else entry


def _pin(package: str) -> str:
    """``package==<the version installed here>`` (bare where it is not installed)."""
    try:
        return f"{package}=={package_version(package)}"
    except PackageNotFoundError:
        return package


def dockerfile(attnx_runtime: bool = False) -> str:
    """Triton's image plus what this repository's Python-backend models import: ``tokenizers`` (this
    attnx's version) for the tokenizer models, and with ``attnx_runtime`` attnx itself with ONNX
    Runtime, for models run by :mod:`attnx.deploy.runtime_model` (numpy<2: see its doc)."""
    head = """# Written by attnx triton-repo: Triton's image plus the packages that the Python-backend models of
# this repository import."""
    if not attnx_runtime:
        return f"""{head} Pick a Triton release whose ONNX Runtime is 1.22 or newer (the attnx files use opset 23):
#   docker build --build-arg TRITON_IMAGE=nvcr.io/nvidia/tritonserver:<release>-py3 -t attnx-triton .
ARG TRITON_IMAGE
FROM ${{TRITON_IMAGE}}
RUN pip install --no-cache-dir "{_pin('tokenizers')}"
"""
    return f"""{head} The model steps run attnx's runtime in Triton's Python backend: attnx and
# ONNX Runtime (onnxruntime-gpu for GPU instances) in the image's Python, the one its Python-backend stub
# embeds. numpy<2: Triton's stub up to 2.51 at least reads numpy 2 arrays wrongly (the models refuse to
# load on such a stub). attnx goes in without its dependencies (its exporter's torch is not needed here);
# ATTNX is a wheel (`pip wheel --no-deps <attnx checkout>`) or an index spec.
#   docker build --build-arg TRITON_IMAGE=nvcr.io/nvidia/tritonserver:<release>-py3 --build-arg ATTNX=... -t attnx-triton .
ARG TRITON_IMAGE
FROM ${{TRITON_IMAGE}}
ARG ATTNX="{_pin('attnx')}"
RUN pip install --no-cache-dir "numpy<2" "{_pin('onnxruntime')}" "{_pin('onnx')}" "{_pin('tokenizers')}" && \\
    pip install --no-cache-dir --no-deps "$ATTNX"
"""
