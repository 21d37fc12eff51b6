"""What the load-time checks need of an ONNX file's graph, read without its weights.

:func:`graph_outline` gives the first dim of every initializer and the inputs and axis of every ``Gather`` of the
main graph, read from the protobuf wire format with ``os.pread``: each field's key and length, small messages (a node)
read whole, large ones (an initializer's ``raw_data``) skipped by their length. ``onnx.load`` would parse every weight
into memory (a with-past export holds 650 MB inside the file: +650 MB at load, where ONNX Runtime's own session
already holds the weights), and even a read-only ``mmap`` maps the pages it touches (+228 MB of resident pages
measured on SmolLM2's export): ``pread`` reads go through the page cache and count nothing against the process.
The field numbers are onnx.proto's (ModelProto.graph 7; GraphProto.node 1, initializer 5; NodeProto input 1,
op_type 4, attribute 5; AttributeProto name 1, i 3; TensorProto dims 1, name 8).
"""

from __future__ import annotations

import os
from typing import Callable, Iterator

#: A node (or any message) shorter than this is read in one call and parsed in memory.
SMALL = 1 << 16

Reader = Callable[[int, int], bytes]  # (offset, size) -> bytes
Span = tuple[int, int]  # a length-delimited field's (start, end) in the file
#: A field's value: a varint's int, a length-delimited field's span, None for a fixed-width one.
Value = int | Span | None


def graph_outline(path: str | os.PathLike[str]) -> tuple[dict[str, int], list[tuple[str, str, int]]]:
    """``({initializer: its first dim}, [(data, indices, axis) of each Gather])`` of the file's main graph."""
    fd = os.open(path, os.O_RDONLY)
    try:
        def read(at: int, size: int) -> bytes:
            return os.pread(fd, size, at)

        size = os.fstat(fd).st_size
        # A span value is a length-delimited field (wire type 2): the graph, an initializer, a node.
        graph = next((v for n, _, v in _fields(read, 0, size) if n == 7 and isinstance(v, tuple)), (0, 0))
        tables: dict[str, int] = {}
        gathers: list[tuple[str, str, int]] = []
        for number, _, span in _fields(read, *graph):
            if number == 5 and isinstance(span, tuple):
                name, rows = _initializer(read, span)
                if name is not None and rows is not None:
                    tables[name] = rows
            elif number == 1 and isinstance(span, tuple):
                gather = _gather(*_in_memory(read, span))
                if gather is not None:
                    gathers.append(gather)
        return tables, gathers
    finally:
        os.close(fd)


def _in_memory(read: Reader, span: Span) -> tuple[Reader, int, int]:
    """A small message read whole: a reader over its bytes and its span there."""
    data = read(span[0], span[1] - span[0]) if span[1] - span[0] <= SMALL else None
    if data is None:
        return read, span[0], span[1]
    return (lambda at, size: data[at:at + size]), 0, len(data)


def _initializer(read: Reader, span: Span) -> tuple[str | None, int | None]:
    name: str | None = None
    rows: int | None = None
    for n, _, v in _fields(read, *span):
        if n == 8 and isinstance(v, tuple):
            name = read(v[0], v[1] - v[0]).decode("utf-8", "replace")
        elif n == 1 and rows is None and v is not None:
            rows = v if isinstance(v, int) else _varint(read(v[0], 10), 0)[0]  # packed dims: the first one
    return name, rows


def _gather(read: Reader, start: int, end: int) -> tuple[str, str, int] | None:
    inputs: list[str] = []
    op: str | None = None
    axis = 0
    for n, _, v in _fields(read, start, end):
        if not isinstance(v, tuple):  # only length-delimited fields (wire type 2) are read here
            continue
        if n == 1:
            inputs.append(read(v[0], v[1] - v[0]).decode("utf-8", "replace"))
        elif n == 4:
            op = read(v[0], v[1] - v[0]).decode("utf-8", "replace")
        elif n == 5:
            attr = {an: av for an, _, av in _fields(read, *v) if an in (1, 3)}
            name = attr.get(1)
            value = attr.get(3, 0)
            if isinstance(name, tuple) and read(name[0], name[1] - name[0]) == b"axis" and isinstance(value, int):
                axis = value - (1 << 64) if value >= 1 << 63 else value  # an int64 written as a varint
    return (inputs[0], inputs[1], axis) if op == "Gather" and len(inputs) == 2 else None


def _fields(read: Reader, start: int, end: int) -> Iterator[tuple[int, int, Value]]:
    """``(field number, wire type, value)`` of a message: a varint's value, a length-delimited field's
    ``(start, end)``, None for fixed-width fields."""
    while start < end:
        head = read(start, 20)
        key, i = _varint(head, 0)
        kind = key & 7
        value: Value
        if kind == 0:
            value, i = _varint(head, i)
            start += i
        elif kind == 2:
            size, i = _varint(head, i)
            value, start = (start + i, start + i + size), start + i + size
        elif kind in (1, 5):
            value, start = None, start + i + (8 if kind == 1 else 4)
        else:
            raise ValueError(f"not an ONNX protobuf: wire type {kind} at byte {start}")
        yield key >> 3, kind, value


def _varint(buf: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= len(buf):
            raise ValueError("not an ONNX protobuf: a varint runs past its message")
        byte = buf[at]
        at += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, at
