"""The one adapter over TensorRT: ``tensorrt`` (preferred) or TensorRT for RTX.

Everything in attnx that touches TensorRT goes through this module, so the rest of the
code does not care which of the two is installed:

- full TensorRT: the ``tensorrt`` package (``pip install attnx[tensorrt]``; the libraries
  come from NVIDIA's package index). Builds engines for the local GPU.
- TensorRT for RTX: the ``tensorrt-rtx-cu13-libs`` / ``-bindings`` wheels
  (``pip install attnx[rtx]``), imported as ``tensorrt_rtx_libs`` then
  ``tensorrt_rtx_bindings``. Builds engines for a chosen compute capability without a GPU
  (SM75, SM80, SM86, SM89, SM120, SM121; no SM90), runs them on a GPU of that SM.

``$ATTNX_TENSORRT_BACKEND`` = ``auto`` (default) | ``tensorrt`` | ``rtx`` forces a choice.

Typical use::

    from attnx.runtime import tensorrt_backend as tb
    tb.backend()                                   # BackendInfo(name, version, is_rtx)
    net = tb.parse_onnx("maw.onnx")                # loads the plugins, plugin override on
    tb.layer_type_counts(net.network)              # {"PLUGIN_V3": 2, ...}
    plan = tb.build_engine("maw.onnx", target="sm89",
                           profiles={"batch": (1, 4, 16), "seq": (1, 64, 256)})
    engine = tb.deserialize(plan)                  # needs a GPU (else EngineUnavailable)
    outputs = engine.run({"hidden_states": x, "attention_mask": m})

Errors are exceptions with the cause in the message: :class:`TensorRTUnavailable` (neither
package importable; says which extra to install), :class:`PluginLoadError`,
:class:`ParseError` (parser errors plus the plugins' own messages, e.g. a trace of the
wrong size), :class:`BuildError`, :class:`EngineUnavailable` (no GPU / wrong GPU).

Known traps handled here (see shared/spec/environment.md):
- TensorRT-RTX's ONNX parser ``dlopen``s ``libtensorrt_rtx.so``, which the wheel lacks
  (it ships ``.so.1``) and aborts the process; :func:`backend` creates the symlink next
  to the wheel's library (the parser's RPATH is ``$ORIGIN``) or explains how to fix it.
- Plugins are loaded through ``IPluginRegistry.load_library`` (not ``dlopen``), which
  calls the library's ``getCreators`` / ``setLoggerFinder``.
- Polygraphy imports a module named ``tensorrt_rtx``: :func:`register_polygraphy_alias`.
- TensorRT-RTX 1.7 fails to build the parsed ONNX ``Attention`` layers (fp32 attention, fp16 with
  odd head sizes, fp32 attention islands in fp16 models): :func:`build_engine` applies
  :func:`prepare_attention` to every network first.

Measured with TensorRT-RTX 1.7.1.116 (CPU-only machine): engines build for SM75-SM121 and
call the plugins' build-time methods; timing caches are no-ops (``timing_cache`` is ignored);
engines cannot be deserialized without a GPU (:class:`EngineUnavailable`); once the plugin
library is registered the parser picks the plugin even without the override flag (set anyway,
as TensorRT documents it); its ``ILoggerFinder::findLogger`` returns null, so the plugins log
through the library's ``getLogger()`` (and keep their errors for :func:`attnx.plugins.plugin_errors`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import json
import logging
import os
import sys
import threading
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

__all__ = [
    "BACKEND_ENV",
    "INSTALL_HINT",
    "TensorRTError",
    "TensorRTUnavailable",
    "PluginLoadError",
    "ParseError",
    "BuildError",
    "EngineUnavailable",
    "BackendInfo",
    "select_backend",
    "backend",
    "is_available",
    "reset_backend",
    "Logger",
    "get_logger",
    "PluginLibrary",
    "load_plugins",
    "ParsedNetwork",
    "TensorInfo",
    "parse_onnx",
    "layer_type_counts",
    "network_inputs",
    "network_outputs",
    "parse_target",
    "apply_target",
    "resolve_profiles",
    "prepare_attention",
    "NetworkHook",
    "build_engine",
    "Engine",
    "deserialize",
    "load_engine",
    "gpu_compute_capability",
    "register_polygraphy_alias",
]

_log = logging.getLogger("attnx.tensorrt")
_log.addHandler(logging.NullHandler())  # a library: the application decides what TensorRT's chatter shows

BACKEND_ENV = "ATTNX_TENSORRT_BACKEND"
INSTALL_HINT = ("install TensorRT: `pip install attnx[tensorrt]` (full TensorRT, for the local GPU; the libraries "
                "come from NVIDIA's package index) or `pip install attnx[rtx]` (TensorRT for RTX: builds engines "
                "for a chosen GPU architecture, even without a GPU)")
ATTNX_PLUGINS = (("MawDepthSelect", "1", "attnx"), ("TtaDistance", "1", "attnx"))
CUSTOM_DOMAIN = "attnx"


class TensorRTError(RuntimeError):
    """Base class of this module's errors."""


class TensorRTUnavailable(TensorRTError):
    """Neither ``tensorrt`` nor TensorRT for RTX can be imported (or the chosen one cannot)."""


class PluginLoadError(TensorRTError):
    """The attnx plugin library is missing or TensorRT's registry refused it."""


class ParseError(TensorRTError):
    """The ONNX parser failed; ``errors`` holds the parser's and the plugins' messages."""

    def __init__(self, message: str, errors: Sequence[str] = ()):
        super().__init__(message)
        self.errors = list(errors)


class BuildError(TensorRTError):
    """The engine build failed (or was asked for something this backend cannot do)."""

    def __init__(self, message: str, errors: Sequence[str] = ()):
        super().__init__(message)
        self.errors = list(errors)


class EngineUnavailable(TensorRTError):
    """An engine cannot be deserialized or run here (no GPU, or a GPU it was not built for)."""


# ============================================================================ backend selection


@dataclass(frozen=True)
class BackendInfo:
    """The selected TensorRT flavour. ``module`` is the imported bindings module."""

    name: str  # "tensorrt" | "tensorrt-rtx"
    version: str
    is_rtx: bool
    module: Any = field(repr=False, compare=False, default=None)

    @property
    def targets(self) -> tuple[str, ...]:
        """Compute capabilities an engine can be built for without that GPU ("sm89", ...);
        empty for full TensorRT, which builds for the local GPU only."""
        if not self.is_rtx or self.module is None:
            return ()
        names = getattr(self.module.ComputeCapability, "__members__", {})
        return tuple(n.lower() for n in names if n.upper().startswith("SM"))

    def describe(self) -> str:
        return f"{'TensorRT for RTX' if self.is_rtx else 'TensorRT'} {self.version}"


def _import_tensorrt():
    import tensorrt as trt  # noqa: PLC0415

    if not hasattr(trt, "Builder"):  # the PyPI stub without libraries imports but has no API
        raise ImportError("the installed `tensorrt` package has no libraries (a PyPI stub?)")
    return trt


def _import_tensorrt_rtx():
    import tensorrt_rtx_libs  # noqa: F401, PLC0415  (loads the shared libraries first)
    import tensorrt_rtx_bindings as trt  # noqa: PLC0415

    return trt


#: name -> importer; tests may pass their own mapping to :func:`select_backend`.
IMPORTERS: dict[str, Callable[[], Any]] = {"tensorrt": _import_tensorrt, "tensorrt-rtx": _import_tensorrt_rtx}

_PREFERENCES = {
    "auto": ("tensorrt", "tensorrt-rtx"),
    "": ("tensorrt", "tensorrt-rtx"),
    "tensorrt": ("tensorrt",),
    "trt": ("tensorrt",),
    "rtx": ("tensorrt-rtx",),
    "tensorrt-rtx": ("tensorrt-rtx",),
    "tensorrt_rtx": ("tensorrt-rtx",),
}


def select_backend(preference: str | None = "auto",
                   importers: Mapping[str, Callable[[], Any]] | None = None) -> BackendInfo:
    """Pick a backend: ``tensorrt`` first (when importable and real), else TensorRT for RTX.

    ``preference``: ``auto`` | ``tensorrt`` | ``rtx``. Raises :class:`TensorRTUnavailable`
    naming what failed and which extra to install."""
    key = (preference or "auto").strip().lower()
    if key not in _PREFERENCES:
        raise TensorRTUnavailable(f"unknown TensorRT backend {preference!r} (${BACKEND_ENV}): use auto, tensorrt or rtx")
    importers = importers if importers is not None else IMPORTERS
    problems = []
    for name in _PREFERENCES[key]:
        try:
            module = importers[name]()
        except Exception as e:  # ImportError, OSError from missing libraries, ...
            problems.append(f"{name}: {type(e).__name__}: {e}")
            continue
        version = str(getattr(module, "__version__", "unknown"))
        return BackendInfo(name=name, version=version, is_rtx=name == "tensorrt-rtx", module=module)
    if key in ("tensorrt", "trt"):
        hint = "install full TensorRT: `pip install attnx[tensorrt]` (the libraries come from NVIDIA's package index)"
    elif key.startswith(("rtx", "tensorrt-rtx", "tensorrt_rtx")):
        hint = "install TensorRT for RTX: `pip install attnx[rtx]`"
    else:
        hint = INSTALL_HINT
    raise TensorRTUnavailable(f"no usable TensorRT ({'; '.join(problems)}); {hint}")


_backend_lock = threading.RLock()
_backend: BackendInfo | None = None
_rtx_link_problem: str | None = None


def backend() -> BackendInfo:
    """The process-wide backend (selected once; ``$ATTNX_TENSORRT_BACKEND`` overrides)."""
    global _backend, _rtx_link_problem
    with _backend_lock:
        if _backend is None:
            info = select_backend(os.environ.get(BACKEND_ENV, "auto"))
            if info.is_rtx:
                _rtx_link_problem = _ensure_rtx_unversioned_library()
            _backend = info
            _log.debug("TensorRT backend: %s", info.describe())
        return _backend


def is_available() -> bool:
    try:
        backend()
    except TensorRTUnavailable:
        return False
    return True


def reset_backend() -> None:
    """Forget the selection (tests). Loaded libraries stay loaded, and so does their record:
    the process-wide registry refuses a second load of the same library."""
    global _backend, _logger
    with _backend_lock:
        _backend = None
        _logger = None


def _ensure_rtx_unversioned_library() -> str | None:
    """Make ``dlopen("libtensorrt_rtx.so")`` from the RTX libraries succeed; None when fine,
    else a message saying how to fix it."""
    try:
        import tensorrt_rtx_libs  # noqa: PLC0415
    except ImportError:
        return None
    libs_dir = Path(tensorrt_rtx_libs.__file__).resolve().parent
    versioned = sorted(libs_dir.glob("libtensorrt_rtx.so.*"))
    if not versioned:
        return None
    link = libs_dir / "libtensorrt_rtx.so"
    if link.exists():
        return None
    try:
        link.symlink_to(versioned[0].name)
        _log.info("created %s -> %s (TensorRT-RTX's ONNX parser dlopens the unversioned name)", link, versioned[0].name)
        return None
    except FileExistsError:
        return None
    except OSError as e:
        reason = f"{type(e).__name__}: {e}"
    # The wheel folder is read-only. A folder on LD_LIBRARY_PATH (read at process start) also works.
    for folder in filter(None, os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep)):
        if (Path(folder) / "libtensorrt_rtx.so").exists():
            return None
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "attnx" / "tensorrt-rtx-lib"
    try:
        cache.mkdir(parents=True, exist_ok=True)
        alt = cache / "libtensorrt_rtx.so"
        if not alt.exists():
            alt.symlink_to(versioned[0])
        where = f"or start Python with LD_LIBRARY_PATH={cache} (a symlink is there)"
    except OSError:
        where = "or put such a symlink in a folder on LD_LIBRARY_PATH before starting Python"
    return (f"TensorRT-RTX's ONNX parser needs {link} (it dlopens the unversioned name and aborts the process "
            f"without it), and creating it failed ({reason}). Run `ln -s {versioned[0].name} {link}`, {where}.")


def register_polygraphy_alias() -> bool:
    """Let Polygraphy (``POLYGRAPHY_USE_TENSORRT_RTX=1``) import TensorRT-RTX, which it expects as a
    module named ``tensorrt_rtx``. Returns True when the alias is in place (or not needed)."""
    info = backend()
    if not info.is_rtx:
        return True
    if "tensorrt_rtx" not in sys.modules:
        sys.modules["tensorrt_rtx"] = info.module
    return True


# ============================================================================ logging


_SEVERITY_NAMES = ("internal_error", "error", "warning", "info", "verbose")
_SEVERITY_TO_LOGGING = {0: logging.CRITICAL, 1: logging.ERROR, 2: logging.WARNING, 3: logging.DEBUG, 4: logging.DEBUG}


class Logger:
    """The process-wide TensorRT logger (use :func:`get_logger`).

    Forwards messages to Python's ``logging`` (logger ``attnx.tensorrt``; TensorRT's INFO and
    VERBOSE at DEBUG) and keeps recent warnings/errors and every plugin message, so errors can
    quote them. ``native`` is the object to hand to TensorRT APIs (Builder, Runtime, parser).
    One logger serves all builders and runtimes: TensorRT-RTX's plugins find the logger of
    the most recent builder/runtime, and a Python logger must outlive what uses it.
    """

    def __init__(self, info: BackendInfo, keep: int = 1000):
        self.backend = info
        self._lock = threading.Lock()
        self._records: deque[tuple[int, str, str]] = deque(maxlen=keep)  # (seq, severity, message)
        self._seq = 0
        trt = info.module
        owner = self

        class _NativeLogger(trt.ILogger):  # type: ignore[misc, name-defined]
            def __init__(self):
                trt.ILogger.__init__(self)

            def log(self, severity, msg):  # called by TensorRT, possibly from its threads
                try:
                    owner._record(int(severity), str(msg))
                except Exception:  # never raise into TensorRT
                    pass

        self.native = _NativeLogger()

    def _record(self, severity: int, message: str) -> None:
        severity = min(max(severity, 0), 4)
        keep = severity <= 2 or "attnx" in message
        with self._lock:
            self._seq += 1
            if keep:
                self._records.append((self._seq, _SEVERITY_NAMES[severity], message))
        _log.log(_SEVERITY_TO_LOGGING[severity], "%s", message)

    def mark(self) -> int:
        """A position; :meth:`messages` (since=mark) returns what was logged after it."""
        with self._lock:
            return self._seq

    def messages(self, since: int = 0, severities: Iterable[str] = ("internal_error", "error")) -> list[str]:
        wanted = set(severities)
        with self._lock:
            return [m for seq, sev, m in self._records if seq > since and sev in wanted]

    def plugin_messages(self, since: int = 0) -> list[str]:
        with self._lock:
            return [m for seq, _sev, m in self._records if seq > since and f"{CUSTOM_DOMAIN}::" in m]


_logger: Logger | None = None


def get_logger() -> Logger:
    global _logger
    with _backend_lock:
        info = backend()
        if _logger is None or _logger.backend is not info:
            _logger = Logger(info)
        return _logger


def _unique(lines: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(line.strip() for line in lines if line and line.strip()))


# ============================================================================ plugins


@dataclass(frozen=True)
class PluginLibrary:
    path: Path
    creators: tuple[tuple[str, str, str], ...]  # (name, version, namespace) of the attnx creators
    handle: Any = field(repr=False, compare=False, default=None)


_loaded_plugins: dict[str, PluginLibrary] = {}


def load_plugins(path: str | os.PathLike | None = None) -> PluginLibrary:
    """Load the attnx plugin library through TensorRT's plugin registry (once per path).

    ``path`` defaults to :func:`attnx.plugins.library_path`. Raises :class:`PluginLoadError`
    when the library is missing (saying to run ``attnx plugins build``) or refused."""
    from attnx import plugins as plugin_pkg  # noqa: PLC0415

    info = backend()
    logger = get_logger()
    if path is None:
        try:
            path = plugin_pkg.require_library()
        except FileNotFoundError as e:
            raise PluginLoadError(str(e)) from None
    lib = Path(path).expanduser()
    if not lib.is_file():
        raise PluginLoadError(f"plugin library {lib} does not exist; run `attnx plugins build`")
    key = str(lib.resolve())
    with _backend_lock:
        if key in _loaded_plugins:
            return _loaded_plugins[key]
        trt = info.module
        registry = trt.get_plugin_registry()
        mark = logger.mark()
        try:
            handle = registry.load_library(key)
        except Exception as e:  # some versions raise instead of returning None
            handle = None
            failure = f"{type(e).__name__}: {e}"
        else:
            failure = ""
        if handle is None:
            detail = "; ".join(_unique([failure, *logger.messages(mark, ("internal_error", "error", "warning"))]))
            raise PluginLoadError(f"{info.describe()} refused the plugin library {key}"
                                  + (f": {detail}" if detail else "")
                                  + " (it must export getCreators and setLoggerFinder; rebuild with `attnx plugins build`)")
        creators = tuple(sorted({(c.name, c.plugin_version, c.plugin_namespace) for c in registry.all_creators
                                 if c.plugin_namespace == CUSTOM_DOMAIN}))
        missing = [f"{ns}::{n} v{v}" for n, v, ns in ATTNX_PLUGINS if (n, v, ns) not in creators]
        if missing:
            raise PluginLoadError(f"{key} loaded but does not provide {', '.join(missing)}")
        loaded = PluginLibrary(path=Path(key), creators=creators, handle=handle)
        _loaded_plugins[key] = loaded
        return loaded


def _plugin_errors(library: PluginLibrary | None) -> list[str]:
    if library is None:
        return []
    from attnx.plugins import plugin_errors  # noqa: PLC0415

    return plugin_errors(library.path)


def _clear_plugin_errors(library: PluginLibrary | None) -> None:
    if library is not None:
        from attnx.plugins import clear_plugin_errors  # noqa: PLC0415

        clear_plugin_errors(library.path)


# ============================================================================ parsing


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # -1 for dynamic dims
    dtype: str  # "float32", "float16", "int64", ...


def _dtype_name(trt, dtype) -> str:
    try:
        return np.dtype(trt.nptype(dtype)).name
    except Exception:
        return str(dtype).split(".")[-1].lower()


def network_inputs(network) -> list[TensorInfo]:
    trt = backend().module
    return [TensorInfo(t.name, tuple(t.shape), _dtype_name(trt, t.dtype))
            for t in (network.get_input(i) for i in range(network.num_inputs))]


def network_outputs(network) -> list[TensorInfo]:
    trt = backend().module
    return [TensorInfo(t.name, tuple(t.shape), _dtype_name(trt, t.dtype))
            for t in (network.get_output(i) for i in range(network.num_outputs))]


def layer_type_counts(network) -> dict[str, int]:
    """Layers of a network by type name (``{"PLUGIN_V3": 2, "MATRIX_MULTIPLY": 8, ...}``)."""
    counts: dict[str, int] = {}
    for i in range(network.num_layers):
        name = str(network.get_layer(i).type).split(".")[-1]
        counts[name] = counts.get(name, 0) + 1
    return dict(sorted(counts.items()))


@dataclass
class ParsedNetwork:
    """A parsed network and the objects that must outlive it."""

    path: Path
    builder: Any
    network: Any
    parser: Any
    plugins: PluginLibrary | None
    #: What :func:`prepare_attention` did to the network (set by :func:`build_engine`), else None.
    attention: dict | None = None

    @property
    def inputs(self) -> list[TensorInfo]:
        return network_inputs(self.network)

    @property
    def outputs(self) -> list[TensorInfo]:
        return network_outputs(self.network)

    def layer_type_counts(self) -> dict[str, int]:
        return layer_type_counts(self.network)

    def plugin_layers(self) -> list[tuple[str, str]]:
        """(layer name, type) of the plugin layers."""
        out = []
        for i in range(self.network.num_layers):
            layer = self.network.get_layer(i)
            kind = str(layer.type).split(".")[-1]
            if kind.startswith("PLUGIN"):
                out.append((layer.name, kind))
        return out


def _onnx_graph_info(path: Path):
    """(custom-domain op types used, {input: [dim names or ints]}, metadata) without loading weights."""
    import onnx  # noqa: PLC0415

    model = onnx.load(str(path), load_external_data=False)
    used = sorted({n.op_type for n in model.graph.node if n.domain == CUSTOM_DOMAIN})
    dims: dict[str, list] = {}
    initializers = {i.name for i in model.graph.initializer}
    for v in model.graph.input:
        if v.name in initializers:
            continue
        shape = v.type.tensor_type.shape
        dims[v.name] = [d.dim_param if d.dim_param else (d.dim_value if d.HasField("dim_value") else None)
                        for d in shape.dim]
    meta = {p.key: p.value for p in model.metadata_props}
    return used, dims, meta


def parse_onnx(path: str | os.PathLike, *, plugin_override: bool = True,
               plugins: str | os.PathLike | bool | None = True, strongly_typed: bool = True) -> ParsedNetwork:
    """Parse an ONNX file into a (strongly typed) network.

    ``plugins``: True loads the built attnx plugin library (required when the model has
    ``attnx`` nodes), a path loads that library, False/None loads none.
    ``plugin_override`` sets ``OnnxParserFlag.ENABLE_PLUGIN_OVERRIDE`` so custom nodes that also
    carry a local function become plugin layers instead of the inlined function body.
    Raises :class:`ParseError` with the parser's errors and the plugins' messages."""
    info = backend()
    trt = info.module
    logger = get_logger()
    onnx_path = Path(path)
    if not onnx_path.is_file():
        raise FileNotFoundError(f"no ONNX file at {onnx_path}")
    used_ops, _dims, _meta = _onnx_graph_info(onnx_path)
    library: PluginLibrary | None = None
    if plugins:
        try:
            library = load_plugins(None if plugins is True else plugins)
        except PluginLoadError:
            if used_ops:
                raise
            library = None  # a model without attnx nodes does not need them
    if used_ops and info.is_rtx and _rtx_link_problem:
        raise ParseError(_rtx_link_problem)
    if used_ops and library is None:
        _log.warning("%s uses attnx ops %s but no plugin library is loaded: TensorRT will inline their "
                     "function bodies", onnx_path.name, ", ".join(used_ops))

    builder = trt.Builder(logger.native)
    flags = 0
    if strongly_typed:
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger.native)
    if plugin_override:
        parser.set_flag(trt.OnnxParserFlag.ENABLE_PLUGIN_OVERRIDE)
    mark = logger.mark()
    _clear_plugin_errors(library)
    ok = parser.parse_from_file(str(onnx_path))
    if not ok:
        errors = []
        for i in range(parser.num_errors):
            e = parser.get_error(i)
            try:
                where = e.node_name() or f"node {e.node()}"
                errors.append(f"{where} ({e.node_operator()}): {e.desc()}")
            except Exception:
                errors.append(str(e))
        plugin_msgs = _unique([*_plugin_errors(library), *logger.plugin_messages(mark)])
        detail = _unique([*plugin_msgs, *errors])
        raise ParseError(f"TensorRT ({info.describe()}) could not parse {onnx_path}: " + " | ".join(detail),
                         errors=detail)
    return ParsedNetwork(path=onnx_path, builder=builder, network=network, parser=parser, plugins=library)


# ============================================================================ building


def parse_target(target: str | int | None, info: BackendInfo | None = None):
    """``"sm89"`` / ``"sm_89"`` / ``"8.9"`` / ``89`` -> the backend's ComputeCapability (RTX), or the
    SM number as int (full TensorRT). None -> None."""
    if target is None:
        return None
    text = str(target).strip().lower().replace("sm_", "").replace("sm", "").replace("compute_", "")
    if "." in text:
        major, _, minor = text.partition(".")
        text = f"{major}{minor}"
    if not text.isdigit():
        raise BuildError(f"bad target {target!r}: use a compute capability like sm89")
    sm = int(text)
    info = info or backend()
    if not info.is_rtx:
        return sm
    cc = getattr(info.module.ComputeCapability, f"SM{sm}", None)
    if cc is None:
        raise BuildError(f"TensorRT-RTX {info.version} cannot target sm{sm}; it supports "
                         f"{', '.join(t for t in info.targets) or 'none'} (Hopper sm90 is not among them)")
    return cc


def apply_target(config, target: str | int | None, info: BackendInfo | None = None) -> str:
    """Point a builder config at the GPU architecture to build for; returns it as "sm89".

    TensorRT-RTX: the given compute capability (None = the local GPU, which must exist).
    Full TensorRT: always the local GPU; ``target`` may only name that one."""
    info = info or backend()
    if info.is_rtx:
        cc = parse_target(target, info)
        if cc is None:
            local = gpu_compute_capability()
            if local is None:
                raise BuildError("TensorRT-RTX needs a target compute capability on a machine without a GPU: pass "
                                 f"target='sm89' (available: {', '.join(info.targets)})")
            cc = info.module.ComputeCapability.CURRENT
            name = f"sm{local[0]}{local[1]}"
        else:
            name = str(cc).split(".")[-1].lower()
        config.num_compute_capabilities = 1
        config.set_compute_capability(cc, 0)
        return name
    local = gpu_compute_capability()
    if local is None:
        raise BuildError("full TensorRT builds engines for the local GPU and none was found; use TensorRT for RTX "
                         "(`pip install attnx[rtx]`) to build for another GPU")
    wanted = parse_target(target, info)
    local_sm = local[0] * 10 + local[1]
    if wanted is not None and wanted != local_sm:
        raise BuildError(f"full TensorRT builds for the local GPU (sm{local_sm}), not sm{wanted}; build on a "
                         "machine with that GPU, or use TensorRT for RTX (`pip install attnx[rtx]`)")
    return f"sm{local_sm}"


def resolve_profiles(onnx_path: str | os.PathLike, *, profiles: Mapping[str, Sequence[int]] | None = None,
                     shapes: Mapping[str, Sequence[Sequence[int]]] | None = None,
                     network=None) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """Optimization-profile shapes per input: ``{input: (min_shape, opt_shape, max_shape)}``.

    Dynamic dims are named in the ONNX file (``batch``, ``seq``); ``profiles`` gives each name
    ``(min, opt, max)`` and defaults to the model's ``attnx.profiles`` metadata. ``shapes``
    overrides whole inputs. Inputs without dynamic dims are left out."""
    used_ops, dims, meta = _onnx_graph_info(Path(onnx_path))
    del used_ops
    ranges: dict[str, tuple[int, int, int]] = {}
    if profiles is None and meta.get("attnx.profiles"):
        try:
            profiles = json.loads(meta["attnx.profiles"])
        except json.JSONDecodeError as e:
            raise BuildError(f"{onnx_path}: bad attnx.profiles metadata ({e})") from None
    for name, rng in (profiles or {}).items():
        values = tuple(int(v) for v in rng)
        if len(values) != 3 or not 0 <= values[0] <= values[1] <= values[2]:
            raise BuildError(f"profile range for {name!r} must be (min, opt, max) with min <= opt <= max, got {rng}")
        ranges[name] = values  # type: ignore[assignment]
    out: dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = {}
    net_shapes = {t.name: t.shape for t in network_inputs(network)} if network is not None else {}
    for name, dim_list in dims.items():
        if shapes and name in shapes:
            given = [tuple(int(v) for v in s) for s in shapes[name]]
            if len(given) != 3:
                raise BuildError(f"shapes[{name!r}] must be (min_shape, opt_shape, max_shape)")
            out[name] = (given[0], given[1], given[2])
            continue
        known = net_shapes.get(name)
        if not any(isinstance(d, str) or d is None for d in dim_list) and not (known and -1 in known):
            continue
        mins, opts, maxs = [], [], []
        for axis, d in enumerate(dim_list):
            if isinstance(d, int) and d > 0:
                mins.append(d)
                opts.append(d)
                maxs.append(d)
            elif isinstance(d, str) and d in ranges:
                lo, mid, hi = ranges[d]
                mins.append(lo)
                opts.append(mid)
                maxs.append(hi)
            else:
                label = f"dynamic dim {d!r}" if d else f"unnamed dynamic dim {axis}"
                raise BuildError(f"no optimization-profile range for the {label} of input {name!r}; pass "
                                 f"profiles={{'{d or 'name'}': (min, opt, max)}} or shapes={{'{name}': (min, opt, max)}}")
        out[name] = (tuple(mins), tuple(opts), tuple(maxs))
    return out


def _layers(network):
    for i in range(network.num_layers):
        yield network.get_layer(i)


def prepare_attention(network) -> dict:
    """Make the ONNX ``Attention`` layers buildable by TensorRT-RTX 1.7 (measured here;
    :func:`build_engine` calls it on every network it builds):

    - they are marked *decomposable*: without it the build fails ("Attention operation was not
      supported by a dedicated kernel") for every fp32 attention and for fp16 attention with
      head sizes that have no fused kernel (e.g. 8); with it TensorRT uses a fused kernel where
      one exists and decomposes the rest;
    - in an fp16 model with fp32 attention islands (``attnx.export.to_fp16`` keeps Attention in
      fp32), the additive mask is handed to the attention in fp16 instead of through its
      fp16->fp32 Cast: the build otherwise fails inside Myelin ("Input 0's element type (half)
      differs from input 1's element type (float)"). Exact: that Cast is lossless.

    A TensorRT without ``IAttention`` layers (the parser decomposes attention itself) is left
    alone. Returns ``{"layers": n, "decomposable": n_marked, "mask_casts_bypassed": k}``."""
    trt = backend().module
    stats = {"layers": 0, "decomposable": 0, "mask_casts_bypassed": 0}
    input_type = getattr(getattr(trt, "LayerType", None), "ATTENTION_INPUT", None)
    layer_cls = getattr(trt, "IAttentionInputLayer", None)
    if input_type is None or layer_cls is None:
        return stats  # a TensorRT without IAttention: the parser decomposes attention itself
    producers = {}
    for layer in _layers(network):
        for j in range(layer.num_outputs):
            producers[layer.get_output(j).name] = layer
    for layer in _layers(network):
        if layer.type != input_type:
            continue
        try:
            layer.__class__ = layer_cls  # pybind downcast, as Polygraphy does
            att = layer.attention
        except (AttributeError, TypeError):
            continue
        stats["layers"] += 1
        if hasattr(att, "decomposable") and not att.decomposable:
            att.decomposable = True
            stats["decomposable"] += 1
        mask = getattr(att, "mask", None)
        query = att.get_input(0) if att.num_inputs else None
        cast = producers.get(mask.name) if mask is not None else None
        if cast is None or query is None or cast.type != trt.LayerType.CAST:
            continue
        src = cast.get_input(0)
        if query.dtype == trt.DataType.FLOAT and mask.dtype == trt.DataType.FLOAT and src.dtype == trt.DataType.HALF:
            att.mask = src
            stats["mask_casts_bypassed"] += 1
    return stats


#: ``network_hook(parsed, profile_shapes)`` of :func:`build_engine`.
NetworkHook = Callable[[ParsedNetwork, Mapping[str, tuple]], None]


def build_engine(onnx_path: str | os.PathLike, *, plugins: str | os.PathLike | bool | None = True,
                 target: str | int | None = "sm89", profiles: Mapping[str, Sequence[int]] | None = None,
                 shapes: Mapping[str, Sequence[Sequence[int]]] | None = None,
                 timing_cache: str | os.PathLike | None = None, workspace: int | None = None,
                 optimization_level: int | None = None, network_hook: NetworkHook | None = None) -> bytes:
    """Build a serialized engine (plan bytes) from an ONNX file.

    - ``target``: TensorRT-RTX builds for this compute capability (``"sm89"`` default; None =
      the local GPU). Full TensorRT builds for the local GPU; a different ``target`` is an error.
    - ``profiles`` / ``shapes``: see :func:`resolve_profiles` (default: the model's metadata).
    - ``timing_cache``: a file read when present and written after the build (full TensorRT;
      TensorRT-RTX has no timing cache, the argument is ignored there).
    - ``workspace``: workspace memory-pool limit in bytes.
    - ``network_hook(parsed, profile_shapes)``: called just before the build with the
      :class:`ParsedNetwork` and the optimization-profile shapes (:func:`resolve_profiles`), to
      inspect the network (layer counts, plugin layers; ``parsed.attention``) or adjust it.
    The parsed network goes through :func:`prepare_attention` first (its counts are kept in
    ``parsed.attention``). The network is strongly typed (fp16 comes from an fp16 ONNX; there is
    no FP16 flag). Raises :class:`BuildError` (with the plugins' messages), :class:`ParseError`, ...
    """
    info = backend()
    trt = info.module
    logger = get_logger()
    parsed = parse_onnx(onnx_path, plugins=plugins)
    builder, network = parsed.builder, parsed.network
    parsed.attention = prepare_attention(network)
    config = builder.create_builder_config()

    apply_target(config, target, info)

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

    cache_path = Path(timing_cache) if timing_cache else None
    if cache_path is not None and info.is_rtx:
        _log.debug("timing caches are no-ops in TensorRT-RTX; %s is not used", cache_path)
        cache_path = None
    if cache_path is not None:
        data = cache_path.read_bytes() if cache_path.is_file() else b""
        cache = config.create_timing_cache(data)
        config.set_timing_cache(cache, False)

    mark = logger.mark()
    _clear_plugin_errors(parsed.plugins)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        plugin_msgs = _unique([*_plugin_errors(parsed.plugins), *logger.plugin_messages(mark)])
        errors = _unique([*plugin_msgs, *logger.messages(mark)])
        raise BuildError(f"TensorRT ({info.describe()}) could not build an engine from {onnx_path}: "
                         + (" | ".join(errors) if errors else "no error message (run with logging at DEBUG)"),
                         errors=errors)
    if cache_path is not None:
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        cache_path.write_bytes(bytes(config.get_timing_cache().serialize()))
    return bytes(plan)


# ============================================================================ CUDA runtime (ctypes)


class _CudaRuntime:
    """Just enough of libcudart (through ctypes) to move numpy arrays to and from an engine."""

    H2D = 1
    D2H = 2

    def __init__(self):
        self.lib = self._load()
        lib = self.lib
        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        lib.cudaGetDeviceCount.argtypes = [ctypes.POINTER(ctypes.c_int)]
        lib.cudaGetDevice.argtypes = [ctypes.POINTER(ctypes.c_int)]
        lib.cudaDeviceGetAttribute.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int]
        lib.cudaMalloc.argtypes = [ctypes.POINTER(vp), sz]
        lib.cudaFree.argtypes = [vp]
        lib.cudaMemcpyAsync.argtypes = [vp, vp, sz, ctypes.c_int, vp]
        lib.cudaStreamCreate.argtypes = [ctypes.POINTER(vp)]
        lib.cudaStreamSynchronize.argtypes = [vp]
        lib.cudaStreamDestroy.argtypes = [vp]
        lib.cudaGetErrorString.argtypes = [ctypes.c_int]
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        for fn in ("cudaGetDeviceCount", "cudaGetDevice", "cudaDeviceGetAttribute", "cudaMalloc", "cudaFree",
                   "cudaMemcpyAsync", "cudaStreamCreate", "cudaStreamSynchronize", "cudaStreamDestroy"):
            getattr(lib, fn).restype = ctypes.c_int

    @staticmethod
    def _load():
        names = ["libcudart.so.13", "libcudart.so.12", "libcudart.so"]
        found = ctypes.util.find_library("cudart")
        if found:
            names.append(found)
        for name in names:
            try:
                return ctypes.CDLL(name)
            except OSError:
                continue
        # The nvidia-cuda-runtime wheels (nvidia/cu13/lib, nvidia/cuda_runtime/lib).
        for base in sys.path:
            for pattern in ("nvidia/cu1*/lib/libcudart.so.*", "nvidia/cuda_runtime/lib/libcudart.so.*"):
                for candidate in sorted(glob.glob(os.path.join(base, pattern)), reverse=True):
                    try:
                        return ctypes.CDLL(candidate)
                    except OSError:
                        continue
        raise OSError("libcudart not found (install the CUDA runtime, e.g. `pip install nvidia-cuda-runtime`)")

    def check(self, status: int, what: str) -> None:
        if status != 0:
            msg = self.lib.cudaGetErrorString(status)
            raise RuntimeError(f"{what} failed: cudaError {status} ({msg.decode() if msg else '?'})")

    def device_count(self) -> int:
        n = ctypes.c_int(0)
        return n.value if self.lib.cudaGetDeviceCount(ctypes.byref(n)) == 0 else 0

    def compute_capability(self) -> tuple[int, int] | None:
        if self.device_count() < 1:
            return None
        dev = ctypes.c_int(0)
        self.lib.cudaGetDevice(ctypes.byref(dev))
        major, minor = ctypes.c_int(0), ctypes.c_int(0)
        if self.lib.cudaDeviceGetAttribute(ctypes.byref(major), 75, dev.value) != 0:  # ComputeCapabilityMajor
            return None
        if self.lib.cudaDeviceGetAttribute(ctypes.byref(minor), 76, dev.value) != 0:  # ComputeCapabilityMinor
            return None
        return major.value, minor.value


_cudart: _CudaRuntime | None = None


def _cuda() -> _CudaRuntime | None:
    global _cudart
    if _cudart is None:
        try:
            _cudart = _CudaRuntime()
        except OSError as e:
            _log.debug("no CUDA runtime: %s", e)
            return None
    return _cudart


def gpu_compute_capability() -> tuple[int, int] | None:
    """(major, minor) of the current CUDA device, or None without a usable GPU/driver."""
    cuda = _cuda()
    return cuda.compute_capability() if cuda is not None else None


# ============================================================================ engines


@dataclass(frozen=True)
class IOTensor:
    name: str
    is_input: bool
    dtype: np.dtype
    shape: tuple[int, ...]  # -1 for dynamic dims


class _DeviceBuffer:
    def __init__(self, cuda: _CudaRuntime):
        self.cuda = cuda
        self.ptr = ctypes.c_void_p(0)
        self.size = 0

    def ensure(self, nbytes: int) -> int:
        if nbytes > self.size:
            self.free()
            cap = max(nbytes, 256)
            self.cuda.check(self.cuda.lib.cudaMalloc(ctypes.byref(self.ptr), cap), "cudaMalloc")
            self.size = cap
        return self.ptr.value or 0

    def free(self) -> None:
        if self.ptr.value:
            self.cuda.lib.cudaFree(self.ptr)
        self.ptr = ctypes.c_void_p(0)
        self.size = 0


class Engine:
    """A deserialized engine with one execution context; :meth:`run` is thread-safe (serialized).

    Needs a GPU the engine was built for (an RTX engine for sm89 runs on sm89 only);
    otherwise :class:`EngineUnavailable`. The attnx plugin library is loaded first
    (``plugins``: True = the built one, a path, or False)."""

    def __init__(self, plan: bytes, *, plugins: str | os.PathLike | bool | None = True, name: str = "engine"):
        info = backend()
        trt = info.module
        self.name = name
        cuda = _cuda()
        cc = cuda.compute_capability() if cuda is not None else None
        if cc is None:
            raise EngineUnavailable(f"cannot run {name}: no CUDA GPU (or driver) on this machine; {info.describe()} "
                                    "engines run on a GPU of the architecture they were built for")
        self._cuda = cuda
        self.plugins = None
        if plugins:
            try:
                self.plugins = load_plugins(None if plugins is True else plugins)
            except PluginLoadError:
                if plugins is not True:
                    raise
                _log.warning("attnx plugin library not loaded: engines with attnx plugin layers will fail")
        logger = get_logger()
        self._logger = logger
        mark = logger.mark()
        self._runtime = trt.Runtime(logger.native)
        self._engine = self._runtime.deserialize_cuda_engine(bytes(plan))
        if self._engine is None:
            errors = _unique(logger.messages(mark))
            raise EngineUnavailable(f"{info.describe()} could not load {name} on this GPU (sm{cc[0]}{cc[1]}): "
                                    + (" | ".join(errors) if errors else "unknown reason")
                                    + " (was it built for another GPU architecture or TensorRT version?)")
        self._context = self._engine.create_execution_context()
        if self._context is None:
            raise EngineUnavailable(f"could not create an execution context for {name}: "
                                    + " | ".join(_unique(logger.messages(mark))))
        self.io_tensors: list[IOTensor] = []
        for i in range(self._engine.num_io_tensors):
            tname = self._engine.get_tensor_name(i)
            is_input = self._engine.get_tensor_mode(tname) == trt.TensorIOMode.INPUT
            dtype = np.dtype(trt.nptype(self._engine.get_tensor_dtype(tname)))
            self.io_tensors.append(IOTensor(tname, is_input, dtype, tuple(self._engine.get_tensor_shape(tname))))
        self._buffers = {t.name: _DeviceBuffer(cuda) for t in self.io_tensors}
        stream = ctypes.c_void_p(0)
        cuda.check(cuda.lib.cudaStreamCreate(ctypes.byref(stream)), "cudaStreamCreate")
        self._stream = stream
        self._lock = threading.Lock()

    @property
    def input_names(self) -> list[str]:
        return [t.name for t in self.io_tensors if t.is_input]

    @property
    def output_names(self) -> list[str]:
        return [t.name for t in self.io_tensors if not t.is_input]

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run once: named numpy inputs (cast to the engine's dtypes) -> named numpy outputs."""
        missing = [n for n in self.input_names if n not in feeds]
        if missing:
            raise ValueError(f"missing inputs: {', '.join(missing)} (engine inputs: {', '.join(self.input_names)})")
        cuda = self._cuda
        with self._lock:
            hosts: dict[str, np.ndarray] = {}
            for t in self.io_tensors:
                if not t.is_input:
                    continue
                arr = np.ascontiguousarray(np.asarray(feeds[t.name]), dtype=t.dtype)
                if not self._context.set_input_shape(t.name, arr.shape):
                    raise ValueError(f"input {t.name!r} shape {arr.shape} is outside the engine's optimization profile "
                                     f"or does not fit its shape {t.shape}")
                ptr = self._buffers[t.name].ensure(arr.nbytes)
                hosts[t.name] = arr
                if arr.nbytes:
                    cuda.check(cuda.lib.cudaMemcpyAsync(ptr, arr.ctypes.data, arr.nbytes, cuda.H2D, self._stream),
                               "cudaMemcpyAsync (to device)")
                self._context.set_tensor_address(t.name, ptr)
            outputs: dict[str, np.ndarray] = {}
            for t in self.io_tensors:
                if t.is_input:
                    continue
                shape = tuple(self._context.get_tensor_shape(t.name))
                if any(d < 0 for d in shape):
                    raise RuntimeError(f"output {t.name!r} has an unresolved shape {shape}")
                out = np.empty(shape, dtype=t.dtype)
                ptr = self._buffers[t.name].ensure(out.nbytes)
                self._context.set_tensor_address(t.name, ptr)
                outputs[t.name] = out
            mark = self._logger.mark()
            if not self._context.execute_async_v3(self._stream.value or 0):
                raise RuntimeError(f"{self.name}: enqueue failed: " + " | ".join(_unique(self._logger.messages(mark))))
            for name, out in outputs.items():
                if out.nbytes:
                    cuda.check(cuda.lib.cudaMemcpyAsync(out.ctypes.data, self._buffers[name].ptr, out.nbytes, cuda.D2H,
                                                        self._stream), "cudaMemcpyAsync (to host)")
            cuda.check(cuda.lib.cudaStreamSynchronize(self._stream), "cudaStreamSynchronize")
            hosts.clear()  # the host inputs had to stay alive until the stream finished
            return outputs

    def close(self) -> None:
        with self._lock:
            for b in self._buffers.values():
                b.free()
            if self._stream.value:
                self._cuda.lib.cudaStreamDestroy(self._stream)
                self._stream = ctypes.c_void_p(0)

    def __del__(self):  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass


def deserialize(plan: bytes | str | os.PathLike, *, plugins: str | os.PathLike | bool | None = True) -> Engine:
    """An :class:`Engine` from plan bytes or an engine file."""
    if isinstance(plan, (bytes, bytearray, memoryview)):
        return Engine(bytes(plan), plugins=plugins)
    path = Path(plan)
    if not path.is_file():
        raise FileNotFoundError(f"no engine file at {path}")
    return Engine(path.read_bytes(), plugins=plugins, name=path.name)


def load_engine(path: str | os.PathLike, *, plugins: str | os.PathLike | bool | None = True) -> Engine:
    """Entry point for :mod:`attnx.runtime.session`: the engine file at ``path``."""
    return deserialize(Path(path), plugins=plugins)
