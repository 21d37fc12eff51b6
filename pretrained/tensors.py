"""Reading a checkpoint one tensor at a time: what a streamed export binds its weights to.

    source = source_of(folder)                # safetensors shards (or a .bin), or a GGUF's tensors
    source.infos()["model.norm.weight"]       # TensorInfo(shape, dtype) from the headers, nothing read
    source.read("lm_head.weight")             # one tensor, in fresh memory, in its own dtype (bf16 stays bf16)
    source.blocks(name)                       # MatMulNBits blocks carried over as they are (GGUF Q4_0/Q8_0), or None

A safetensors tensor is read with ``os.pread`` into a new buffer, never through a memory map, so the
pages read do not stay in the process's RSS (the page cache keeps them, shared and reclaimable). A
``.bin`` checkpoint is memory-mapped by ``torch.load(mmap=True)``; each tensor read is cloned out of it.

A GGUF-backed folder (a folder in attnx's cache with ``config.json``, the tokenizer files and
:data:`GGUF_POINTER`, no weights) reads from the GGUF itself (:mod:`attnx.pretrained.gguf_tensors`).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

from attnx.pretrained.gguf_marker import MARKER
from attnx.pretrained.tensor_types import Blocks, TensorInfo, TensorSource

#: The file naming the GGUF a folder's weights come from (:data:`attnx.pretrained.gguf_marker.MARKER`).
GGUF_POINTER = MARKER
#: safetensors dtype -> torch dtype name.
_TORCH = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64", "I64": "int64", "I32": "int32",
          "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


class SafetensorsSource:
    """The tensors of safetensors files (one or a folder's shards), each read with ``os.pread``."""

    def __init__(self, files: list[Path]):
        self._where: dict[str, tuple[Path, int, int]] = {}  # name -> (file, offset, bytes)
        self._infos: dict[str, TensorInfo] = {}
        for path in files:
            with open(path, "rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                if not 0 < size <= 100 << 20:
                    raise ValueError(f"{path}: not a safetensors file (header size {size})")
                header = json.loads(f.read(size))
            start = 8 + size
            for name, entry in header.items():
                if name == "__metadata__" or not isinstance(entry, dict):
                    continue
                begin, end = entry["data_offsets"]
                self._where[name] = (path, start + int(begin), int(end) - int(begin))
                self._infos[name] = TensorInfo(tuple(int(d) for d in entry["shape"]), str(entry["dtype"]))
        self._fds: dict[Path, int] = {}

    def infos(self) -> dict[str, TensorInfo]:
        return dict(self._infos)

    def read(self, name: str):
        import torch

        path, offset, nbytes = self._where[name]
        info = self._infos[name]
        if info.dtype not in _TORCH:
            raise ValueError(f"{path}: tensor {name} has dtype {info.dtype}, which attnx does not read")
        out = torch.empty(info.shape, dtype=getattr(torch, _TORCH[info.dtype]))
        self._pread(path, out, offset, nbytes, name)
        return out

    def read_rows(self, name: str, start: int, stop: int):
        """Rows ``start:stop`` of a tensor (along its first axis), read alone: what quantization reads a chunk
        at a time, so a large table is never whole in memory."""
        import torch

        path, offset, nbytes = self._where[name]
        info = self._infos[name]
        rows = info.shape[0] if info.shape else 1
        row_bytes = nbytes // max(1, rows)
        stop = min(stop, rows)
        out = torch.empty((max(0, stop - start), *info.shape[1:]), dtype=getattr(torch, _TORCH[info.dtype]))
        self._pread(path, out, offset + start * row_bytes, (stop - start) * row_bytes, name)
        return out

    def _pread(self, path: Path, out, offset: int, nbytes: int, name: str) -> None:
        import torch

        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = os.open(path, os.O_RDONLY)
        view = memoryview(out.view(torch.uint8).reshape(-1).numpy()) if nbytes else memoryview(b"")
        done = 0
        while done < nbytes:  # pread may return less than asked (large reads)
            got = os.preadv(fd, [view[done:]], offset + done)
            if got <= 0:
                raise ValueError(f"{path}: truncated at tensor {name}")
            done += got

    def blocks(self, name: str) -> Blocks | None:
        return None

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


class TorchFileSource:
    """The tensors of ``pytorch_model.bin`` files (``weights_only``, memory-mapped), each cloned when read."""

    def __init__(self, files: list[Path]):
        import torch

        self._tensors = {}
        for path in files:
            state = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
            self._tensors.update({k: v for k, v in state.items() if hasattr(v, "dtype")})

    def infos(self) -> dict[str, TensorInfo]:
        return {k: TensorInfo(tuple(v.shape), {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}.get(
            str(v.dtype).replace("torch.", ""), str(v.dtype))) for k, v in self._tensors.items()}

    def read(self, name: str):
        return self._tensors[name].clone()

    def blocks(self, name: str) -> Blocks | None:
        return None

    def close(self) -> None:
        self._tensors = {}


def gguf_pointer(folder: Path) -> dict | None:
    """The GGUF a GGUF-backed folder reads from (:data:`GGUF_POINTER`), or None for a folder with weights."""
    pointer = Path(folder) / GGUF_POINTER
    if not pointer.is_file():
        return None
    data = json.loads(pointer.read_text())
    if not isinstance(data, dict) or not isinstance(data.get("gguf"), str):
        raise ValueError(f"{pointer}: expected {{\"gguf\": path, ...}}")
    return data


def source_of(folder) -> TensorSource:
    """The tensor source of an :class:`~attnx.pretrained.folder.HFFolder` (see the module doc)."""
    pointer = gguf_pointer(folder.path)
    if pointer is not None:
        from attnx.pretrained.gguf_tensors import GgufSource

        return GgufSource.for_folder(folder.path)  # the folder's config; one line if the GGUF changed since
    files = list(folder.weights)
    if files and all(f.suffix == ".safetensors" for f in files):
        return SafetensorsSource(files)
    return TorchFileSource(files)
