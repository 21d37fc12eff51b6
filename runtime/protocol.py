"""KServe v2 / Open Inference Protocol messages, as Triton speaks them over HTTP.

Pure functions, no HTTP framework: parse an infer request body (JSON tensors
and the binary tensor data extension) into checked numpy feeds, and encode
outputs back. Everything a client sends is validated here, so the server can
answer a bad request with a 4xx and one line saying what was wrong instead of
letting it reach the model.

Binary tensor data extension: the body is a JSON header followed by raw
little-endian tensor bytes; the ``Inference-Header-Content-Length`` HTTP header
gives the JSON part's length, and each binary input says its
``parameters.binary_data_size``, in the order the inputs are listed.
"""

from __future__ import annotations

import json
import math
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from attnx.contract import BATCH, SEQ, Role
from attnx.runtime.session import TensorSpec

#: Protocol datatype strings <-> numpy (little-endian on the wire).
TRITON_TO_NUMPY: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype("<u1"),
    "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("<i1"),
    "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
}
#: Valid in the protocol, but no attnx model takes them.
UNSUPPORTED_DATATYPES = {"BYTES", "BF16"}


def triton_dtype(dtype: np.dtype) -> str:
    """numpy dtype -> protocol datatype string ("FP32", "INT64", ...)."""
    d = np.dtype(dtype).newbyteorder("<") if np.dtype(dtype).byteorder == ">" else np.dtype(dtype)
    for name, np_dtype in TRITON_TO_NUMPY.items():
        if np_dtype == d:
            return name
    raise ValueError(f"no protocol datatype for {dtype}")


class ProtocolError(Exception):
    """A request the server refuses; ``status`` is the HTTP code, ``reason`` the metrics label."""

    status = 400
    reason = "bad_request"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class BadRequest(ProtocolError):
    status = 400
    reason = "bad_request"


class TooLarge(ProtocolError):
    status = 413
    reason = "too_large"


class NotFound(ProtocolError):
    status = 404
    reason = "unknown_model"


@dataclass
class Limits:
    """What one request may ask of the server.

    - ``max_body_bytes``: the HTTP body (after decompression), default 64 MiB.
    - ``max_tensor_elements``: elements in one tensor (checked on the declared
      shape, before any allocation), default 16 Mi.
    - ``max_request_elements``: summed over a request's inputs, default 32 Mi.
    - ``max_seq``: longest ``seq`` accepted (None: the model's profile max if it
      declares one, else unlimited).
    """

    max_body_bytes: int = 64 << 20
    max_tensor_elements: int = 16 << 20
    max_request_elements: int = 32 << 20
    max_seq: int | None = None


@dataclass
class ModelSignature:
    """What the protocol layer needs to know about a model."""

    name: str
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    max_batch_size: int
    max_seq: int | None = None

    def input(self, name: str) -> TensorSpec | None:
        return next((s for s in self.inputs if s.name == name), None)

    @property
    def optional_inputs(self) -> set[str]:
        # The attention mask may be omitted: it then means all ones (see session.py).
        return {s.name for s in self.inputs if s.role == Role.ATTENTION_MASK}


@dataclass
class InferRequest:
    """A parsed, checked infer request."""

    id: str | None
    feeds: dict[str, np.ndarray]
    #: Output names asked for, in order (None: all outputs).
    outputs: list[str] | None
    #: Per output: send as binary data?
    binary: dict[str, bool] = field(default_factory=dict)
    binary_default: bool = False
    parameters: dict[str, Any] = field(default_factory=dict)

    @property
    def timeout_ms(self) -> float | None:
        """The client's ``timeout`` parameter (microseconds in the protocol) in ms."""
        t = self.parameters.get("timeout")
        if isinstance(t, (int, float)) and not isinstance(t, bool) and t > 0:
            return t / 1000.0
        return None


# --------------------------------------------------------------------------------------
# Request body helpers
# --------------------------------------------------------------------------------------


def decompress(body: bytes, encoding: str | None, limit: int) -> bytes:
    """Undo ``Content-Encoding: gzip|deflate`` with a bound on the output (no zip bombs)."""
    if not encoding or encoding.lower() == "identity":
        return body
    enc = encoding.lower()
    if enc not in ("gzip", "deflate"):
        raise BadRequest(f"unsupported Content-Encoding {encoding!r} (gzip, deflate or none)")
    d = zlib.decompressobj(wbits=31 if enc == "gzip" else 15)
    try:
        out = d.decompress(body, limit + 1)
    except zlib.error as e:
        raise BadRequest(f"cannot decompress the {enc} body: {e}") from None
    if len(out) > limit:
        raise TooLarge(f"decompressed body exceeds the limit of {limit} bytes")
    if not d.eof:
        raise BadRequest(f"truncated {enc} body")
    return out


def split_body(body: bytes, header_length: str | None) -> tuple[bytes, bytes]:
    """JSON part and binary part, from ``Inference-Header-Content-Length``."""
    if header_length is None:
        return body, b""
    text = header_length.strip()
    if not text.isdigit():
        raise BadRequest(f"Inference-Header-Content-Length must be a non-negative integer, got {header_length!r}")
    n = int(text)
    if n == 0 or n > len(body):
        raise BadRequest(f"Inference-Header-Content-Length {n} is outside the body (length {len(body)})")
    return body[:n], body[n:]


def _reject_constant(name: str) -> float:
    # Python's json accepts NaN/Infinity, which JSON does not have; refuse them at parse time.
    raise BadRequest(f"invalid JSON number {name}")


def parse_json(part: bytes) -> Any:
    try:
        return json.loads(part, parse_constant=_reject_constant)
    except BadRequest:
        raise
    except UnicodeDecodeError:
        raise BadRequest("request JSON is not valid UTF-8") from None
    except RecursionError:
        raise BadRequest("request JSON is nested too deeply") from None
    except ValueError as e:
        raise BadRequest(f"malformed request JSON: {e}") from None


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _json_to_array(name: str, data: Any, dtype: np.dtype, shape: list[int], count: int) -> np.ndarray:
    """JSON tensor data (flat or nested list, row-major) -> array, with strict element types."""
    if not isinstance(data, list):
        raise BadRequest(f"input {name!r}: 'data' must be a list")
    try:
        raw = np.array(data)
    except (ValueError, TypeError, RecursionError):
        raise BadRequest(f"input {name!r}: 'data' is not a regular (non-ragged) list of numbers") from None
    if raw.size != count:
        raise BadRequest(f"input {name!r}: 'data' has {raw.size} elements, shape {shape} needs {count}")
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
        raise BadRequest(f"input {name!r}: 'data' holds {what}, the datatype is {triton_dtype(dtype)}")
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        if raw.min() < info.min or raw.max() > info.max:
            raise BadRequest(f"input {name!r}: value out of range for {triton_dtype(dtype)}")
    return raw.astype(dtype, copy=False).reshape(shape)


def _check_shape(spec: TensorSpec, shape: Any, sig: ModelSignature, limits: Limits) -> list[int]:
    name = spec.name
    if not isinstance(shape, list) or not all(_is_int(d) for d in shape):
        raise BadRequest(f"input {name!r}: 'shape' must be a list of integers")
    if len(shape) != spec.rank:
        raise BadRequest(f"input {name!r}: rank {len(shape)} {shape}, the model expects {spec.describe()}")
    for axis, (want, got) in enumerate(zip(spec.shape, shape)):
        if got < 0:
            raise BadRequest(f"input {name!r}: negative dim {got}")
        if isinstance(want, int) and got != want:
            raise BadRequest(f"input {name!r}: dim {axis} is {got}, the model expects {spec.describe()}")
        if want == BATCH and not 1 <= got <= sig.max_batch_size:
            raise BadRequest(f"input {name!r}: batch {got} is outside 1..{sig.max_batch_size}")
        if want == SEQ:
            max_seq = limits.max_seq or sig.max_seq
            if got < 1 or (max_seq is not None and got > max_seq):
                raise BadRequest(f"input {name!r}: seq {got} is outside 1..{max_seq or 'any'}")
    count = math.prod(shape)  # Python ints: a huge declared shape cannot overflow
    if count > limits.max_tensor_elements:
        raise BadRequest(
            f"input {name!r}: shape {shape} has {count} elements, over the limit of {limits.max_tensor_elements}"
        )
    return shape


def _check_values(spec: TensorSpec, arr: np.ndarray) -> None:
    if arr.dtype.kind == "f" and arr.size and not np.isfinite(arr).all():
        raise BadRequest(f"input {spec.name!r}: holds NaN or infinite values")
    if spec.role == Role.ATTENTION_MASK and arr.size and not np.isin(arr, (0, 1)).all():
        raise BadRequest(f"input {spec.name!r}: an attention mask holds only 0 (padding) and 1 (token)")


def parse_infer_request(
    body: bytes, header_length: str | None, sig: ModelSignature, limits: Limits
) -> InferRequest:
    """Parse and check a whole infer request body against the model's signature."""
    json_part, binary_part = split_body(body, header_length)
    try:
        req = parse_json(json_part)
    except BadRequest as e:
        if header_length is None and b"binary_data_size" in body:
            raise BadRequest(f"{e.message} (binary tensor data needs the Inference-Header-Content-Length header)")
        raise
    if not isinstance(req, dict):
        raise BadRequest("request body must be a JSON object")
    request_id = req.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise BadRequest("'id' must be a string")
    params = req.get("parameters", {})
    if not isinstance(params, dict):
        raise BadRequest("'parameters' must be an object")
    binary_default = params.get("binary_data_output", False)
    if not isinstance(binary_default, bool):
        raise BadRequest("'binary_data_output' must be a boolean")
    timeout = params.get("timeout")
    if timeout is not None and (not _is_int(timeout) or timeout < 0):
        raise BadRequest("'timeout' must be a non-negative integer (microseconds)")

    inputs = req.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise BadRequest("'inputs' must be a non-empty list")
    feeds: dict[str, np.ndarray] = {}
    offset = 0
    total_elements = 0
    for item in inputs:
        if not isinstance(item, dict):
            raise BadRequest("each input must be an object")
        name = item.get("name")
        if not isinstance(name, str):
            raise BadRequest("each input needs a string 'name'")
        spec = sig.input(name)
        if spec is None:
            raise BadRequest(f"unknown input {name!r}; model {sig.name!r} takes {[s.name for s in sig.inputs]}")
        if name in feeds:
            raise BadRequest(f"input {name!r} given twice")
        datatype = item.get("datatype")
        if not isinstance(datatype, str):
            raise BadRequest(f"input {name!r}: 'datatype' must be a string")
        if datatype in UNSUPPORTED_DATATYPES or datatype not in TRITON_TO_NUMPY:
            known = "unsupported" if datatype in UNSUPPORTED_DATATYPES else "unknown"
            raise BadRequest(f"input {name!r}: {known} datatype {datatype!r}")
        want = triton_dtype(spec.dtype)
        if datatype != want:
            raise BadRequest(f"input {name!r}: datatype {datatype}, the model expects {want}")
        dtype = TRITON_TO_NUMPY[datatype]
        shape = _check_shape(spec, item.get("shape"), sig, limits)
        count = math.prod(shape)
        total_elements += count
        if total_elements > limits.max_request_elements:
            raise BadRequest(f"request has more than {limits.max_request_elements} elements in total")
        iparams = item.get("parameters", {})
        if not isinstance(iparams, dict):
            raise BadRequest(f"input {name!r}: 'parameters' must be an object")
        if "shared_memory_region" in iparams:
            raise BadRequest(f"input {name!r}: shared memory is not supported by this server")
        size = iparams.get("binary_data_size")
        has_data = "data" in item
        if size is not None:
            if has_data:
                raise BadRequest(f"input {name!r}: both 'data' and binary_data_size given")
            if not _is_int(size) or size < 0:
                raise BadRequest(f"input {name!r}: binary_data_size must be a non-negative integer")
            expected = count * dtype.itemsize
            if size != expected:
                raise BadRequest(
                    f"input {name!r}: binary_data_size {size}, but shape {shape} of {datatype} is {expected} bytes"
                )
            if offset + size > len(binary_part):
                raise BadRequest(
                    f"input {name!r}: binary data runs past the body ({len(binary_part) - offset} bytes left, "
                    f"{size} needed)"
                )
            arr = np.frombuffer(binary_part, dtype=dtype, count=count, offset=offset).reshape(shape)
            if not arr.flags.aligned:  # an FP16 tensor of odd length shifts the ones after it
                arr = arr.copy()
            offset += size
        elif has_data:
            arr = _json_to_array(name, item["data"], dtype, shape, count)
        else:
            raise BadRequest(f"input {name!r}: no 'data' and no binary_data_size")
        _check_values(spec, arr)
        feeds[name] = arr
    if offset != len(binary_part):
        raise BadRequest(
            f"binary data is {len(binary_part)} bytes but the inputs declare {offset}"
            + ("" if header_length is not None else " (no Inference-Header-Content-Length header)")
        )
    missing = [s.name for s in sig.inputs if s.name not in feeds and s.name not in sig.optional_inputs]
    if missing:
        raise BadRequest(f"missing input(s) {missing} for model {sig.name!r}")
    _check_agreeing_dims(sig, feeds)

    outputs, binary = _parse_requested_outputs(req.get("outputs"), sig, binary_default)
    return InferRequest(request_id, feeds, outputs, binary, binary_default, params)


def _check_agreeing_dims(sig: ModelSignature, feeds: dict[str, np.ndarray]) -> None:
    """Inputs sharing a named dim (batch, seq, ...) must agree on its size."""
    seen: dict[str, tuple[int, str]] = {}
    for spec in sig.inputs:
        arr = feeds.get(spec.name)
        if arr is None:
            continue
        for axis, d in enumerate(spec.shape):
            if isinstance(d, str) and d != "?":
                size = arr.shape[axis]
                if d in seen and seen[d][0] != size:
                    raise BadRequest(
                        f"inputs disagree on {d!r}: {seen[d][1]} has {seen[d][0]}, {spec.name} has {size}"
                    )
                seen.setdefault(d, (size, spec.name))


def _parse_requested_outputs(
    items: Any, sig: ModelSignature, binary_default: bool
) -> tuple[list[str] | None, dict[str, bool]]:
    names = [s.name for s in sig.outputs]
    if items is None:
        return None, {n: binary_default for n in names}
    if not isinstance(items, list):
        raise BadRequest("'outputs' must be a list")
    wanted: list[str] = []
    binary: dict[str, bool] = {}
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise BadRequest("each requested output must be an object with a string 'name'")
        name = item["name"]
        if name not in names:
            raise BadRequest(f"unknown output {name!r}; model {sig.name!r} gives {names}")
        if name in binary:
            raise BadRequest(f"output {name!r} requested twice")
        oparams = item.get("parameters", {})
        if not isinstance(oparams, dict):
            raise BadRequest(f"output {name!r}: 'parameters' must be an object")
        if oparams.get("classification"):
            raise BadRequest(f"output {name!r}: classification outputs are not supported")
        if "shared_memory_region" in oparams:
            raise BadRequest(f"output {name!r}: shared memory is not supported by this server")
        flag = oparams.get("binary_data", binary_default)
        if not isinstance(flag, bool):
            raise BadRequest(f"output {name!r}: 'binary_data' must be a boolean")
        wanted.append(name)
        binary[name] = flag
    return wanted, binary


# --------------------------------------------------------------------------------------
# Responses
# --------------------------------------------------------------------------------------


def encode_infer_response(
    model_name: str,
    model_version: str,
    request: InferRequest,
    outputs: dict[str, np.ndarray],
    order: list[str],
) -> tuple[bytes, int | None]:
    """Response body, and the JSON header's length when binary outputs follow it."""
    names = request.outputs if request.outputs is not None else [n for n in order if n in outputs]
    entries = []
    chunks: list[bytes] = []
    for name in names:
        arr = np.asarray(outputs[name])
        entry: dict[str, Any] = {"name": name, "datatype": triton_dtype(arr.dtype), "shape": list(arr.shape)}
        if request.binary.get(name, request.binary_default):
            data = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<")).tobytes()
            entry["parameters"] = {"binary_data_size": len(data)}
            chunks.append(data)
        else:
            entry["data"] = arr.ravel().tolist()
        entries.append(entry)
    response: dict[str, Any] = {"model_name": model_name, "model_version": model_version, "outputs": entries}
    if request.id is not None:
        response["id"] = request.id
    header = json.dumps(response, separators=(",", ":")).encode()
    if not chunks:
        return header, None
    return header + b"".join(chunks), len(header)


def error_body(message: str) -> bytes:
    return json.dumps({"error": message}).encode()
