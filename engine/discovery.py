"""Which TensorRT: ``tensorrt`` (preferred) or TensorRT for RTX, selected once per process.

- full TensorRT: the ``tensorrt`` package (``pip install attnx[tensorrt]``; the libraries come
  from NVIDIA's package index). Builds engines for the local GPU.
- TensorRT for RTX: the ``tensorrt-rtx-cu13-libs`` / ``-bindings`` wheels (``pip install
  attnx[rtx]``), imported as ``tensorrt_rtx_libs`` then ``tensorrt_rtx_bindings``. Builds engines
  for a chosen compute capability without a GPU (SM75, SM80, SM86, SM89, SM120, SM121; no SM90),
  runs them on a GPU of that SM.

``$ATTNX_TENSORRT_BACKEND`` = ``auto`` (default) | ``tensorrt`` | ``rtx`` forces a choice. The
rest of attnx uses :func:`backend` and never cares which one it got.

Traps handled here (see shared/spec/environment.md):

- TensorRT-RTX's ONNX parser ``dlopen``s ``libtensorrt_rtx.so``, which the wheel lacks (it ships
  ``.so.1``), and aborts the process: :func:`backend` creates the symlink next to the wheel's
  library (the parser's RPATH is ``$ORIGIN``) or records how to fix it (:func:`rtx_link_problem`).
- Polygraphy imports a module named ``tensorrt_rtx``: :func:`register_polygraphy_alias`.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from attnx.engine.errors import TensorRTUnavailable

_log = logging.getLogger("attnx.tensorrt")
_log.addHandler(logging.NullHandler())  # a library: the application decides what TensorRT's chatter shows

BACKEND_ENV = "ATTNX_TENSORRT_BACKEND"
INSTALL_HINT = ("install TensorRT: `pip install attnx[tensorrt]` (full TensorRT, for the local GPU; the libraries "
                "come from NVIDIA's package index) or `pip install attnx[rtx]` (TensorRT for RTX: builds engines "
                "for a chosen GPU architecture, even without a GPU)")

#: Guards the process-wide state of :mod:`attnx.engine` (the backend, the logger, loaded plugin libraries).
lock = threading.RLock()


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


_backend: BackendInfo | None = None
_rtx_link_problem: str | None = None


def backend() -> BackendInfo:
    """The process-wide backend (selected once; ``$ATTNX_TENSORRT_BACKEND`` overrides)."""
    global _backend, _rtx_link_problem
    with lock:
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
    """Forget the selection (tests); the next :func:`backend` selects again (and gets a new logger).
    Loaded plugin libraries stay loaded, and so does their record: the process-wide registry
    refuses a second load of the same library."""
    global _backend
    with lock:
        _backend = None


def rtx_link_problem() -> str | None:
    """Why TensorRT-RTX's ONNX parser cannot be used here (the missing unversioned library), or None."""
    return _rtx_link_problem


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
