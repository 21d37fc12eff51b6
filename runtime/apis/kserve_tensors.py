"""KServe v2 / Open Inference Protocol requests, independent of the transport.

The HTTP codec (:mod:`attnx.runtime.apis.kserve_json`: JSON and the binary tensor extension) and the gRPC
service (:mod:`attnx.runtime.apis.kserve_grpc`) each turn what arrived into :class:`WireTensor` items;
:func:`build_infer_request` checks them against the model
(:class:`~attnx.runtime.serving.signature.ModelSignature`) and gives an
:class:`InferRequest` of numpy feeds, or of texts for a model with a tokenizer. Everything a client
sends is validated here, so both transports answer a bad request with the same one-line message
(HTTP 400, gRPC ``INVALID_ARGUMENT``) before it can reach the model.

Text: a model that carries a tokenizer takes a ``BYTES`` input (``text``, shape ``[N]``, one string
per row) in place of its token ids; mixing the two in one request is refused. ``BYTES`` elements are
UTF-8, and on the wire (binary extension, gRPC ``raw_input_contents``) each is a 4-byte little-endian
length followed by its bytes, as Triton lays them out.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from attnx.contract import BATCH, SEQ, Role
from attnx.runtime.core.session import ON_REQUEST_OUTPUT, InputError, TensorSpec
from attnx.runtime.core.text import TEXT_PAIR_INPUT, decode_text
from attnx.runtime.serving.signature import BYTES, TRITON_TO_NUMPY, UNSUPPORTED_DATATYPES, ModelSignature, TextInput, \
    triton_dtype
from attnx.runtime.wire.errors import bad_input
from attnx.runtime.wire.limits import Limits

@dataclass
class InferRequest:
    """A parsed, checked infer request: numpy ``feeds``, plus ``texts`` for a text request."""

    id: str | None
    feeds: dict[str, np.ndarray]
    #: Output names asked for, in order (None: all outputs).
    outputs: list[str] | None
    #: Per output: send as binary data? (HTTP only.)
    binary: dict[str, bool] = field(default_factory=dict)
    binary_default: bool = False
    parameters: dict[str, Any] = field(default_factory=dict)
    texts: list[str] | None = None
    #: With ``texts``: each row's second text (``text_pair``), tokenised with it as a pair.
    pairs: list[str] | None = None

    @property
    def timeout_ms(self) -> float | None:
        """The client's ``timeout`` parameter (microseconds in the protocol) in ms."""
        t = self.parameters.get("timeout")
        if isinstance(t, (int, float)) and not isinstance(t, bool) and t > 0:
            return t / 1000.0
        return None

    @property
    def truncate(self) -> bool:
        """Cut texts past the max length (the default), or refuse them (``parameters.truncate: false``)."""
        return self.parameters.get("truncate", True) is not False


@dataclass
class WireTensor:
    """One input as a transport delivered it: exactly one of ``data`` (JSON values, flat or nested),
    ``raw`` (little-endian bytes) or ``contents`` (gRPC typed values, flat) is set."""

    name: str
    datatype: str
    shape: Any
    parameters: dict = field(default_factory=dict)
    data: Any = None
    raw: bytes | memoryview | None = None
    contents: Any = None


@dataclass
class RequestedOutput:
    name: str
    parameters: dict = field(default_factory=dict)


# --------------------------------------------------------------------------------------
# Checking and decoding tensors
# --------------------------------------------------------------------------------------


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _values_to_array(name: str, data: Any, dtype: np.dtype, shape: list[int], count: int) -> np.ndarray:
    """JSON / typed values (flat or nested list, row-major) -> array, with strict element types."""
    if not isinstance(data, (list, tuple)) and not hasattr(data, "__len__"):
        raise bad_input(f"input {name!r}: 'data' must be a list")
    try:  # an array already (the HTTP codec decodes long JSON lists itself): no copy
        raw = data if isinstance(data, np.ndarray) else np.array(data)
    except (ValueError, TypeError, RecursionError):
        raise bad_input(f"input {name!r}: 'data' is not a regular (non-ragged) list of numbers") from None
    if raw.size != count:
        raise bad_input(f"input {name!r}: 'data' has {raw.size} elements, shape {shape} needs {count}")
    kind = raw.dtype.kind
    if count == 0:
        return np.zeros(shape, dtype=dtype)
    if dtype.kind == "b":
        ok = kind == "b"
    elif dtype.kind in "iu":
        ok = kind in "iu"
    else:  # floats take ints too
        ok = kind in "iuf"
    if not ok:
        what = {"U": "strings", "O": "mixed or out-of-range values", "f": "floats", "b": "booleans"}.get(kind, kind)
        raise bad_input(f"input {name!r}: 'data' holds {what}, the datatype is {triton_dtype(dtype)}")
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        if raw.min() < info.min or raw.max() > info.max:
            raise bad_input(f"input {name!r}: value out of range for {triton_dtype(dtype)}")
    return raw.astype(dtype, copy=False).reshape(shape)


def _raw_to_array(name: str, raw, dtype: np.dtype, shape: list[int], count: int) -> np.ndarray:
    expected = count * dtype.itemsize
    if len(raw) != expected:
        raise bad_input(f"input {name!r}: {len(raw)} bytes of binary data, but shape {shape} of "
                         f"{triton_dtype(dtype)} is {expected} bytes")
    arr = np.frombuffer(raw, dtype=dtype, count=count).reshape(shape)
    if not arr.flags.aligned:  # an FP16 tensor of odd length shifts the ones after it
        arr = arr.copy()
    return arr


def _check_shape(spec: TensorSpec, shape: Any, sig: ModelSignature, limits: Limits) -> list[int]:
    name = spec.name
    if not isinstance(shape, list) or not all(_is_int(d) for d in shape):
        raise bad_input(f"input {name!r}: 'shape' must be a list of integers")
    if len(shape) != spec.rank:
        raise bad_input(f"input {name!r}: rank {len(shape)} {shape}, the model expects {spec.describe()}")
    for axis, (want, got) in enumerate(zip(spec.shape, shape)):
        if got < 0:
            raise bad_input(f"input {name!r}: negative dim {got}")
        if isinstance(want, int) and got != want:
            raise bad_input(f"input {name!r}: dim {axis} is {got}, the model expects {spec.describe()}")
        if want == BATCH and not 1 <= got <= sig.max_batch_size:
            raise bad_input(f"input {name!r}: batch {got} is outside 1..{sig.max_batch_size}")
        if want == SEQ:
            max_seq = limits.max_seq or sig.max_seq
            if got < 1 or (max_seq is not None and got > max_seq):
                raise bad_input(f"input {name!r}: seq {got} is outside 1..{max_seq or 'any'}")
    count = math.prod(shape)  # Python ints: a huge declared shape cannot overflow
    if count > limits.max_tensor_elements:
        raise bad_input(
            f"input {name!r}: shape {shape} has {count} elements, over the limit of {limits.max_tensor_elements}"
        )
    return shape


def _check_values(spec: TensorSpec, arr: np.ndarray) -> None:
    if arr.dtype.kind == "f" and arr.size and not np.isfinite(arr).all():
        raise bad_input(f"input {spec.name!r}: holds NaN or infinite values")
    if spec.role == Role.ATTENTION_MASK and arr.size and not np.isin(arr, (0, 1)).all():
        raise bad_input(f"input {spec.name!r}: an attention mask holds only 0 (padding) and 1 (token)")


def split_bytes(raw, count: int, name: str) -> list[bytes]:
    """A serialized BYTES tensor (each element: 4-byte little-endian length, then the bytes) -> elements."""
    view = memoryview(raw)
    out: list[bytes] = []
    offset = 0
    while offset < len(view):
        if offset + 4 > len(view):
            raise bad_input(f"input {name!r}: BYTES data ends inside an element's 4-byte length")
        (size,) = struct.unpack_from("<I", view, offset)
        offset += 4
        if offset + size > len(view):
            raise bad_input(f"input {name!r}: BYTES element {len(out)} runs past the data ({size} bytes declared)")
        out.append(bytes(view[offset:offset + size]))
        offset += size
    if len(out) != count:
        raise bad_input(f"input {name!r}: BYTES data holds {len(out)} elements, shape needs {count}")
    return out


def _decode_texts(t: WireTensor, sig: ModelSignature, limits: Limits) -> list[str]:
    """The strings of a text input (``text`` or ``text_pair``), checked: shape ``[N]``, UTF-8, not empty."""
    text = sig.text
    assert text is not None
    shape = t.shape
    if not isinstance(shape, list) or not all(_is_int(d) for d in shape):
        raise bad_input(f"input {t.name!r}: 'shape' must be a list of integers")
    if len(shape) != 1 or not 1 <= shape[0]:
        raise bad_input(f"input {t.name!r}: shape {shape}, expected [N] with 1 <= N <= {limits.max_texts} "
                        f"(one string per row)")
    limits.check_count(shape[0], t.name)
    count = shape[0]
    if t.raw is not None:
        values: list = split_bytes(t.raw, count, t.name)
    elif t.data is not None or t.contents is not None:
        values = list(t.data if t.data is not None else t.contents)
        if len(values) != count:
            raise bad_input(f"input {t.name!r}: 'data' has {len(values)} elements, shape {shape} needs {count}")
    else:
        raise bad_input(f"input {t.name!r}: no data")
    try:
        texts = [decode_text(v, i) for i, v in enumerate(values)]
    except InputError as e:
        raise e.refused(f"input {t.name!r}: ") from None
    for i, s in enumerate(texts):
        if not s.strip():
            raise bad_input(f"input {t.name!r}: text {i} is empty{' (only whitespace)' if s else ''}")
    return texts


# --------------------------------------------------------------------------------------
# Whole requests
# --------------------------------------------------------------------------------------


def build_infer_request(request_id: Any, params: Any, tensors: list[WireTensor], requested: Any,
                        sig: ModelSignature, limits: Limits) -> InferRequest:
    """Check a request's parts against the model and decode them (see the module doc)."""
    binary_default = _check_parameters(request_id, params)
    if not tensors:
        raise bad_input("'inputs' must be a non-empty list")
    feeds: dict[str, np.ndarray] = {}
    texts: dict[str, list[str]] = {}
    total = 0
    for t in tensors:
        _check_tensor_head(t, sig, feeds, texts)
        if sig.text is not None and (t.name == sig.text.name or t.name == TEXT_PAIR_INPUT and sig.input(t.name) is None):
            texts[t.name] = _text_tensor(t, sig, sig.text, limits)
            continue
        arr = _tensor(t, sig, limits)
        total += arr.size
        if total > limits.max_request_elements:
            raise bad_input(f"request has more than {limits.max_request_elements} elements in total")
        feeds[t.name] = arr
    text = pairs = None
    if sig.text is not None:
        text, pairs = texts.get(sig.text.name), texts.get(TEXT_PAIR_INPUT)
        if pairs is not None and (text is None or len(pairs) != len(text)):
            raise bad_input(f"input {TEXT_PAIR_INPUT!r} holds each row's second text: it needs "
                            + (f"{len(text)} strings, one per text" if text is not None else
                               f"the text input {sig.text.name!r} beside it"))
        if text is not None and sig.text_filled & set(feeds):
            raise bad_input(f"send either text ({sig.text.name!r}) or token ids "
                            f"({sorted(sig.text_filled & set(feeds))}), not both")
    skip = sig.optional_inputs | (sig.text_filled if text is not None else set())
    missing = [s.name for s in sig.inputs if s.name not in feeds and s.name not in skip]
    if missing:
        raise bad_input(f"missing input(s) {missing} for model {sig.name!r}")
    outputs, binary = _parse_requested_outputs(requested, sig, binary_default)
    return InferRequest(request_id, feeds, outputs, binary, binary_default, params, text, pairs)


def _check_parameters(request_id: Any, params: Any) -> bool:
    """The request's ``id`` and ``parameters``; the default of ``binary_data_output``."""
    if request_id is not None and not isinstance(request_id, str):
        raise bad_input("'id' must be a string")
    if not isinstance(params, dict):
        raise bad_input("'parameters' must be an object")
    binary_default = params.get("binary_data_output", False)
    if not isinstance(binary_default, bool):
        raise bad_input("'binary_data_output' must be a boolean")
    timeout = params.get("timeout")
    if timeout is not None and (not _is_int(timeout) or timeout < 0):
        raise bad_input("'timeout' must be a non-negative integer (microseconds)")
    if not isinstance(params.get("truncate", True), bool):
        raise bad_input("'truncate' must be a boolean")
    return binary_default


def _check_tensor_head(t: WireTensor, sig: ModelSignature, feeds: dict, texts: dict) -> None:
    """A tensor's name, datatype and parameters, before its data is read."""
    if not isinstance(t.name, str):
        raise bad_input("each input needs a string 'name'")
    if not isinstance(t.datatype, str):
        raise bad_input(f"input {t.name!r}: 'datatype' must be a string")
    if t.name in feeds or t.name in texts:
        raise bad_input(f"input {t.name!r} given twice")
    if not isinstance(t.parameters, dict):
        raise bad_input(f"input {t.name!r}: 'parameters' must be an object")
    if "shared_memory_region" in t.parameters:
        raise bad_input(f"input {t.name!r}: shared memory is not supported by this server")


def _text_tensor(t: WireTensor, sig: ModelSignature, text: TextInput, limits: Limits) -> list[str]:
    """The text input, or its pair input, of a model with text (``text``: ``sig.text``)."""
    if t.name == TEXT_PAIR_INPUT and not text.pairs:
        raise bad_input(f"input {t.name!r}: model {sig.name!r} does not score text pairs (an export of a "
                        "sequence-classification model, such as a cross-encoder, does)")
    if t.datatype != BYTES:
        raise bad_input(f"input {t.name!r}: datatype {t.datatype}, the text input takes BYTES")
    return _decode_texts(t, sig, limits)


def _tensor(t: WireTensor, sig: ModelSignature, limits: Limits) -> np.ndarray:
    """One numeric input, checked against its spec and decoded."""
    spec = sig.input(t.name)
    if t.datatype == BYTES:
        if sig.text is None:
            raise bad_input(f"model {sig.name!r} has no tokenizer, so it takes no text (BYTES input "
                            f"{t.name!r}); send its inputs {[s.name for s in sig.inputs]}")
        raise bad_input(f"input {t.name!r}: BYTES is only for the text input {sig.text.name!r}")
    if spec is None:
        raise bad_input(f"unknown input {t.name!r}; model {sig.name!r} takes {_input_names(sig)}")
    if t.datatype in UNSUPPORTED_DATATYPES or t.datatype not in TRITON_TO_NUMPY:
        known = "unsupported" if t.datatype in UNSUPPORTED_DATATYPES else "unknown"
        raise bad_input(f"input {t.name!r}: {known} datatype {t.datatype!r}")
    want = triton_dtype(spec.dtype)
    if t.datatype != want:
        raise bad_input(f"input {t.name!r}: datatype {t.datatype}, the model expects {want}")
    dtype = TRITON_TO_NUMPY[t.datatype]
    shape = _check_shape(spec, t.shape, sig, limits)
    count = math.prod(shape)
    if t.raw is not None:
        arr = _raw_to_array(t.name, t.raw, dtype, shape, count)
    elif t.data is not None:
        if not isinstance(t.data, (list, np.ndarray)):
            raise bad_input(f"input {t.name!r}: 'data' must be a list")
        arr = _values_to_array(t.name, t.data, dtype, shape, count)
    elif t.contents is not None:
        arr = _values_to_array(t.name, t.contents, dtype, shape, count)
    else:
        raise bad_input(f"input {t.name!r}: no 'data' and no binary_data_size")
    _check_values(spec, arr)
    return arr


def _input_names(sig: ModelSignature) -> list[str]:
    texts = [] if sig.text is None else [sig.text.name, TEXT_PAIR_INPUT] if sig.text.pairs else [sig.text.name]
    return texts + [s.name for s in sig.inputs]


def _parse_requested_outputs(items: Any, sig: ModelSignature, binary_default: bool
                             ) -> tuple[list[str] | None, dict[str, bool]]:
    names = [s.name for s in sig.outputs]
    if items is None:
        default = [n for n in names if not ON_REQUEST_OUTPUT.match(n)]
        # Attention patterns only when named: a request that names no outputs gets the others.
        return (None if len(default) == len(names) else default), {n: binary_default for n in default}
    if not isinstance(items, list):
        raise bad_input("'outputs' must be a list")
    wanted: list[str] = []
    binary: dict[str, bool] = {}
    for item in items:
        if isinstance(item, dict):
            if not isinstance(item.get("name"), str):
                raise bad_input("each requested output must be an object with a string 'name'")
            item = RequestedOutput(item["name"], item.get("parameters", {}))
        if not isinstance(item, RequestedOutput):
            raise bad_input("each requested output must be an object with a string 'name'")
        name = item.name
        if name not in names:
            raise bad_input(f"unknown output {name!r}; model {sig.name!r} gives {names}")
        if name in binary:
            raise bad_input(f"output {name!r} requested twice")
        oparams = item.parameters
        if not isinstance(oparams, dict):
            raise bad_input(f"output {name!r}: 'parameters' must be an object")
        if oparams.get("classification"):
            raise bad_input(f"output {name!r}: classification outputs are not supported")
        if "shared_memory_region" in oparams:
            raise bad_input(f"output {name!r}: shared memory is not supported by this server")
        flag = oparams.get("binary_data", binary_default)
        if not isinstance(flag, bool):
            raise bad_input(f"output {name!r}: 'binary_data' must be a boolean")
        wanted.append(name)
        binary[name] = flag
    return wanted, binary
