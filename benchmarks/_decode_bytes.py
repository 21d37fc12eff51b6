"""Bytes of weights one decode step reads, per contender's files, and a stream-copy bandwidth probe: the figure of
merit of ``bench_decode.py`` (decode at batch 1 reads every weight once per token, so ms/token can not be below
bytes / bandwidth).

- ONNX (attnx, onnxruntime-genai): the initializers' bytes (the ``.onnx`` file and its external data), less those
  that only a ``Gather`` / ``GatherBlockQuantized`` reads (the embedding table: one row per token), through the
  ``Reshape`` of its scales. A table that a tied lm_head also reads counts in full.
- GGUF (llama.cpp): the tensors' bytes, less ``token_embd.weight`` when an ``output.weight`` is there (untied: the
  table is only gathered); tied, llama.cpp's head reads the table.
- Other folders (CTranslate2, transformers): the weight files' size as they are (an upper bound).

The KV cache a step also reads (a few MB at these lengths for SmolLM2-135M) is not counted.
"""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

_GATHERS = {"Gather", "GatherBlockQuantized"}


def onnx_bytes(path: Path) -> dict:
    """``{"file": bytes on disk, "read": bytes a step reads}`` of an ONNX file (module doc)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    graph = model.graph
    users: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            users.setdefault(name, []).append(node)

    def gathered_only(name: str, depth: int = 0) -> bool:  # every use ends in a Gather's data input
        uses = users.get(name, [])
        return bool(uses) and depth < 3 and all(
            (n.op_type in _GATHERS and n.input[0] == name) or
            (n.op_type in _GATHERS and n.op_type == "GatherBlockQuantized" and name in n.input[2:]) or
            (n.op_type == "Reshape" and n.input[0] == name and gathered_only(n.output[0], depth + 1)) for n in uses)

    total = read = 0
    for t in graph.initializer:
        itemsize = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize
        size = int(np.prod(t.dims, dtype=np.int64)) * itemsize
        if t.data_type in (onnx.TensorProto.UINT4, onnx.TensorProto.INT4):
            size = (size + 1) // 2
        total += size
        read += 0 if gathered_only(t.name) else size
    files = [f for f in path.parent.iterdir() if f.name.startswith(path.name)]
    return {"file": sum(f.stat().st_size for f in files), "weights": total, "read": read}


def gguf_bytes(path: Path) -> dict:
    import gguf

    tensors = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors}
    untied = "output.weight" in tensors
    read = sum(n for name, n in tensors.items() if not (untied and name == "token_embd.weight"))
    return {"file": path.stat().st_size, "weights": sum(tensors.values()), "read": read}


def folder_bytes(folder: Path) -> dict:
    size = sum(f.stat().st_size for f in folder.iterdir() if f.suffix in (".bin", ".safetensors", ".data", ".onnx"))
    return {"file": size, "weights": size, "read": size}


def weight_bytes(kind: str, model: Path) -> dict:
    """Bytes a decode step of ``kind``'s worker reads from ``model`` (``_decode_worker.py``'s kinds)."""
    if kind == "attnx":
        return onnx_bytes(model)
    if kind == "genai":
        return onnx_bytes(Path(model) / "model.onnx") if (Path(model) / "model.onnx").exists() else folder_bytes(model)
    if kind == "llama-cpp":
        return gguf_bytes(model)
    return folder_bytes(model)


def copy_bandwidth(threads: int, mb: int = 512, rounds: int = 7) -> dict:
    """Stream copy (``b[:] = a`` over ``mb`` MB, far beyond any L3) split over ``threads`` threads (numpy's copy
    releases the GIL): GB/s counted as STREAM does, bytes read + bytes written; the median of ``rounds``."""
    n = mb * 2**20 // 8
    a, b = np.ones(n), np.empty(n)
    chunks = [slice(i * n // threads, (i + 1) * n // threads) for i in range(threads)]
    rates = []
    with ThreadPoolExecutor(threads) as pool:
        def one(s):
            np.copyto(b[s], a[s])
        list(pool.map(one, chunks))  # first touch of b's pages
        for _ in range(rounds):
            t = time.perf_counter()
            list(pool.map(one, chunks))
            rates.append(2 * a.nbytes / (time.perf_counter() - t) / 1e9)
    return {"gb_s": statistics.median(rates), "rounds": rates, "mb": mb, "threads": threads}
