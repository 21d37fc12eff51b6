"""Build engines.

- :func:`build_engine`: ONNX file -> serialized plan (parse with the plugins, :func:`prepare_attention`,
  target, optimization profile, builder config, timing cache). The network is strongly typed:
  fp16 comes from an fp16 ONNX, there is no FP16 flag.
- :func:`build`: what ``attnx build-engine`` does around it: the fp16 file (``--fp16``), the plugin
  library (``--plugins``, built when missing), profiles from the file's metadata with ``--shapes``
  on top, layer counts (plugin layers vs inlined custom nodes), then ``<engine>`` and its sidecar
  ``<engine>.json`` (:func:`attnx.contract.write_sidecar`), which ``check``, ``serve`` and ``bench`` read.

Measured with TensorRT-RTX 1.7.1.116 (CPU-only machine): engines build for SM75-SM121 and call
the plugins' build-time methods; timing caches are no-ops there (``timing_cache`` is ignored).
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import logging
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import attnx
from attnx.contract import (SIDECAR_FORMAT, ModelInfo, default_role, graph_io, merge_profiles, sha256_file,
                            sidecar_path, write_sidecar)
from attnx.engine.discovery import backend
from attnx.engine.errors import BuildError, EngineBuildError, PluginLoadError, unique
from attnx.engine.fp16 import ensure_fp16, fp16_path, precision_of, read_model_info
from attnx.engine.logger import get_logger, native_stdout_to_stderr
from attnx.engine.network import ParsedNetwork, custom_nodes, parse_onnx, prepare_attention
from attnx.engine.plugins import clear_plugin_errors, load_plugins, plugin_errors, resolve_plugin_library
from attnx.engine.profiles import resolve_profiles
from attnx.engine.targets import apply_target, check_target, default_target, target_name

_log = logging.getLogger("attnx.tensorrt")

#: ``network_hook(parsed, profile_shapes)`` of :func:`build_engine`.
NetworkHook = Callable[[ParsedNetwork, Mapping[str, tuple]], None]


def _configure(builder, network, config, onnx_path, *, profiles, shapes, workspace, optimization_level,
               network_hook, parsed) -> None:
    """Optimization profile and memory/optimization options of a builder config."""
    trt = backend().module
    ranges = resolve_profiles(onnx_path, profiles=profiles, shapes=shapes, network=network)
    if network_hook is not None:
        network_hook(parsed, ranges)
    if ranges:
        profile = builder.create_optimization_profile()
        for name, (lo, mid, hi) in ranges.items():
            profile.set_shape(name, lo, mid, hi)
        config.add_optimization_profile(profile)
    if workspace is not None:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace))
    if optimization_level is not None:
        config.builder_optimization_level = int(optimization_level)


def build_engine(onnx_path: str | os.PathLike, *, plugins: str | os.PathLike | bool | None = True,
                 target: str | int | None = "sm89", profiles: Mapping[str, Sequence[int]] | None = None,
                 shapes: Mapping[str, Sequence[Sequence[int]]] | None = None,
                 timing_cache: str | os.PathLike | None = None, workspace: int | None = None,
                 optimization_level: int | None = None, network_hook: NetworkHook | None = None) -> bytes:
    """Build a serialized engine (plan bytes) from an ONNX file.

    - ``target``: TensorRT-RTX builds for this compute capability (``"sm89"`` default; None =
      the local GPU). Full TensorRT builds for the local GPU; a different ``target`` is an error.
    - ``profiles`` / ``shapes``: see :func:`attnx.engine.profiles.resolve_profiles` (default: the
      file's metadata).
    - ``timing_cache``: a file read when present and written after the build (full TensorRT;
      TensorRT-RTX has no timing cache, the argument is ignored there).
    - ``workspace``: workspace memory-pool limit in bytes.
    - ``network_hook(parsed, profile_shapes)``: called just before the build, to inspect the
      network (layer counts, plugin layers; ``parsed.attention``) or adjust it.
    Raises :class:`BuildError` (with the plugins' messages), :class:`ParseError`, ..."""
    info = backend()
    logger = get_logger()
    parsed = parse_onnx(onnx_path, plugins=plugins)
    builder, network = parsed.builder, parsed.network
    parsed.attention = prepare_attention(network)
    config = builder.create_builder_config()
    apply_target(config, target, info)
    _configure(builder, network, config, onnx_path, profiles=profiles, shapes=shapes, workspace=workspace,
               optimization_level=optimization_level, network_hook=network_hook, parsed=parsed)

    cache_path = Path(timing_cache) if timing_cache else None
    if cache_path is not None and info.is_rtx:
        _log.debug("timing caches are no-ops in TensorRT-RTX; %s is not used", cache_path)
        cache_path = None
    if cache_path is not None:
        data = cache_path.read_bytes() if cache_path.is_file() else b""
        config.set_timing_cache(config.create_timing_cache(data), False)

    mark = logger.mark()
    clear_plugin_errors(parsed.plugins)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        errors = unique([*plugin_errors(parsed.plugins), *logger.plugin_messages(mark), *logger.messages(mark)])
        raise BuildError(f"TensorRT ({info.describe()}) could not build an engine from {onnx_path}: "
                         + (" | ".join(errors) if errors else "no error message (run with logging at DEBUG)"),
                         errors=errors)
    if cache_path is not None:
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        cache_path.write_bytes(bytes(config.get_timing_cache().serialize()))
    return bytes(plan)


# ============================================================================ attnx build-engine

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


def default_engine_path(onnx_path: str | os.PathLike) -> Path:
    return Path(onnx_path).with_suffix(".engine")


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


def _bindings(info: ModelInfo | None, proto) -> tuple[list[dict], list[dict]]:
    """The engine's inputs and outputs for the sidecar: the file's dims and dtypes, the metadata's roles."""
    roles = {e.name: e.role for e in [*info.inputs, *info.outputs]} if info is not None else {}
    ins, outs = graph_io(proto)

    def one(item, is_input: bool) -> dict:
        name, dtype, dims = item
        return {"name": name, "dtype": dtype, "shape": dims, "role": roles.get(name) or default_role(name, is_input)}

    return [one(i, True) for i in ins], [one(o, False) for o in outs]


def _plugin_record(plugins, needed: int, console, build_plugins: bool, target: str):
    """(library path or None, the sidecar's ``plugins`` entry)."""
    lib = resolve_plugin_library(plugins, needed=needed > 0, console=console, build_missing=build_plugins,
                                 target=target)
    if lib is None:
        return None, None
    try:
        loaded = load_plugins(lib)
    except PluginLoadError:
        if needed or plugins is not None:
            raise
        return None, None  # an optional library that fails to load does not matter to this model
    return lib, {"path": str(loaded.path), "sha256": sha256_file(loaded.path),
                 "creators": [f"{ns}::{n} v{v}" for n, v, ns in loaded.creators]}


def write_engine(engine_path: Path, plan, sidecar: Mapping[str, Any]) -> None:
    """``plan`` (the serialised engine) at ``engine_path`` with its sidecar: staged beside them and made
    visible together, the engine last (:mod:`attnx.export.staging`); a failed or killed write leaves the
    previous engine and sidecar, and no partial file under either name."""
    from attnx.export.staging import Staging

    with Staging(engine_path, owned={engine_path.name, sidecar_path(engine_path).name}) as stage:
        staged = stage.path(engine_path.name)
        with open(staged, "wb") as f:
            f.write(memoryview(plan))
        write_sidecar(staged, sidecar)
        stage.commit()


def build(onnx_path: str | os.PathLike, output: str | os.PathLike | None = None, *, fp16: bool = False,
          target: str | None = None, shapes: Mapping[str, Sequence[int]] | None = None,
          timing_cache: str | os.PathLike | None = None, workspace: int | str | None = None,
          plugins: str | os.PathLike | None = None, build_plugins: bool = True,
          optimization_level: int | None = None, console=None,
          progress: Callable[[str], None] | None = None) -> EngineBuild:
    """Build an engine from ``onnx_path`` and write it with its JSON sidecar.

    ``fp16``: build from the fp16 version of the file (:func:`ensure_fp16`). ``target``: a
    compute capability (``"sm89"``; default :func:`default_target`). ``shapes``: profile
    overrides per axis (:func:`attnx.engine.profiles.parse_shapes`), on top of the file's profiles.
    ``plugins``: the plugin library (default: the built one, built when missing and needed).
    ``progress(step)`` is called with ``fp16``, ``plugins``, ``parse``, ``build``, ``write``."""
    step = progress or (lambda name: None)
    started = time.monotonic()
    src = Path(onnx_path)
    info, proto = read_model_info(src)  # a corrupt file fails here, before TensorRT sees it
    from attnx.export.staging import check_room, prepare_dir

    # The default name is the file it is built from: <stem>-fp16.engine for --fp16 of an fp32 file.
    converts = fp16 and precision_of(info, proto) != "fp16"
    engine_path = Path(output) if output else default_engine_path(fp16_path(src) if converts else src)
    # An unwritable destination, or one without room for an engine about the model's size, before the build.
    data = src.with_name(src.name + ".data")
    check_room(prepare_dir(engine_path.parent), src.stat().st_size + (data.stat().st_size if data.is_file() else 0),
               "the engine")
    trt_info = backend()  # TensorRTUnavailable names the extra to install

    step("fp16")
    converted = False
    if fp16:
        src, converted = ensure_fp16(src)
        info, proto = read_model_info(src)
    target = default_target() if target is None else target
    check_target(target, trt_info)  # before the plugin library is compiled for it
    target_label = target_name(target)

    step("plugins")
    customs = custom_nodes(proto)
    n_custom = sum(customs.values())
    lib, plugin_info = _plugin_record(plugins, n_custom, console, build_plugins, target_label)

    profiles = merge_profiles(info.profiles if info is not None else None, shapes)
    dims_in_file = {d for _n, _t, dims in graph_io(proto)[0] for d in dims if isinstance(d, str)}
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
        plan = build_engine(src, plugins=lib if lib is not None else False, target=target, profiles=profiles,
                            timing_cache=timing_cache, workspace=parse_size(workspace),
                            optimization_level=optimization_level, network_hook=inspect)
    build_seconds = time.monotonic() - seen["build_started"]
    n_plugin = len(seen["plugin_layers"])
    inlined = max(0, n_custom - n_plugin)
    inputs, outputs = _bindings(info, proto)

    step("write")
    sidecar: dict[str, Any] = {
        "format": SIDECAR_FORMAT,
        "engine": engine_path.name,
        "engine_bytes": len(plan),
        "engine_sha256": hashlib.sha256(plan).hexdigest(),
        "backend": trt_info.name,
        "backend_version": trt_info.version,
        "backend_description": trt_info.describe(),
        "target": target_label,
        "precision": precision_of(info, proto),
        "variant": info.variant if info else None,
        "lowering": info.lowering if info else None,
        "onnx": str(src.resolve()),
        "onnx_name": src.name,
        "onnx_sha256": sha256_file(src),
        "profiles": {axis: list(rng) for axis, rng in profiles.items()},
        "profile_shapes": {name: {"min": list(lo), "opt": list(mid), "max": list(hi)}
                           for name, (lo, mid, hi) in seen["profile_shapes"].items()},
        "inputs": inputs,
        "outputs": outputs,
        "plugins": plugin_info,
        "layers": seen["layers"],
        "plugin_layers": n_plugin,
        "plugin_layer_names": [name for name, _ in seen["plugin_layers"]],
        "custom_nodes": customs,
        "inlined_custom_nodes": inlined,
        "attention": seen["attention"],
        "timing_cache": (str(timing_cache) if timing_cache and not trt_info.is_rtx else None),
        "workspace": parse_size(workspace),
        "attnx_version": attnx.__version__,
        "built_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "build_seconds": round(build_seconds, 3),
    }
    write_engine(engine_path, plan, sidecar)
    return EngineBuild(engine_path=engine_path, sidecar_path=sidecar_path(engine_path), sidecar=sidecar, onnx_path=src,
                       converted_fp16=converted, layers=seen["layers"], plugin_layers=n_plugin,
                       custom_nodes=n_custom, inlined_custom_nodes=inlined, seconds=time.monotonic() - started)

