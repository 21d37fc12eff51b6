"""KServe v2 over HTTP: request bodies (JSON tensors and the binary tensor extension) in, response bodies out.

Pure functions, no HTTP framework. :func:`parse_infer_request` splits a body into
:class:`~attnx.runtime.protocol.WireTensor` items and hands them to
:func:`~attnx.runtime.protocol.build_infer_request`, which checks them against the model.

Binary tensor data extension: the body is a JSON header followed by raw little-endian tensor bytes;
the ``Inference-Header-Content-Length`` HTTP header gives the JSON part's length, and each binary
input says its ``parameters.binary_data_size``, in the order the inputs are listed. Text (``BYTES``)
goes as JSON strings, or binary as 4-byte little-endian lengths each followed by the UTF-8 bytes.
"""

from __future__ import annotations

import json
import zlib
from typing import Any

import numpy as np

from attnx.runtime.protocol import (
    BadRequest,
    InferRequest,
    Limits,
    ModelSignature,
    TooLarge,
    WireTensor,
    build_infer_request,
    triton_dtype,
)


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


def parse_infer_request(body: bytes, header_length: str | None, sig: ModelSignature, limits: Limits) -> InferRequest:
    """Parse and check a whole HTTP infer request body against the model's signature."""
    json_part, binary_part = split_body(body, header_length)
    try:
        req = parse_json(json_part)
    except BadRequest as e:
        if header_length is None and b"binary_data_size" in body:
            raise BadRequest(f"{e.message} (binary tensor data needs the Inference-Header-Content-Length header)")
        raise
    if not isinstance(req, dict):
        raise BadRequest("request body must be a JSON object")
    inputs = req.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise BadRequest("'inputs' must be a non-empty list")
    binary = memoryview(binary_part)
    tensors: list[WireTensor] = []
    offset = 0
    for item in inputs:
        if not isinstance(item, dict):
            raise BadRequest("each input must be an object")
        name = item.get("name")
        if not isinstance(name, str):
            raise BadRequest("each input needs a string 'name'")
        params = item.get("parameters", {})
        if not isinstance(params, dict):
            raise BadRequest(f"input {name!r}: 'parameters' must be an object")
        tensor = WireTensor(name, item.get("datatype"), item.get("shape"), params)
        size = params.get("binary_data_size")
        if size is not None:
            if "data" in item:
                raise BadRequest(f"input {name!r}: both 'data' and binary_data_size given")
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise BadRequest(f"input {name!r}: binary_data_size must be a non-negative integer")
            if offset + size > len(binary):
                raise BadRequest(f"input {name!r}: binary data runs past the body ({len(binary) - offset} bytes "
                                 f"left, {size} needed)")
            tensor.raw = binary[offset:offset + size]
            offset += size
        elif "data" in item:
            tensor.data = item["data"] if item["data"] is not None else _not_a_list(name)
        tensors.append(tensor)
    if offset != len(binary):
        raise BadRequest(
            f"binary data is {len(binary)} bytes but the inputs declare {offset}"
            + ("" if header_length is not None else " (no Inference-Header-Content-Length header)")
        )
    return build_infer_request(req.get("id"), req.get("parameters", {}), tensors, req.get("outputs"), sig, limits)


def _not_a_list(name: str):
    raise BadRequest(f"input {name!r}: 'data' must be a list")


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
