"""The ``attnx.*`` metadata_props of an exported file: what it is and how to feed it.

Keys (docs/contracts.md): ``attnx.variant``, ``attnx.config`` (JSON), ``attnx.version``,
``attnx.lowering``, ``attnx.precision``, ``attnx.inputs`` / ``attnx.outputs`` (JSON
lists of ``{name, role, dtype, shape}``), ``attnx.profiles`` (JSON
``{"batch": [min, opt, max], "seq": [...]}``), ``attnx.weights`` (the safetensors
file beside the model, for the PyTorch reference in ``attnx check``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import onnx

import attnx

PREFIX = "attnx."


def _dtype_name(elem_type: int) -> str:
    return onnx.helper.tensor_dtype_to_np_dtype(elem_type).name


def _value_infos(values, roles: dict[str, str]) -> list[dict]:
    out = []
    for vi in values:
        t = vi.type.tensor_type
        shape = [d.dim_param if d.dim_param else d.dim_value for d in t.shape.dim]
        out.append({"name": vi.name, "role": roles.get(vi.name, "context"), "dtype": _dtype_name(t.elem_type),
                    "shape": shape})
    return out


@dataclass
class ModelInfo:
    variant: str
    config: dict
    lowering: str
    precision: str
    inputs: list[dict]
    outputs: list[dict]
    profiles: dict
    version: str = attnx.__version__
    weights: str | None = None
    extra: dict = field(default_factory=dict)

    @classmethod
    def for_encoder(cls, model, *, lowering: str, precision: str, profiles: dict, proto: onnx.ModelProto,
                    weights: str | None) -> "ModelInfo":
        roles = {s.name: s.role for s in model.input_specs()}
        roles.update({"output": "output", "maw_depth": "aux"})
        return cls(variant=model.variant, config=model.config_dict(), lowering=lowering, precision=precision,
                   inputs=_value_infos(proto.graph.input, roles), outputs=_value_infos(proto.graph.output, roles),
                   profiles=profiles, weights=weights)

    def input(self, name: str) -> dict:
        return next(i for i in self.inputs if i["name"] == name)


def write_metadata(model: onnx.ModelProto, info: ModelInfo) -> None:
    """Replace the ``attnx.*`` entries of ``model.metadata_props`` with ``info``."""
    keep = [p for p in model.metadata_props if not p.key.startswith(PREFIX)]
    del model.metadata_props[:]
    model.metadata_props.extend(keep)
    for key, value in asdict(info).items():
        if key == "extra":
            for k, v in value.items():
                model.metadata_props.add(key=PREFIX + k, value=v if isinstance(v, str) else json.dumps(v))
            continue
        if value is None:
            continue
        model.metadata_props.add(key=PREFIX + key, value=value if isinstance(value, str) else json.dumps(value))


def read_metadata(model: onnx.ModelProto | str | Path) -> ModelInfo | None:
    """The attnx metadata of a file or proto, or None when it is not an attnx export."""
    if not isinstance(model, onnx.ModelProto):
        model = onnx.load(str(model), load_external_data=False)
    props = {p.key[len(PREFIX):]: p.value for p in model.metadata_props if p.key.startswith(PREFIX)}
    if "variant" not in props:
        return None
    known = {"variant", "config", "lowering", "precision", "inputs", "outputs", "profiles", "version", "weights"}
    parsed = {}
    for key in known & set(props):
        value = props[key]
        parsed[key] = json.loads(value) if key in ("config", "inputs", "outputs", "profiles") else value
    parsed["extra"] = {k: v for k, v in props.items() if k not in known}
    return ModelInfo(**parsed)
