"""KServe v2 over HTTP: request bodies (JSON tensors and the binary tensor extension) in, response bodies out.

Pure functions, no HTTP framework. :func:`parse_infer_request` splits a body into
:class:`~attnx.runtime.apis.kserve_tensors.WireTensor` items and hands them to
:func:`~attnx.runtime.apis.kserve_tensors.build_infer_request`, which checks them against the model.

Binary tensor data extension: the body is a JSON header followed by raw little-endian tensor bytes;
the ``Inference-Header-Content-Length`` HTTP header gives the JSON part's length, and each binary
input says its ``parameters.binary_data_size``, in the order the inputs are listed. Text (``BYTES``)
goes as JSON strings, or binary as 4-byte little-endian lengths each followed by the UTF-8 bytes.
"""

from __future__ import annotations

import re
import secrets
import time
import zlib
from typing import Any, Iterator

import numpy as np
import orjson

from attnx.runtime.apis.kserve_tensors import InferRequest, WireTensor, build_infer_request
from attnx.runtime.serving.signature import ModelSignature, triton_dtype
from attnx.runtime.wire.counts import check_json
from attnx.runtime.wire.errors import Kind, ProtocolError, bad_input, too_large
from attnx.runtime.wire.limits import Limits


def decompress(body: bytes, encoding: str | None, limit: int) -> bytes:
    """Undo ``Content-Encoding: gzip|deflate`` with a bound on the output (no zip bombs)."""
    if not encoding or encoding.lower() == "identity":
        return body
    enc = encoding.lower()
    if enc not in ("gzip", "deflate"):
        raise bad_input(f"unsupported Content-Encoding {encoding!r} (gzip, deflate or none)")
    d = zlib.decompressobj(wbits=31 if enc == "gzip" else 15)
    try:
        out = d.decompress(body, limit + 1)
    except zlib.error as e:
        raise bad_input(f"cannot decompress the {enc} body: {e}") from None
    if len(out) > limit:
        raise too_large(f"decompressed body exceeds the limit of {limit} bytes")
    if not d.eof:
        raise bad_input(f"truncated {enc} body")
    return out


def split_body(body: bytes, header_length: str | None) -> tuple[bytes, bytes]:
    """JSON part and binary part, from ``Inference-Header-Content-Length``."""
    if header_length is None:
        return body, b""
    text = header_length.strip()
    if not text.isdigit():
        raise bad_input(f"Inference-Header-Content-Length must be a non-negative integer, got {header_length!r}")
    n = int(text)
    if n == 0 or n > len(body):
        raise bad_input(f"Inference-Header-Content-Length {n} is outside the body (length {len(body)})")
    return body[:n], body[n:]


#: ``"data"`` then ``:`` and ``[`` with optional whitespace: where a list of numbers may start.
_DATA_KEY = re.compile(rb'"data"\s*:\s*\[')
#: What a flat list of JSON numbers is made of; a list holding anything else takes the plain parse.
_NUMBER_CHARS = b"0123456789+-.eE, \t\r\n"
#: What stands in for such a list while the rest of the body is parsed (random: clients cannot forge it).
_MARK = "\x00attnx-numbers-" + secrets.token_hex(8) + "-"
#: Bodies under _SMALL_BODY are parsed in one go (their Python objects are small; scanning costs CPU).
#: In bigger ones, lists of at least _MIN_LIST bytes of text are decoded in slices of about _SLICE bytes,
#: so a list never exists as millions of Python floats at once. Between slices the decoding thread lets
#: the GIL go (_yield): every C call here holds it, and one long hold (a regex over 30 MB held it 76 ms)
#: stalls the event loop's every socket read behind it, so 503s to other clients waited up to a second.
_SMALL_BODY, _MIN_LIST, _SLICE = 1 << 20, 16 << 10, 256 << 10


def _yield() -> None:
    time.sleep(0)  # releases the GIL: a thread waiting for it (the event loop) runs now, not in 5+ ms


def _number_lists(part) -> list[tuple[int, int]]:
    """``(start, end)`` of each ``"data": [...]`` list of at least _MIN_LIST bytes with no ``[`` inside, found
    with ``find`` (C, no per-byte Python) a slice at a time; what it holds is judged when it is decoded."""
    spans, pos = [], 0
    while (key := part.find(b'"data"', pos)) >= 0:
        head = _DATA_KEY.match(part, key, key + 64)
        if head is None:
            pos = key + 6
            continue
        start = head.end()
        end = part.find(b"]", start)
        if end < 0:
            break
        if end - start >= _MIN_LIST and part.find(b"[", start, end) < 0:
            spans.append((start, end))
        pos = end + 1
        _yield()
    return spans


def _count(part, value: bytes, start: int, end: int) -> int:
    """``part.count(value, start, end)`` in slices, letting the GIL go between them."""
    total = 0
    for pos in range(start, end, _SLICE):
        total += part.count(value, pos, min(end, pos + _SLICE))
        _yield()
    return total


def _loads(part) -> Any:
    """Strict RFC 8259 JSON (orjson: no NaN/Infinity, no numbers that overflow a double, depth <= 1024)."""
    try:
        return orjson.loads(part)
    except orjson.JSONDecodeError as e:
        message = str(e)
        if "UTF-8" in message or "surrogate" in message:
            raise bad_input(f"request JSON is not valid UTF-8 ({message})") from None
        if "depth limit" in message:
            raise bad_input("request JSON is nested too deeply") from None
        raise bad_input(f"malformed request JSON: {message}") from None


def parse_json(part) -> Any:
    """The request JSON, with every long flat numeric ``"data"`` list decoded straight to a numpy array
    (int64 or float64, as the plain parse would give) without a Python object per element."""
    if len(part) < _SMALL_BODY:
        return _loads(part)
    found = _number_lists(part)
    if not found:
        return _loads(part)
    pieces, pos, spans = [], 0, {}
    for i, (start, end) in enumerate(found):
        key = f"{_MARK}{i}"
        pieces += [part[pos:start - 1], orjson.dumps(key)]  # a JSON string in place of the "[...]"
        spans[key] = (start, end)
        pos = end + 1
    pieces.append(part[pos:])
    tree = _loads(b"".join(pieces))
    inputs = tree.get("inputs") if isinstance(tree, dict) else None
    for item in inputs if isinstance(inputs, list) else ():
        data = item.get("data") if isinstance(item, dict) else None
        if isinstance(data, str) and data in spans:
            item["data"] = _decode_numbers(part, *spans[data], _NARROW.get(item.get("datatype")))
            if item["data"] is None:  # something the fast path does not judge: the plain parse says what
                return _loads(part)
    return tree


#: Float inputs whose numbers are stored straight into their own dtype, slice by slice: no float64 copy
#: of the whole tensor (a value past the dtype's range becomes inf there, which the finite check refuses,
#: as the cast after a float64 parse did). Integers stay int64 so out-of-range values are still caught.
_NARROW: dict[str, np.dtype] = {"FP32": np.dtype(np.float32), "FP16": np.dtype(np.float16)}


def _decode_numbers(part, start: int, end: int, narrow: np.dtype | None = None) -> np.ndarray | None:
    """``part[start:end]`` (comma-separated JSON numbers) -> int64/float64 array (or ``narrow``, a float
    dtype, when given), one slice at a time."""
    count = _count(part, b",", start, end) + 1
    out, filled, pos = None, 0, start
    while pos < end:
        stop = end if end - pos <= _SLICE else part.find(b",", pos + _SLICE, end)
        stop = end if stop < 0 else stop
        text = part[pos:stop]
        if text.translate(None, _NUMBER_CHARS):
            return None  # strings, objects, literals: the plain parse judges them
        values = np.array(_loads(b"[" + text + b"]"))
        if values.dtype.kind not in "if" or filled + values.size > count:
            return None  # huge integers (object / uint64) or a malformed list
        if out is None and narrow is not None:
            out = np.empty(count, narrow)
        if out is None or (out.dtype.kind == "i" and values.dtype.kind == "f"):
            out = (np.empty(count, values.dtype) if out is None else out.astype(np.float64))
        out[filled:filled + values.size] = values
        filled += values.size
        pos = stop + 1
        _yield()
    return out if out is not None and filled == count else None


def parse_infer_request(body: bytes, header_length: str | None, sig: ModelSignature, limits: Limits,
                        where: str = "infer") -> InferRequest:
    """Parse and check a whole HTTP infer request body against the model's signature. Its JSON part is first
    held to the strings a KServe body may carry (:func:`~attnx.runtime.wire.counts.check_json`: ``BYTES`` texts;
    numbers are not bounded there, tensors legitimately hold millions)."""
    json_part, binary_part = split_body(body, header_length)
    check_json(json_part, limits.json_bound("kserve"), where)
    try:
        req = parse_json(json_part)
    except ProtocolError as e:
        if header_length is None and b"binary_data_size" in body:
            raise bad_input(f"{e.message} (binary tensor data needs the Inference-Header-Content-Length header)")
        raise
    if not isinstance(req, dict):
        raise bad_input("request body must be a JSON object")
    inputs = req.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise bad_input("'inputs' must be a non-empty list")
    binary = memoryview(binary_part)
    tensors: list[WireTensor] = []
    offset = 0
    for item in inputs:
        if not isinstance(item, dict):
            raise bad_input("each input must be an object")
        name = item.get("name")
        if not isinstance(name, str):
            raise bad_input("each input needs a string 'name'")
        params = item.get("parameters", {})
        if not isinstance(params, dict):
            raise bad_input(f"input {name!r}: 'parameters' must be an object")
        datatype = item.get("datatype")
        if not isinstance(datatype, str):  # the message kserve_tensors' head check gives a transport's tensor
            raise bad_input(f"input {name!r}: 'datatype' must be a string")
        tensor = WireTensor(name, datatype, item.get("shape"), params)
        size = params.get("binary_data_size")
        if size is not None:
            if "data" in item:
                raise bad_input(f"input {name!r}: both 'data' and binary_data_size given")
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise bad_input(f"input {name!r}: binary_data_size must be a non-negative integer")
            if offset + size > len(binary):
                raise bad_input(f"input {name!r}: binary data runs past the body ({len(binary) - offset} bytes "
                                 f"left, {size} needed)")
            tensor.raw = binary[offset:offset + size]
            offset += size
        elif "data" in item:
            tensor.data = item["data"] if item["data"] is not None else _not_a_list(name)
        tensors.append(tensor)
    if offset != len(binary):
        raise bad_input(
            f"binary data is {len(binary)} bytes but the inputs declare {offset}"
            + ("" if header_length is not None else " (no Inference-Header-Content-Length header)")
        )
    return build_infer_request(req.get("id"), req.get("parameters", {}), tensors, req.get("outputs"), sig, limits)


def _not_a_list(name: str):
    raise bad_input(f"input {name!r}: 'data' must be a list")


def non_finite(name: str, feeds: dict[str, np.ndarray]) -> ProtocolError:
    """A JSON output holds NaN or an infinity, which JSON (RFC 8259) has no way to write. Inputs are checked
    finite before they run, so the request's own values drove the model past float range (a smal ``trace``
    of 3e38): the client's input, ``unprocessable`` (422), not a server error."""
    return ProtocolError(Kind.UNPROCESSABLE, f"output {name!r} holds NaN or infinite values: this request's inputs"
                                             f"{_largest_input(feeds)} took the model past float range, and JSON "
                                             f"cannot carry the result; send smaller values, or ask for the output "
                                             f"as binary data (parameters.binary_data: true) to get it as it is")


def encode_infer_response(model_name: str, model_version: str, request: InferRequest, outputs: dict[str, np.ndarray],
                          order: list[str]) -> tuple[bytes, int | None]:
    """Response body, and the JSON header's length when binary outputs follow it.

    JSON ``data`` is written by orjson straight from the array (no Python object per element). NaN and
    infinities have no JSON form: such an output is refused (:func:`non_finite`) rather than sent
    as the non-standard ``NaN`` tokens browsers and strict clients reject; as binary data they go as-is.
    """
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
            if arr.dtype.kind == "f" and not np.isfinite(arr).all():
                raise non_finite(name, request.feeds)
            entry["data"] = np.ascontiguousarray(arr).reshape(-1)
        entries.append(entry)
    response: dict[str, Any] = {"model_name": model_name, "model_version": model_version, "outputs": entries}
    if request.id is not None:
        response["id"] = request.id
    header = orjson.dumps(response, option=orjson.OPT_SERIALIZE_NUMPY)
    if not chunks:
        return header, None
    return header + b"".join(chunks), len(header)


#: Elements per piece of a streamed JSON response (about 1 MB of text).
_STREAM_ELEMENTS = 64 << 10


def stream_json_response(model_name: str, model_version: str, request: InferRequest, outputs: dict[str, np.ndarray],
                         order: list[str]) -> Iterator[bytes] | None:
    """The JSON response (every output as JSON data) as pieces of about 1 MB, for a body too big to build
    whole: six concurrent 30 MB answers would otherwise each exist as one bytes object until sent. None
    when some output goes as binary data (that body is mostly raw bytes already). Outputs are checked
    before the first piece (:func:`non_finite`), so a refusal is still a whole error response."""
    names = request.outputs if request.outputs is not None else [n for n in order if n in outputs]
    if any(request.binary.get(n, request.binary_default) for n in names):
        return None
    arrays = [(n, np.asarray(outputs[n])) for n in names]
    for name, arr in arrays:
        if arr.dtype.kind == "f" and not np.isfinite(arr).all():
            raise non_finite(name, request.feeds)

    def pieces() -> Iterator[bytes]:
        head = {"model_name": model_name, "model_version": model_version}
        if request.id is not None:
            head["id"] = request.id
        yield orjson.dumps(head)[:-1] + b',"outputs":['
        for i, (name, arr) in enumerate(arrays):
            entry = orjson.dumps({"name": name, "datatype": triton_dtype(arr.dtype), "shape": list(arr.shape)})
            yield (b"," if i else b"") + entry[:-1] + b',"data":['
            flat = np.ascontiguousarray(arr).reshape(-1)
            for start in range(0, flat.size, _STREAM_ELEMENTS):
                text = orjson.dumps(flat[start:start + _STREAM_ELEMENTS], option=orjson.OPT_SERIALIZE_NUMPY)
                yield (b"," if start else b"") + text[1:-1]
            yield b"]}"
        yield b"]}"

    return pieces()


def _largest_input(feeds: dict[str, np.ndarray]) -> str:
    """`` (largest |value|: 3e+38 in 'trace')`` over the float inputs, or nothing when there are none."""
    found = [(float(np.abs(a).max()), n) for n, a in feeds.items() if a.dtype.kind == "f" and a.size]
    if not found:
        return ""
    value, name = max(found)
    return f" (largest |value|: {value:.3g} in {name!r})"

