"""Past one machine: write a Triton Inference Server model repository for an attnx model.

Layout written by :func:`write_repository`::

    repo/
      README.md                 how to start Triton on it, plugin loading, the padding caveat
      plugins/libattnx...so     the TensorRT plugin library (when one is given or found)
      <name>/config.pbtxt       platform, max_batch_size, dynamic_batching, inputs/outputs
      <name>/1/model.onnx       (or model.plan for a TensorRT engine)

The config is written as protobuf text and checked by parsing it with Triton's
own ``ModelConfig`` schema (``model_config_pb2``, shipped inside ``tritonclient``).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from attnx.contract import BATCH, Role
from attnx.runtime.session import Session, TensorSpec

#: numpy dtype -> Triton ``DataType`` enum name.
TRITON_TYPES = {
    "bool": "TYPE_BOOL",
    "uint8": "TYPE_UINT8",
    "uint16": "TYPE_UINT16",
    "uint32": "TYPE_UINT32",
    "uint64": "TYPE_UINT64",
    "int8": "TYPE_INT8",
    "int16": "TYPE_INT16",
    "int32": "TYPE_INT32",
    "int64": "TYPE_INT64",
    "float16": "TYPE_FP16",
    "float32": "TYPE_FP32",
    "float64": "TYPE_FP64",
}

PLATFORMS = {".onnx": ("onnxruntime_onnx", "onnxruntime", "model.onnx"),
             ".engine": ("tensorrt_plan", "tensorrt", "model.plan"),
             ".plan": ("tensorrt_plan", "tensorrt", "model.plan")}


class ConfigError(ValueError):
    """A config.pbtxt that Triton's schema (or a basic sanity check) rejects."""


class Enum(str):
    """A protobuf enum value: written bare in text format (``TYPE_FP32``, not ``"TYPE_FP32"``)."""


# --------------------------------------------------------------------------------------
# The config, as a dict shaped like Triton's ModelConfig message
# --------------------------------------------------------------------------------------


def _tensor_config(spec: TensorSpec, batched: bool) -> dict[str, Any]:
    dims = [d if isinstance(d, int) else -1 for axis, d in enumerate(spec.shape) if not (batched and axis == 0)]
    entry: dict[str, Any] = {"name": spec.name, "data_type": Enum(TRITON_TYPES[np.dtype(spec.dtype).name])}
    if dims:
        entry["dims"] = dims
    else:
        # A [batch] tensor has no dims left once batch is implicit; Triton's idiom for it is
        # dims [1] reshaped to [] (the model sees [batch]).
        entry["dims"] = [1]
        entry["reshape"] = {"shape": []}
    return entry


def model_config(
    name: str,
    model: Session | tuple[list[TensorSpec], list[TensorSpec]],
    *,
    platform: str | None = None,
    max_batch_size: int = 32,
    max_queue_delay_us: int = 2000,
    max_queue_size: int | None = None,
    instance_kind: str = "KIND_AUTO",
    instance_count: int = 1,
    default_model_filename: str | None = None,
    parameters: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Triton's ModelConfig for a model, as a dict (field names as in model_config.proto).

    Batch is implicit (``max_batch_size`` > 0) when every input and output has it
    as its first dim; otherwise ``max_batch_size`` is 0 and dims include it.
    """
    if isinstance(model, Session):
        inputs, outputs = model.inputs, model.outputs
        platform = platform or model.platform
    else:
        inputs, outputs = model
    platform = platform or "onnxruntime_onnx"
    batched = max_batch_size > 0 and all(s.shape[:1] == (BATCH,) for s in list(inputs) + list(outputs))
    config: dict[str, Any] = {
        "name": name,
        "platform": platform,
        "max_batch_size": max_batch_size if batched else 0,
        "input": [_tensor_config(s, batched) for s in inputs],
        "output": [_tensor_config(s, batched) for s in outputs],
    }
    if batched:
        dyn: dict[str, Any] = {"max_queue_delay_microseconds": int(max_queue_delay_us)}
        if max_queue_size:
            dyn["default_queue_policy"] = {"max_queue_size": int(max_queue_size)}
        config["dynamic_batching"] = dyn
    config["instance_group"] = [{"kind": Enum(instance_kind), "count": int(instance_count)}]
    if default_model_filename:
        config["default_model_filename"] = default_model_filename
    if parameters:
        config["parameters"] = {k: {"string_value": v} for k, v in parameters.items()}
    return config


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
    """Protobuf text format of a ModelConfig-shaped dict (maps are dicts under ``parameters``)."""
    pad = "  " * indent
    lines = []
    for key, value in config.items():
        if key == "parameters" and isinstance(value, dict):
            for k, v in value.items():
                lines.append(f"{pad}{key} {{\n{pad}  key: {_quote(k)}\n{pad}  value {{\n"
                             f"{to_pbtxt(v, indent + 2)}{pad}  }}\n{pad}}}")
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
    if problems:
        raise ConfigError("invalid Triton config: " + "; ".join(problems))
    return message


# --------------------------------------------------------------------------------------
# Writing the repository
# --------------------------------------------------------------------------------------


def find_plugin_library() -> Path | None:
    """The built TensorRT plugin library, if ``attnx.plugins`` can say where it is."""
    try:
        from attnx import plugins
    except ImportError:
        return None
    locate = getattr(plugins, "library_path", None)
    if locate is None:
        return None
    try:
        path = locate()
    except Exception:  # noqa: BLE001 - not built yet is a normal state here
        return None
    return Path(path) if path and Path(path).is_file() else None


def _external_data_files(model_path: Path) -> list[str]:
    """Relative paths of an ONNX model's external tensor data files (large models)."""
    import onnx

    model = onnx.load(str(model_path), load_external_data=False)
    files = set()
    for tensor in onnx.external_data_helper._get_all_tensors(model):
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            for entry in tensor.external_data:
                if entry.key == "location":
                    files.add(entry.value)
    return sorted(files)


def write_repository(
    model_path: str | Path,
    out_dir: str | Path,
    *,
    name: str | None = None,
    max_batch_size: int = 32,
    max_queue_delay_us: int = 2000,
    max_queue_size: int | None = None,
    instance_kind: str = "KIND_AUTO",
    instance_count: int = 1,
    plugin_library: str | Path | None = None,
    onnx_path: str | Path | None = None,
    validate: bool | None = None,
) -> Path:
    """Write (or add to) a Triton model repository; returns the model's folder.

    ``plugin_library``: the TensorRT plugin ``.so`` to ship (default: the built one,
    when ``attnx.plugins.library_path()`` finds it). ``onnx_path``: for an engine whose
    sidecar does not list its I/O, the ONNX it was built from. ``validate``: check the
    config with Triton's schema (None: when tritonclient is installed to provide it).
    """
    from attnx.runtime.backends.onnxrt import onnx_io_specs
    from attnx.runtime.backends.tensorrt import engine_io_specs

    model_path = Path(model_path)
    suffix = model_path.suffix.lower()
    if suffix not in PLATFORMS:
        raise ValueError(f"{model_path}: expected a .onnx or .engine/.plan file")
    if not model_path.is_file():
        raise FileNotFoundError(f"no model file at {model_path}")
    platform, backend, filename = PLATFORMS[suffix]
    if suffix == ".onnx":
        inputs, outputs = onnx_io_specs(model_path)
    else:
        inputs, outputs, _ = engine_io_specs(model_path, Path(onnx_path) if onnx_path else None)
    name = name or model_path.stem
    repo = Path(out_dir)
    model_dir = repo / name
    version_dir = model_dir / "1"
    version_dir.mkdir(parents=True, exist_ok=True)

    config = model_config(
        name,
        (inputs, outputs),
        platform=platform,
        max_batch_size=max_batch_size,
        max_queue_delay_us=max_queue_delay_us,
        max_queue_size=max_queue_size,
        instance_kind=instance_kind,
        instance_count=instance_count,
        default_model_filename=filename,
    )
    text = f"# Written by attnx triton-repo from {model_path.name}; see ../README.md.\n" + to_pbtxt(config)
    if validate or (validate is None and schema_problem() is None):
        validate_config(text)
    (model_dir / "config.pbtxt").write_text(text)

    shutil.copy2(model_path, version_dir / filename)
    if suffix == ".onnx":
        for rel in _external_data_files(model_path):
            target = version_dir / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(model_path.parent / rel, target)

    plugin = Path(plugin_library) if plugin_library else find_plugin_library()
    if plugin_library and not plugin.is_file():  # type: ignore[union-attr]
        raise FileNotFoundError(f"no plugin library at {plugin}")
    plugin_rel = None
    if plugin is not None:
        (repo / "plugins").mkdir(exist_ok=True)
        shutil.copy2(plugin, repo / "plugins" / plugin.name)
        plugin_rel = f"plugins/{plugin.name}"
    (repo / "README.md").write_text(_readme(repo, plugin_rel, inputs))
    return model_dir


def _readme(repo: Path, plugin_rel: str | None, inputs: Sequence[TensorSpec]) -> str:
    models = sorted(p.parent.name for p in repo.glob("*/config.pbtxt"))
    plugins = sorted(f"plugins/{p.name}" for p in (repo / "plugins").glob("*.so*")) if (repo / "plugins").is_dir() else []
    mask = next((s.name for s in inputs if s.role == Role.ATTENTION_MASK), "attention_mask")
    plugin_text = (
        "\n".join(f"- `{p}`" for p in plugins)
        if plugins
        else "- none copied (no library was given or found; build it with `attnx plugins build`,\n"
        "  then run `attnx triton-repo ... --plugin PATH` again)"
    )
    return f"""# Triton model repository (written by `attnx triton-repo`)

Models: {", ".join(f"`{m}`" for m in models)}. Each has `config.pbtxt` (checked against
Triton's own ModelConfig schema when it was written) and version `1/`.

## Start Triton on it

```
tritonserver --model-repository=$PWD
```

ONNX models (`platform: "onnxruntime_onnx"`) need no plugin: every attnx custom op
carries a model-local function that ONNX Runtime inlines. The files use opset 23,
so Triton's ONNX Runtime must be 1.22 or newer.

TensorRT engines (`platform: "tensorrt_plan"`) need the attnx plugin library loaded
into Triton, and the engine and the library must be built with the same TensorRT
version as Triton's TensorRT backend (an engine from TensorRT for RTX does not load
in Triton's TensorRT backend). Either:

```
tritonserver --model-repository=$PWD \\
    --backend-config=tensorrt,plugins="$PWD/{plugin_rel or 'plugins/libattnx_plugins.so'}"
# or
LD_PRELOAD=$PWD/{plugin_rel or 'plugins/libattnx_plugins.so'}:$LD_PRELOAD tritonserver --model-repository=$PWD
```

Plugin libraries here:
{plugin_text}

## Variable-length requests: Triton does not pad

Triton's dynamic batcher concatenates requests only when their shapes match
(apart from the batch dim). Requests with different sequence lengths are
therefore run in separate batches. To batch them, pad on the client: pad every
sequence to a common length (or a few fixed buckets) and send `{mask}` with 0 on
the padded positions; padded query rows of the output carry no meaning and are
dropped by the client. (`attnx serve` does this padding in the server.)
"""
