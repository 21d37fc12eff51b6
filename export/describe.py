"""Describe any ONNX file: I/O, opsets, custom ops (and whether each has a body), metadata, size."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx

from attnx.contract import PREFIX, ContractError, load_onnx


def _dims(vi: onnx.ValueInfoProto) -> list:
    t = vi.type.tensor_type
    if not t.HasField("shape"):
        return ["?"]
    return [d.dim_param or (d.dim_value if d.HasField("dim_value") else "?") for d in t.shape.dim]


def _dtype(vi: onnx.ValueInfoProto) -> str:
    et = vi.type.tensor_type.elem_type
    return onnx.TensorProto.DataType.Name(et).lower() if et else "?"


def describe_model(path: str | Path) -> dict:
    """A plain-dict description of the model at ``path`` (external data is not loaded)."""
    path = Path(path)
    model = load_onnx(path)  # one clear error for a missing, empty (it would parse as an empty model) or bad file
    if not model.graph.node and not model.graph.input and not model.graph.output:
        raise ContractError(f"{path} holds no graph: not an ONNX model")
    graph = model.graph
    initializer_names = {t.name for t in graph.initializer}
    params = sum(int(np.prod(t.dims)) if t.dims else 1 for t in graph.initializer)
    functions = {(f.domain, f.name) for f in model.functions}
    custom = {}
    op_counts: dict[str, int] = {}
    for node in graph.node:
        key = f"{node.domain}::{node.op_type}" if node.domain not in ("", "ai.onnx") else node.op_type
        op_counts[key] = op_counts.get(key, 0) + 1
        if node.domain not in ("", "ai.onnx"):
            entry = custom.setdefault(key, {"domain": node.domain, "op": node.op_type, "count": 0,
                                            "function_body": (node.domain, node.op_type) in functions,
                                            "schema": onnx.defs.has(node.op_type, node.domain)})
            entry["count"] += 1
    return {
        "path": str(path),
        "ir_version": model.ir_version,
        "producer": f"{model.producer_name} {model.producer_version}".strip(),
        "opsets": {(o.domain or "ai.onnx"): o.version for o in model.opset_import},
        "inputs": [{"name": i.name, "dtype": _dtype(i), "shape": _dims(i)} for i in graph.input
                   if i.name not in initializer_names],
        "outputs": [{"name": o.name, "dtype": _dtype(o), "shape": _dims(o)} for o in graph.output],
        "nodes": len(graph.node),
        "op_counts": dict(sorted(op_counts.items())),
        "custom_ops": list(custom.values()),
        "functions": [f"{d}::{n}" for d, n in sorted(functions)],
        "parameters": params,
        "external_data": any(t.data_location == onnx.TensorProto.EXTERNAL for t in graph.initializer),
        "metadata": {p.key: p.value for p in model.metadata_props},
        "attnx": any(p.key.startswith(PREFIX) for p in model.metadata_props),
    }
