"""Triton Inference Server model configs: written as protobuf text, checked with Triton's own schema.

:func:`model_config` gives the ``ModelConfig`` of an ONNX Runtime or TensorRT model (the one
``attnx serve`` reports too), :func:`python_model_config` its form for attnx's runtime in Triton's
Python backend, :func:`to_pbtxt` writes it, :func:`validate_config` parses it with
Triton's ``ModelConfig`` message (``model_config_pb2``, shipped inside ``tritonclient``) and adds
the checks Triton makes at load time that the schema alone does not, and
:func:`validate_ensemble` checks an ensemble against the models it composes. The repository
itself is written by :mod:`attnx.deploy.repository`.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from typing import Any, Mapping

from attnx.contract import Role
from attnx.runtime.core.session import TensorSpec
# The config itself is the server's too (GET /v2/models/{m}/config); deploy writes and checks it.
from attnx.runtime.serving.model_config import ConfigError, Enum, model_config  # noqa: F401 (model_config: deploy's too)

PLATFORMS = {".onnx": ("onnxruntime_onnx", "onnxruntime", "model.onnx"),
             ".engine": ("tensorrt_plan", "tensorrt", "model.plan"),
             ".plan": ("tensorrt_plan", "tensorrt", "model.plan")}


#: Fields of ModelConfig that are protobuf maps (``parameters``: string -> message; the others string -> string).
MAP_FIELDS = ("parameters", "input_map", "output_map")

#: A model name that is one plain folder name: no separators, no ``..``, nothing hidden.
_MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


def check_model_name(name: str) -> str:
    """``name`` when it can be a folder of the repository and a URL path segment; else a ConfigError."""
    if not isinstance(name, str) or not _MODEL_NAME.fullmatch(name) or ".." in name:
        raise ConfigError(f"model name {name!r} is not a plain name: use letters, digits, '_', '-' and '.' "
                          "(starting with a letter or digit, no '..', at most 128 characters)")
    return name


def python_model_config(config: dict[str, Any], inputs: list[TensorSpec], outputs: list[TensorSpec], *,
                        model_file: str, pad_id: int | None = None, text_fed: bool = False, onnx_file: str | None = None,
                        plugin: str | None = None, gpu: bool = False) -> dict[str, Any]:
    """``config`` (a :func:`model_config`) for attnx's runtime in Triton's Python backend
    (:mod:`attnx.deploy.runtime_model`): ``backend: "python"``; sequence inputs ``allow_ragged_batch``
    where attnx can pad them (it merges requests of different lengths); inputs it fills when left out
    ``optional`` (context inputs with a metadata default; the mask and segment ids too, unless a
    tokenizer step always sends them, ``text_fed``). ``gpu``: instances on GPUs (an engine)."""
    from attnx.runtime import BatchLayout

    can_pad = BatchLayout(inputs, outputs).can_pad
    specs = {s.name: s for s in inputs}
    declared = []
    for entry in config["input"]:
        spec = specs[entry["name"]]
        fills = spec.default in ("zeros", "ones") or (
            not text_fed and spec.role in (Role.ATTENTION_MASK, Role.TOKEN_TYPE_IDS))
        ragged = config["max_batch_size"] > 0 and can_pad and spec.seq_axis is not None
        declared.append({**entry, **({"optional": True} if fills else {}),
                         **({"allow_ragged_batch": True} if ragged else {})})
    params = {"model_file": model_file, **({"onnx_file": onnx_file} if onnx_file else {}),
              **({"pad_id": str(int(pad_id))} if pad_id is not None else {}), "max_length_ratio": "1.5",
              **({"plugin_library": plugin} if plugin else {})}
    out: dict[str, Any] = {"name": config["name"], "backend": "python", "max_batch_size": config["max_batch_size"],
                           "input": declared, "output": config["output"]}
    out.update({k: v for k, v in config.items() if k not in (*out, "platform", "default_model_filename")})
    if gpu:
        out["instance_group"] = [{**g, "kind": Enum("KIND_GPU")} for g in out["instance_group"]]
    out["parameters"] = {k: {"string_value": v} for k, v in params.items()}
    return out


def _quote(s: str) -> str:
    return json.dumps(s)  # JSON string escaping is valid protobuf text escaping for our strings


def _scalar(v: Any) -> str:
    if isinstance(v, Enum):
        return str(v)
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return _quote(v)
    raise TypeError(f"cannot write {v!r} in protobuf text")


def to_pbtxt(config: dict[str, Any], indent: int = 0) -> str:
    """Protobuf text format of a ModelConfig-shaped dict (maps are dicts under :data:`MAP_FIELDS`)."""
    pad = "  " * indent
    lines = []
    for key, value in config.items():
        if key in MAP_FIELDS and isinstance(value, dict):
            for k, v in value.items():
                entry = (f"{pad}  value {{\n{to_pbtxt(v, indent + 2)}{pad}  }}" if isinstance(v, dict)
                         else f"{pad}  value: {_scalar(v)}")
                lines.append(f"{pad}{key} {{\n{pad}  key: {_quote(k)}\n{entry}\n{pad}}}")
        elif isinstance(value, dict):
            lines.append(f"{pad}{key} {{\n{to_pbtxt(value, indent + 1)}{pad}}}")
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            blocks = [f"{pad}  {{\n{to_pbtxt(v, indent + 2)}{pad}  }}" for v in value]
            lines.append(f"{pad}{key} [\n" + ",\n".join(blocks) + f"\n{pad}]")
        elif isinstance(value, list):
            lines.append(f"{pad}{key}: [ " + ", ".join(_scalar(v) for v in value) + " ]")
        else:
            lines.append(f"{pad}{key}: {_scalar(value)}")
    return "".join(line + "\n" for line in lines)


# --------------------------------------------------------------------------------------
# Validation with Triton's schema
# --------------------------------------------------------------------------------------

_schema = None


def triton_schema():
    """Triton's ``model_config_pb2`` from the installed tritonclient.

    Loaded from its file so that ``tritonclient.grpc``'s own imports (grpcio) are not needed.
    """
    global _schema
    if _schema is None:
        try:
            import tritonclient
        except ImportError as e:
            raise RuntimeError("validating a Triton config needs the tritonclient package") from e
        path = Path(tritonclient.__file__).parent / "grpc" / "model_config_pb2.py"
        if not path.is_file():
            raise RuntimeError(f"this tritonclient has no {path.name} (looked in {path.parent})")
        spec = importlib.util.spec_from_file_location("attnx_triton_model_config_pb2", path)
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)  # type: ignore[union-attr]
        except Exception as e:  # noqa: BLE001 - typically a protobuf runtime older than the generated code
            from google.protobuf import __version__ as pb_version

            raise RuntimeError(
                f"cannot load Triton's schema from {path} with protobuf {pb_version}: {e}"
            ) from e
        _schema = module
    return _schema


def schema_problem() -> str | None:
    """Why Triton's schema cannot be loaded here (None when it can)."""
    try:
        triton_schema()
    except RuntimeError as e:
        return str(e)
    return None


def validate_config(text: str):
    """Parse config.pbtxt text with Triton's ModelConfig schema; returns the message.

    Raises :class:`ConfigError` for a text the schema rejects (unknown field, wrong
    type, bad enum) and for the mistakes Triton would refuse at load time that the
    schema alone allows (no name/platform, missing dims or data types, duplicates).
    """
    from google.protobuf import text_format

    schema = triton_schema()
    message = schema.ModelConfig()
    try:
        text_format.Parse(text, message)
    except text_format.ParseError as e:
        raise ConfigError(f"Triton's schema rejects the config: {e}") from None
    problems = []
    if not message.name:
        problems.append("no name")
    if not (message.platform or message.backend):
        problems.append("no platform or backend")
    if message.max_batch_size < 0:
        problems.append("negative max_batch_size")
    if message.HasField("dynamic_batching") and message.max_batch_size == 0:
        problems.append("dynamic_batching needs max_batch_size > 0")
    for kind, tensors in (("input", message.input), ("output", message.output)):
        if not tensors:
            problems.append(f"no {kind}s")
        names = [t.name for t in tensors]
        if len(set(names)) != len(names):
            problems.append(f"duplicate {kind} names {names}")
        for t in tensors:
            if t.data_type == schema.TYPE_INVALID:
                problems.append(f"{kind} {t.name!r} has no data_type")
            if not t.dims:
                problems.append(f"{kind} {t.name!r} has no dims")
            if any(d < -1 or d == 0 for d in t.dims):
                problems.append(f"{kind} {t.name!r} has invalid dims {list(t.dims)}")
    if message.platform == "ensemble":
        problems += _ensemble_problems(message)
    if problems:
        raise ConfigError("invalid Triton config: " + "; ".join(problems))
    return message


def _ensemble_problems(message) -> list[str]:
    """What Triton refuses in an ensemble's own config: its tensors must flow from inputs to outputs."""
    problems = []
    if message.instance_group:
        problems.append("an ensemble takes no instance_group")
    steps = message.ensemble_scheduling.step
    if not steps:
        problems.append("an ensemble needs ensemble_scheduling steps")
    available = {t.name for t in message.input}
    for step in steps:
        if not step.model_name:
            problems.append("an ensemble step without model_name")
        missing = sorted(set(step.input_map.values()) - available)
        if missing:
            problems.append(f"step {step.model_name!r} reads {missing}, which no input or earlier step provides")
        available |= set(step.output_map.values())
    unused = sorted({t.name for t in message.input} - {v for s in steps for v in s.input_map.values()})
    if unused:
        problems.append(f"ensemble inputs {unused} feed no step")
    unproduced = sorted({t.name for t in message.output} - available)
    if unproduced:
        problems.append(f"ensemble outputs {unproduced} are produced by no step")
    return problems


def validate_ensemble(ensemble, models: Mapping[str, Any]) -> None:
    """Check a parsed ensemble config against the parsed configs of the models it composes (``{name:
    ModelConfig}``): every step's model exists, maps only its real inputs and outputs, gets every
    input it needs with the data type it declares (never from an ensemble input a request may leave
    out), and batches at least as far as the ensemble."""
    problems = []
    tensor_types = {t.name: t.data_type for t in ensemble.input}
    # Tensors a request may leave out: Triton then runs the step that reads one without that input.
    maybe_absent = {t.name for t in ensemble.input if t.optional}
    for step in ensemble.ensemble_scheduling.step:
        model = models.get(step.model_name)
        if model is None:
            problems.append(f"step model {step.model_name!r} is not in the repository")
            continue
        inputs = {t.name: t for t in model.input}
        outputs = {t.name: t for t in model.output}
        for key, value in step.input_map.items():
            if key not in inputs:
                problems.append(f"{step.model_name} has no input {key!r}")
            elif value in tensor_types and tensor_types[value] != inputs[key].data_type:
                problems.append(f"{step.model_name} input {key!r} has another data type than {value!r}")
        unfed = sorted(n for n, t in inputs.items() if n not in step.input_map and not t.optional)
        if unfed:
            problems.append(f"{step.model_name} inputs {unfed} are not mapped")
        absent = sorted(k for k, v in step.input_map.items() if v in maybe_absent and k in inputs and not inputs[k].optional)
        if absent:
            problems.append(f"{step.model_name} needs {absent}, which the ensemble lets a request leave out")
        for key, value in step.output_map.items():
            if key not in outputs:
                problems.append(f"{step.model_name} has no output {key!r}")
            else:
                tensor_types[value] = outputs[key].data_type
        if ensemble.max_batch_size > model.max_batch_size:
            problems.append(f"ensemble max_batch_size {ensemble.max_batch_size} exceeds {step.model_name}'s "
                            f"{model.max_batch_size}")
    for t in ensemble.output:
        if t.name in tensor_types and tensor_types[t.name] != t.data_type:
            problems.append(f"ensemble output {t.name!r} has another data type than the step that makes it")
    if problems:
        raise ConfigError(f"invalid ensemble {ensemble.name!r}: " + "; ".join(problems))


