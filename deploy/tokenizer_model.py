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
  ``attention_mask``, ``token_type_ids``), as the model after it names its inputs;
- ``pair_input`` (classifiers, cross-encoders): an optional second text per row, tokenised with the
  first as a pair in the tokenizer's own template (BERT: ``[CLS] a [SEP] b [SEP]``), truncated
  longest-first, as sentence-transformers' CrossEncoder and ``attnx serve`` do;
- ``context``: ``{name: "zeros" | "ones"}``, the model's context inputs that a request may leave out
  (a neutral placed variant's ``self_state``, ``trace``): each is an optional input here and an output
  of the same name, passed through when given, else filled with the default for the request's rows
  (a ``seq`` dim, ``-1`` in the config, takes the padded length), as ``attnx serve`` fills them.

A request that is not valid (a text that is not UTF-8, an empty text, no text, a context input
with the wrong number of rows) gets its own error response; the other requests of the same batch
are answered as usual.

:func:`check_stub_numpy` refuses, at load, a Python-backend stub that cannot exchange arrays with the
installed numpy (Triton 2.51's stub reads numpy 2 arrays with numpy 1's layout: every element of an
input would read as its first).
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
        self.pair_input = parameters.get("pair_input") or None
        self.context = json.loads(parameters.get("context") or "{}")  # {name: "zeros" | "ones"}
        if self.max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {self.max_length}")
        if self.truncation_side not in ("left", "right"):
            raise ValueError(f"truncation_side must be left or right, got {self.truncation_side!r}")
        unknown = sorted(set(self.outputs.values()) - set(ROLES))
        if unknown:
            raise ValueError(f"unknown output roles {unknown}; known: {', '.join(ROLES)}")
        odd = sorted(n for n, fill in self.context.items() if fill not in ("zeros", "ones"))
        if odd:
            raise ValueError(f"context inputs {odd} have a default other than zeros or ones")


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


def encode(tokenizer, texts: list, settings: TokenizerSettings) -> dict[str, np.ndarray]:
    """``{role: int64 [len(texts), L]}`` for ``texts`` (strings, or ``(first, second)`` pairs), right-padded
    with ``pad_id`` to one length ``L``."""
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
        check_stub_numpy()
        self.tokenizer = load_tokenizer(path, self.settings)
        self.dtypes = {o["name"]: pb_utils.triton_string_to_numpy(o["data_type"]) for o in config["output"]}
        # Dims past the batch dim (the config's; a batched config leaves the batch dim out).
        batched = int(config.get("max_batch_size", 0)) > 0
        self.context_dims = {o["name"]: [int(d) for d in o["dims"]][0 if batched else 1:]
                             for o in config["output"] if o["name"] in self.settings.context}

    def execute(self, requests: list) -> list:
        responses = []
        for request in requests:
            try:
                outputs = self._one(request)
            except ValueError as e:
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=_invalid_argument(str(e))))
                continue
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor(name, array.astype(self.dtypes[name], copy=False)) for name, array in outputs.items()]))
        return responses

    def _one(self, request) -> dict[str, np.ndarray]:
        """One request's outputs: the model's id inputs, and its context inputs given or filled."""
        settings = self.settings
        tensor = pb_utils.get_input_tensor_by_name(request, settings.text_input)
        if tensor is None:
            raise ValueError(f"missing input {settings.text_input!r}")
        texts = decode_texts(tensor.as_numpy())
        pair = pb_utils.get_input_tensor_by_name(request, settings.pair_input) if settings.pair_input else None
        if pair is not None:
            seconds = decode_texts(pair.as_numpy())
            if len(seconds) != len(texts):
                raise ValueError(f"{settings.pair_input!r} has {len(seconds)} texts for {len(texts)} rows of "
                                 f"{settings.text_input!r}: one second text per row")
            texts = list(zip(texts, seconds))
        by_role = encode(self.tokenizer, texts, settings)
        outputs = {name: by_role[role] for name, role in settings.outputs.items()}
        length = next(iter(by_role.values())).shape[1]
        for name, fill in settings.context.items():
            given = pb_utils.get_input_tensor_by_name(request, name)
            if given is not None:
                array = given.as_numpy()
                if array.shape[:1] != (len(texts),):
                    raise ValueError(f"input {name!r} has {array.shape[0] if array.ndim else 0} rows for "
                                     f"{len(texts)} texts")
                outputs[name] = array
            else:
                dims = [len(texts)] + [length if d == -1 else d for d in self.context_dims[name]]
                outputs[name] = np.full(dims, 0 if fill == "zeros" else 1, dtype=self.dtypes[name])
        return outputs

    def finalize(self) -> None:
        self.tokenizer = None


def check_stub_numpy() -> None:
    """Refuse a Python-backend stub that reads this numpy's arrays wrongly, before it serves a request.

    Triton 2.51's stub (the one in nvidia-pytriton 0.7.0, at least) was built for numpy 1's array
    layout: with numpy 2 installed, an array made inside the stub from a tensor reads every element as
    the first ([1, 2, 3] comes back [1, 1, 1]) and outputs are refused. The probe makes a tensor in C++
    (from another tensor's DLPack) and reads it back."""
    probe = np.arange(1, 4, dtype=np.int64)
    back = pb_utils.Tensor.from_dlpack("probe", pb_utils.Tensor("probe", probe)).as_numpy()
    if back.tolist() != probe.tolist():
        raise RuntimeError(f"this Triton Python-backend stub reads numpy {np.__version__} arrays wrongly ({probe.tolist()} "
                           f"came back {back.tolist()}): install numpy<2 in the Python the stub runs, or use a Triton "
                           "release whose stub supports numpy 2")


def _invalid_argument(message: str):
    """A TritonError with the INVALID_ARG code where this Triton has error codes (23.09 on)."""
    code = getattr(pb_utils.TritonError, "INVALID_ARG", None)
    return pb_utils.TritonError(message) if code is None else pb_utils.TritonError(message, code)
