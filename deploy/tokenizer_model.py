"""The tokenizer step of a Triton text ensemble: a Python-backend model that turns strings into token ids.

``attnx triton-repo`` copies this file, unchanged, to ``<name>_tokenizer/1/model.py`` of the
repository, next to the export's tokenizer files (``1/tokenizer/``). Inside Triton it runs without
attnx (only ``numpy`` and the ``tokenizers`` library), so everything it needs comes from the
``parameters`` of its own ``config.pbtxt``, which the repository writer fills from the export's
metadata:

- ``tokenizer_file``: the ``tokenizer.json`` to load, relative to the version folder;
- ``max_length`` and ``truncation_side``: truncation as attnx serving and sentence-transformers do
  it (the file's own padding and truncation settings are switched off: they may differ);
- ``pad_id``: the id written on padded positions (their ``attention_mask`` is 0);
- ``pad_to_multiple_of``: each request is padded to its longest text rounded up to this multiple
  (capped at ``max_length``). Triton's dynamic batcher only merges requests of equal shape, so
  a few length buckets let requests of different lengths share a batch downstream;
- ``text_input`` and ``outputs``: the input's name and ``{output name: role}`` (``input_ids``,
  ``attention_mask``, ``token_type_ids``), as the model after it names its inputs.

A request that is not valid (a text that is not UTF-8, an empty text, no text) gets its own error
response; the other requests of the same batch are answered as usual.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

try:
    import triton_python_backend_utils as pb_utils
except ImportError:  # outside Triton: attnx only ships this file (tests load it with a stand-in)
    pb_utils = None

ROLES = ("input_ids", "attention_mask", "token_type_ids")


class TokenizerSettings:
    """How to tokenise, read from the model's ``parameters`` (all strings, as Triton passes them)."""

    def __init__(self, parameters: dict):
        def need(key: str) -> str:
            if key not in parameters:
                raise ValueError(f"config.pbtxt has no parameter {key!r}")
            return parameters[key]

        self.tokenizer_file = need("tokenizer_file")
        self.max_length = int(need("max_length"))
        self.truncation_side = need("truncation_side")
        self.pad_id = int(need("pad_id"))
        self.pad_to_multiple_of = max(1, int(parameters.get("pad_to_multiple_of", "1")))
        self.text_input = need("text_input")
        self.outputs = json.loads(need("outputs"))  # {output name: role}
        if self.max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {self.max_length}")
        if self.truncation_side not in ("left", "right"):
            raise ValueError(f"truncation_side must be left or right, got {self.truncation_side!r}")
        unknown = sorted(set(self.outputs.values()) - set(ROLES))
        if unknown:
            raise ValueError(f"unknown output roles {unknown}; known: {', '.join(ROLES)}")


def load_tokenizer(path: Path, settings: TokenizerSettings):
    """A ``tokenizers.Tokenizer`` that truncates at ``max_length`` on the chosen side and never pads."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path))
    tokenizer.no_padding()  # padding is done per request below, to a length bucket
    tokenizer.enable_truncation(settings.max_length, direction=settings.truncation_side)
    return tokenizer


def decode_texts(array: np.ndarray) -> list[str]:
    """The strings of a BYTES tensor (any shape), each checked; a bad one is a ValueError naming it."""
    texts = []
    for index, item in enumerate(array.reshape(-1)):
        if isinstance(item, (bytes, bytearray, np.bytes_)):
            try:
                item = bytes(item).decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"text {index} is not valid UTF-8 (byte {e.start})") from None
        elif not isinstance(item, str):
            raise ValueError(f"text {index} is a {type(item).__name__}, expected a string")
        if not item:
            raise ValueError(f"text {index} is empty")
        texts.append(item)
    if not texts:
        raise ValueError("no texts in the request")
    return texts


def padded_length(longest: int, settings: TokenizerSettings) -> int:
    """The request's sequence length: its longest text rounded up to the bucket, within max_length."""
    multiple = settings.pad_to_multiple_of
    return max(1, min(-(-longest // multiple) * multiple, settings.max_length))


def encode(tokenizer, texts: list[str], settings: TokenizerSettings) -> dict[str, np.ndarray]:
    """``{role: int64 [len(texts), L]}`` for ``texts``, right-padded with ``pad_id`` to one length ``L``."""
    encodings = tokenizer.encode_batch(texts)
    length = padded_length(max(len(e.ids) for e in encodings), settings)
    ids = np.full((len(texts), length), settings.pad_id, dtype=np.int64)
    mask = np.zeros((len(texts), length), dtype=np.int64)
    types = np.zeros((len(texts), length), dtype=np.int64)
    for row, enc in enumerate(encodings):
        n = len(enc.ids)
        ids[row, :n] = enc.ids
        mask[row, :n] = 1
        types[row, :n] = enc.type_ids
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}


class TritonPythonModel:
    """Triton's entry points: ``initialize`` once per instance, ``execute`` per batch of requests."""

    def initialize(self, args: dict) -> None:
        config = json.loads(args["model_config"])
        parameters = {k: v.get("string_value", "") for k, v in (config.get("parameters") or {}).items()}
        self.settings = TokenizerSettings(parameters)
        version_dir = (Path(args["model_repository"]) / str(args["model_version"])).resolve()
        path = (version_dir / self.settings.tokenizer_file).resolve()
        if not path.is_relative_to(version_dir):
            raise ValueError(f"tokenizer_file {self.settings.tokenizer_file!r} is outside {version_dir}")
        self.tokenizer = load_tokenizer(path, self.settings)
        self.dtypes = {o["name"]: pb_utils.triton_string_to_numpy(o["data_type"]) for o in config["output"]}

    def execute(self, requests: list) -> list:
        responses = []
        for request in requests:
            try:
                tensor = pb_utils.get_input_tensor_by_name(request, self.settings.text_input)
                if tensor is None:
                    raise ValueError(f"missing input {self.settings.text_input!r}")
                by_role = encode(self.tokenizer, decode_texts(tensor.as_numpy()), self.settings)
            except ValueError as e:
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=_invalid_argument(str(e))))
                continue
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor(name, by_role[role].astype(self.dtypes[name], copy=False))
                for name, role in self.settings.outputs.items()]))
        return responses

    def finalize(self) -> None:
        self.tokenizer = None


def _invalid_argument(message: str):
    """A TritonError with the INVALID_ARG code where this Triton has error codes (23.09 on)."""
    code = getattr(pb_utils.TritonError, "INVALID_ARG", None)
    return pb_utils.TritonError(message) if code is None else pb_utils.TritonError(message, code)
