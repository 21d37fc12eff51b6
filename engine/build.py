"""Build TensorRT engines from attnx exports, with a JSON sidecar (``attnx build-engine``).

Everything TensorRT-specific goes through :mod:`attnx.runtime.tensorrt_backend` (the one
adapter over ``tensorrt`` and TensorRT for RTX); this module adds what the CLI, ``check``,
``serve`` and ``bench`` need around it:

- :func:`ensure_fp16`: TensorRT 11 and TensorRT-RTX are strongly typed (no FP16 builder
  flag), so ``--fp16`` means building from an fp16 ONNX: the given file when it already is
  one, else ``<stem>-fp16.onnx`` written beside it by :func:`attnx.export.to_fp16` (metadata
  precision and I/O dtypes updated; reused while the source file is unchanged).
- :func:`parse_shapes`: ``["batch=1,4,16", "seq=1,64,256"]`` -> profile overrides.
- :func:`resolve_plugin_library`: ``--plugins`` or the built library (built when missing and
  the model has attnx custom ops).
- :func:`build`: parse (counting layers by type: plugin layers vs inlined custom nodes),
  build for a target, write ``<engine>`` and ``<engine>.json`` (:func:`sidecar_path`).
- :func:`read_sidecar` / :func:`verify_engine_file`: what ``check`` uses to trust an engine.

Errors are :class:`EngineBuildError` (a ``ValueError``: one line, user-fixable) or the
adapter's exceptions; :func:`explain` turns any of them into one line.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime as _dt
import json
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import attnx

__all__ = [
    "EngineBuildError",
    "EngineBuild",
    "AXES",
    "DEFAULT_TARGET",
    "parse_shapes",
    "parse_size",
    "default_target",
    "ensure_fp16",
    "fp16_path",
    "read_model_info",
    "custom_nodes",
    "resolve_plugin_library",
    "merged_profiles",
    "build",
    "sidecar_path",
    "default_engine_path",
    "read_sidecar",
    "verify_engine_file",
    "explain",
]

#: The dynamic axes of attnx exports (docs/contracts.md).
AXES = ("batch", "seq")
#: Built for when there is no local GPU (TensorRT-RTX; Ada, e.g. L4 / RTX 40xx).
DEFAULT_TARGET = "sm89"
SIDECAR_FORMAT = 1
#: First bytes of serialized plans: TensorRT-RTX 1.7 writes b"vtrt" (seen here), TensorRT 8-10 b"ftrt".
#: Only used for engines without a sidecar (which carries the engine's sha256).
PLAN_MAGICS = (b"vtrt", b"ftrt")
CUSTOM_DOMAIN = "attnx"


class EngineBuildError(ValueError):
    """A user-fixable problem with a build request (bad shapes, unreadable file, ...)."""


# ============================================================================ native output


@contextlib.contextmanager
def native_stdout_to_stderr():
    """Send what native code prints on stdout (TensorRT-RTX prints some warnings there, bypassing
    its logger) to stderr while the block runs, so stdout stays machine-readable."""
    try:
        out_fd = sys.stdout.fileno()
        err_fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # pytest capture, no real file descriptors
        yield
        return
    libc = None
    with contextlib.suppress(OSError):
        libc = ctypes.CDLL(None)
    sys.stdout.flush()
    saved = os.dup(out_fd)
    try:
        os.dup2(err_fd, out_fd)
        yield
    finally:
        if libc is not None:
            with contextlib.suppress(Exception):
                libc.fflush(None)
        sys.stdout.flush()
        os.dup2(saved, out_fd)
        os.close(saved)


# ============================================================================ small parsers


def parse_shapes(items: Iterable[str] | None) -> dict[str, tuple[int, int, int]]:
    """``["batch=1,4,16", "seq=1:64:256"]`` -> ``{"batch": (1, 4, 16), "seq": (1, 64, 256)}``.

    Several axes may share one item separated by ``;`` or whitespace. Keys are the dynamic
    axis names (``batch``, ``seq``); values min,opt,max with 1 <= min <= opt <= max."""
    out: dict[str, tuple[int, int, int]] = {}
    for item in items or ():
        for part in re.split(r"[;\s]+", str(item).strip()):
            if not part:
                continue
            if "=" not in part:
                raise EngineBuildError(f"--shapes {part!r}: expected axis=min,opt,max (e.g. batch=1,4,16)")
            key, _, raw = part.partition("=")
            key = key.strip()
            if key not in AXES:
                raise EngineBuildError(f"--shapes {part!r}: unknown axis {key!r}; the dynamic axes are "
                                       f"{', '.join(AXES)}")
            try:
                values = tuple(int(v) for v in re.split(r"[,:]", raw.strip()))
            except ValueError:
                values = ()
            if len(values) == 1:
                values = values * 3  # a fixed size
            if len(values) != 3:
                raise EngineBuildError(f"--shapes {part!r}: expected three integers min,opt,max")
            lo, mid, hi = values
            if not 1 <= lo <= mid <= hi:
                raise EngineBuildError(f"--shapes {part!r}: need 1 <= min <= opt <= max")
            out[key] = (lo, mid, hi)
    return out


_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6,
               "mib": 1 << 20, "g": 1 << 30, "gb": 10**9, "gib": 1 << 30}


def parse_size(text: str | int | None) -> int | None:
    """``"512M"``, ``"2GiB"``, ``"1073741824"`` -> bytes (None stays None)."""
    if text is None or isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise EngineBuildError(f"bad size {text!r}: use bytes or a unit, e.g. 512M, 2G, 1GiB")
    value = int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])
    if value <= 0:
        raise EngineBuildError(f"size must be positive, got {text!r}")
    return value


def default_target() -> str | None:
    """The local GPU (None: let the backend use it) when there is one, else ``sm89``."""
    from attnx.runtime import tensorrt_backend as tb

    return None if tb.gpu_compute_capability() is not None else DEFAULT_TARGET


def _target_name(target: str | None) -> str:
    from attnx.runtime import tensorrt_backend as tb

    if target is None:
        cc = tb.gpu_compute_capability()
        return f"sm{cc[0]}{cc[1]}" if cc else "local"
    cc = tb.parse_target(target)  # validates (BuildError names the supported targets)
    return str(cc).split(".")[-1].lower() if not isinstance(cc, int) else f"sm{cc}"


# ============================================================================ ONNX files


def _load_onnx(path: Path, *, with_data: bool = False):
    import onnx

    if not path.is_file():
        raise FileNotFoundError(f"no ONNX file at {path}")
    try:
        return onnx.load(str(path), load_external_data=with_data)
    except Exception as e:  # DecodeError, truncated files, missing external data
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise EngineBuildError(f"{path} is not a readable ONNX file (corrupt or truncated?): {reason}") from None


def read_model_info(path: str | os.PathLike):
    """``(ModelInfo | None, ModelProto without weights)``; a corrupt file is an :class:`EngineBuildError`."""
    from attnx.export.metadata import read_metadata

    proto = _load_onnx(Path(path))
    try:
        info = read_metadata(proto)
    except (ValueError, TypeError, KeyError) as e:
        raise EngineBuildError(f"{path}: unreadable attnx metadata ({e})") from None
    return info, proto


def custom_nodes(proto) -> dict[str, int]:
    """attnx custom-op nodes of the main graph by op type."""
    counts: dict[str, int] = {}
    for node in proto.graph.node:
        if node.domain == CUSTOM_DOMAIN:
            counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return dict(sorted(counts.items()))


def fp16_path(path: Path) -> Path:
    return path.with_name(f"{path.stem}-fp16{path.suffix}")


def _precision(info, proto) -> str:
    if info is not None and info.precision:
        return info.precision
    import onnx

    for vi in proto.graph.input:
        if vi.type.tensor_type.elem_type == onnx.TensorProto.FLOAT16:
            return "fp16"
    return "fp32"


def _same_fp16(dst: Path, src: Path, info, source_sha: str) -> bool:
    """Whether ``dst`` is an fp16 version of ``src``: converted from it (its sha256 recorded), or
    an fp16 export (``attnx export --fp16``) of the same variant, config, lowering and weights."""
    from attnx.export.exporter import sha256_file
    from attnx.export.metadata import read_metadata

    try:
        existing = read_metadata(dst)
    except Exception:
        return False
    if existing is None or existing.precision != "fp16":
        return False
    if existing.extra.get("fp16_source_sha256") == source_sha:
        return True
    if info is None or not info.weights or not existing.weights:
        return False
    if (existing.variant, existing.config, existing.lowering, existing.profiles) != \
            (info.variant, info.config, info.lowering, info.profiles):
        return False
    a, b = src.parent / info.weights, dst.parent / existing.weights
    return a.is_file() and b.is_file() and sha256_file(a) == sha256_file(b)


def ensure_fp16(path: str | os.PathLike, output: str | os.PathLike | None = None) -> tuple[Path, bool]:
    """An fp16 version of ``path``: ``(path, False)`` when it already is fp16, else
    ``(<stem>-fp16.onnx, True)`` converted with :func:`attnx.export.to_fp16` (softmax,
    LayerNorm and reductions kept in fp32) and its metadata updated. An existing conversion
    of the same source (sha256 recorded in ``attnx.fp16_source_sha256``) is reused."""
    import onnx

    from attnx.export.exporter import sha256_file
    from attnx.export.fp16 import to_fp16
    from attnx.export.metadata import ModelInfo, write_metadata

    src = Path(path)
    info, proto = read_model_info(src)
    if _precision(info, proto) == "fp16":
        return src, False
    dst = Path(output) if output else fp16_path(src)
    source_sha = sha256_file(src)
    if dst.is_file() and _same_fp16(dst, src, info, source_sha):
        return dst, False
    full = _load_onnx(src, with_data=True)
    converted = to_fp16(full)
    if info is not None:
        dtypes = {vi.name: onnx.helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type).name
                  for vi in list(converted.graph.input) + list(converted.graph.output)}
        new = ModelInfo(**{**info.__dict__})
        new.precision = "fp16"
        new.inputs = [{**i, "dtype": dtypes.get(i["name"], i["dtype"])} for i in info.inputs]
        new.outputs = [{**o, "dtype": dtypes.get(o["name"], o["dtype"])} for o in info.outputs]
        # The weights file (safetensors, fp32) stays the reference: name it relative to the new file.
        if info.weights and dst.parent.resolve() != src.parent.resolve():
            new.weights = os.path.relpath(src.parent / info.weights, dst.parent)
        new.extra = {**info.extra, "fp16_source": src.name, "fp16_source_sha256": source_sha}
        write_metadata(converted, new)
    dst.parent.mkdir(parents=True, exist_ok=True)
    large = converted.ByteSize() > 1_800_000_000 if hasattr(converted, "ByteSize") else False
    tmp = dst.with_name(dst.name + ".tmp")
    if large:
        onnx.save_model(converted, str(tmp), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=dst.name + ".data", size_threshold=1024)
    else:
        onnx.save_model(converted, str(tmp))
    os.replace(tmp, dst)
    return dst, True


# ============================================================================ plugins


def resolve_plugin_library(plugins: str | os.PathLike | None, *, needed: bool,
                           console=None, build_missing: bool = True) -> Path | None:
    """The plugin library to load: ``plugins`` when given (must exist), else the built one.

    When none is built: builds it (``attnx.plugins.build()``) if the model needs it
    (``needed``: it has attnx custom ops) and ``build_missing``; returns None for a model
    without custom ops."""
    from attnx import plugins as plugin_pkg

    if plugins is not None:
        lib = Path(plugins).expanduser()
        if not lib.is_file():
            raise EngineBuildError(f"plugin library {lib} does not exist (build it with `attnx plugins build`, "
                                   "or leave --plugins out to use the built one)")
        return lib.resolve()
    lib = plugin_pkg.library_path()
    if lib is not None or not needed:
        return lib
    if not build_missing:
        raise EngineBuildError("the attnx plugin library is not built: run `attnx plugins build`")
    try:
        return plugin_pkg.build(console=console)
    except plugin_pkg.PluginBuildError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else "unknown reason"
        raise EngineBuildError(f"the model needs the attnx plugin library, which is not built and could not be "
                               f"built here: {first}") from None


# ============================================================================ profiles


def merged_profiles(info, overrides: Mapping[str, Sequence[int]] | None) -> dict[str, tuple[int, int, int]]:
    """The model's metadata profiles with ``overrides`` (from ``--shapes``) on top."""
    out: dict[str, tuple[int, int, int]] = {}
    if info is not None and info.profiles:
        for axis, rng in info.profiles.items():
            out[axis] = tuple(int(v) for v in rng)  # type: ignore[assignment]
    for axis, rng in (overrides or {}).items():
        out[axis] = tuple(int(v) for v in rng)  # type: ignore[assignment]
    return out


# ============================================================================ sidecar


def sidecar_path(engine: str | os.PathLike) -> Path:
    """``x.engine`` -> ``x.engine.json``."""
    p = Path(engine)
    return p.with_name(p.name + ".json")


def default_engine_path(onnx_path: str | os.PathLike) -> Path:
    return Path(onnx_path).with_suffix(".engine")


def read_sidecar(engine: str | os.PathLike) -> dict | None:
    """The sidecar of an engine (``x.engine.json``, or ``x.json``), None when there is none."""
    p = Path(engine)
    for primary, candidate in ((True, sidecar_path(p)), (False, p.with_suffix(".json"))):
        if not candidate.is_file():
            continue
        try:
            data = json.loads(candidate.read_text())
        except (OSError, ValueError) as e:
            if not primary:
                continue  # x.json may be any JSON file
            raise EngineBuildError(f"{candidate}: unreadable engine sidecar ({e})") from None
        if not isinstance(data, dict) or "engine_sha256" not in data:
            if not primary:
                continue
            raise EngineBuildError(f"{candidate} is not an attnx engine sidecar")
        return data
    return None


def verify_engine_file(engine: str | os.PathLike) -> dict | None:
    """Check an engine file against its sidecar (size and sha256); returns the sidecar, or None
    when the engine has none. A missing, empty or altered engine is an :class:`EngineBuildError`."""
    from attnx.export.exporter import sha256_file

    p = Path(engine)
    if not p.is_file():
        raise FileNotFoundError(f"no engine file at {p}")
    size = p.stat().st_size
    if size == 0:
        raise EngineBuildError(f"{p} is empty: not a TensorRT engine (rebuild it with `attnx build-engine`)")
    sidecar = read_sidecar(p)
    if sidecar is None:
        with open(p, "rb") as f:
            head = f.read(4)
        if head not in PLAN_MAGICS:
            raise EngineBuildError(f"{p} is not a TensorRT engine (its header {head!r} is not a TensorRT plan's, and "
                                   f"it has no {sidecar_path(p).name} sidecar)")
        return None
    if sidecar.get("engine_bytes") not in (None, size) or sidecar.get("engine_sha256") != sha256_file(p):
        raise EngineBuildError(f"{p} is corrupt or was changed after it was built: its sha256 does not match "
                               f"{sidecar_path(p).name} (rebuild it with `attnx build-engine`)")
    return sidecar


def _bindings(info, proto) -> tuple[list[dict], list[dict]]:
    import onnx

    roles = {}
    if info is not None:
        for item in list(info.inputs) + list(info.outputs):
            roles[item["name"]] = item.get("role")
    initializers = {i.name for i in proto.graph.initializer}

    def one(vi, is_input: bool) -> dict:
        t = vi.type.tensor_type
        shape = [d.dim_param if d.dim_param else (d.dim_value if d.HasField("dim_value") else None)
                 for d in t.shape.dim]
        role = roles.get(vi.name) or ({"hidden_states": "hidden_states", "attention_mask": "attention_mask"}
                                      .get(vi.name, "context") if is_input else
                                      ("output" if vi.name == "output" else "aux"))
        return {"name": vi.name, "dtype": onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).name,
                "shape": shape, "role": role}

    inputs = [one(v, True) for v in proto.graph.input if v.name not in initializers]
    outputs = [one(v, False) for v in proto.graph.output]
    return inputs, outputs


# ============================================================================ build


@dataclass
class EngineBuild:
    """What :func:`build` produced."""

    engine_path: Path
    sidecar_path: Path
    sidecar: dict
    onnx_path: Path  # the file the engine was built from (the fp16 one for --fp16)
    converted_fp16: bool = False
    layers: dict[str, int] = field(default_factory=dict)
    plugin_layers: int = 0
    custom_nodes: int = 0
    inlined_custom_nodes: int = 0
    seconds: float = 0.0

    @property
    def engine_bytes(self) -> int:
        return int(self.sidecar.get("engine_bytes", 0))


def build(onnx_path: str | os.PathLike, output: str | os.PathLike | None = None, *, fp16: bool = False,
          target: str | None = None, shapes: Mapping[str, Sequence[int]] | None = None,
          timing_cache: str | os.PathLike | None = None, workspace: int | str | None = None,
          plugins: str | os.PathLike | None = None, build_plugins: bool = True,
          optimization_level: int | None = None, console=None,
          progress: Callable[[str], None] | None = None) -> EngineBuild:
    """Build an engine from ``onnx_path`` and write it with its JSON sidecar.

    ``fp16``: build from the fp16 version of the file (:func:`ensure_fp16`). ``target``: a
    compute capability (``"sm89"``; default :func:`default_target`). ``shapes``: profile
    overrides per axis (:func:`parse_shapes`), on top of the model's ``attnx.profiles``.
    ``plugins``: the plugin library (default: the built one, built when missing and needed).
    ``progress(step)`` is called with ``fp16``, ``plugins``, ``parse``, ``build``, ``write``.
    """
    from attnx.export.exporter import sha256_file
    from attnx.runtime import tensorrt_backend as tb

    step = progress or (lambda name: None)
    started = time.monotonic()
    src = Path(onnx_path)
    info, proto = read_model_info(src)  # a corrupt file fails here, before TensorRT sees it
    info_backend = tb.backend()  # TensorRTUnavailable names the extra to install

    step("fp16")
    converted = False
    if fp16:
        src, converted = ensure_fp16(src)
        info, proto = read_model_info(src)
    precision = _precision(info, proto)

    if target is None:
        target = default_target()
    target_name = _target_name(target)

    step("plugins")
    customs = custom_nodes(proto)
    n_custom = sum(customs.values())
    lib = resolve_plugin_library(plugins, needed=n_custom > 0, console=console, build_missing=build_plugins)
    plugin_info = None
    if lib is not None:
        try:
            loaded = tb.load_plugins(lib)
        except tb.PluginLoadError:
            if n_custom or plugins is not None:
                raise
            loaded = None  # an optional library that fails to load does not matter to this model
            lib = None
        if loaded is not None:
            plugin_info = {"path": str(loaded.path), "sha256": sha256_file(loaded.path),
                           "creators": [f"{ns}::{n} v{v}" for n, v, ns in loaded.creators]}

    profiles = merged_profiles(info, shapes)
    dims_in_file = {d.dim_param for vi in proto.graph.input for d in vi.type.tensor_type.shape.dim if d.dim_param}
    missing_axes = sorted(dims_in_file - set(profiles))
    if missing_axes:
        raise EngineBuildError(f"{src.name} has dynamic axes {', '.join(missing_axes)} without an optimization-profile "
                               f"range (no attnx metadata?): pass --shapes {missing_axes[0]}=min,opt,max")

    seen: dict[str, Any] = {}

    def inspect(parsed, profile_shapes) -> None:  # between parsing and building
        seen.update(layers=parsed.layer_type_counts(), plugin_layers=parsed.plugin_layers(),
                    attention=parsed.attention, profile_shapes=profile_shapes)
        step("build")
        seen["build_started"] = time.monotonic()

    step("parse")
    with native_stdout_to_stderr():
        plan = tb.build_engine(src, plugins=lib if lib is not None else False, target=target, profiles=profiles,
                               timing_cache=timing_cache, workspace=parse_size(workspace),
                               optimization_level=optimization_level, network_hook=inspect)
    build_seconds = time.monotonic() - seen["build_started"]
    layers, plugin_layer_list = seen["layers"], seen["plugin_layers"]
    attention, profile_shapes = seen["attention"], seen["profile_shapes"]
    n_plugin = len(plugin_layer_list)
    inlined = max(0, n_custom - n_plugin)
    inputs, outputs = _bindings(info, proto)

    step("write")
    engine_path = Path(output) if output else default_engine_path(src)
    engine_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = engine_path.with_name(engine_path.name + ".tmp")
    tmp.write_bytes(plan)
    os.replace(tmp, engine_path)
    import hashlib

    sidecar: dict[str, Any] = {
        "format": SIDECAR_FORMAT,
        "engine": engine_path.name,
        "engine_bytes": len(plan),
        "engine_sha256": hashlib.sha256(plan).hexdigest(),
        "backend": info_backend.name,
        "backend_version": info_backend.version,
        "backend_description": info_backend.describe(),
        "target": target_name,
        "precision": precision,
        "variant": info.variant if info else None,
        "lowering": info.lowering if info else None,
        "onnx": str(src.resolve()),
        "onnx_name": src.name,
        "onnx_sha256": sha256_file(src),
        "profiles": {axis: list(rng) for axis, rng in profiles.items()},
        "profile_shapes": {name: {"min": list(lo), "opt": list(mid), "max": list(hi)}
                           for name, (lo, mid, hi) in profile_shapes.items()},
        "inputs": inputs,
        "outputs": outputs,
        "plugins": plugin_info,
        "layers": layers,
        "plugin_layers": n_plugin,
        "plugin_layer_names": [name for name, _ in plugin_layer_list],
        "custom_nodes": customs,
        "inlined_custom_nodes": inlined,
        "attention": attention,
        "timing_cache": (str(timing_cache) if timing_cache and not info_backend.is_rtx else None),
        "workspace": parse_size(workspace),
        "attnx_version": attnx.__version__,
        "built_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "build_seconds": round(build_seconds, 3),
    }
    side = sidecar_path(engine_path)
    tmp = side.with_name(side.name + ".tmp")
    tmp.write_text(json.dumps(sidecar, indent=2) + "\n")
    os.replace(tmp, side)
    return EngineBuild(engine_path=engine_path, sidecar_path=side, sidecar=sidecar, onnx_path=src,
                       converted_fp16=converted, layers=layers, plugin_layers=n_plugin, custom_nodes=n_custom,
                       inlined_custom_nodes=inlined, seconds=time.monotonic() - started)


# ============================================================================ errors


def explain(exc: BaseException) -> str:
    """One line for any build-time error (the adapter's included)."""
    from attnx.runtime import tensorrt_backend as tb

    text = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, tb.TensorRTUnavailable):
        return text
    if isinstance(exc, tb.PluginLoadError):
        return f"plugin library: {text}"
    if isinstance(exc, tb.ParseError):
        return f"cannot map the model to TensorRT: {text}"
    if isinstance(exc, tb.BuildError):
        return f"engine build failed: {text}"
    if isinstance(exc, tb.EngineUnavailable):
        return text
    return text
