"""The GPU architecture an engine is built for.

TensorRT-RTX builds for a chosen compute capability (``"sm89"``), even without a GPU; full
TensorRT builds for the local GPU only. :func:`default_target`: the local GPU when there is one,
else :data:`DEFAULT_TARGET`.
"""

from __future__ import annotations

from attnx.engine.cuda import gpu_compute_capability
from attnx.engine.discovery import BackendInfo, backend
from attnx.engine.errors import BuildError

#: Built for when there is no local GPU (TensorRT-RTX; Ada, e.g. L4 / RTX 40xx).
DEFAULT_TARGET = "sm89"


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


def check_target(target: str | int | None, info: BackendInfo | None = None) -> BackendInfo:
    """What :func:`apply_target` refuses, refused before any work is done for the build (compiling the plugin
    library for that target takes a minute)."""
    info = info or backend()
    if info.is_rtx:
        if parse_target(target, info) is None and gpu_compute_capability() is None:
            raise BuildError("TensorRT-RTX needs a target compute capability on a machine without a GPU: pass "
                             f"target='sm89' (available: {', '.join(info.targets)})")
        return info
    local = gpu_compute_capability()
    if local is None:
        raise BuildError("full TensorRT builds engines for the local GPU and none was found; use TensorRT for RTX "
                         "(`pip install attnx[rtx]`) to build for another GPU")
    wanted = parse_target(target, info)
    local_sm = local[0] * 10 + local[1]
    if wanted is not None and wanted != local_sm:
        raise BuildError(f"full TensorRT builds for the local GPU (sm{local_sm}), not sm{wanted}; build on a "
                         "machine with that GPU, or use TensorRT for RTX (`pip install attnx[rtx]`)")
    return info


def apply_target(config, target: str | int | None, info: BackendInfo | None = None) -> str:
    """Point a builder config at the GPU architecture to build for; returns it as "sm89".

    TensorRT-RTX: the given compute capability (None = the local GPU, which must exist).
    Full TensorRT: always the local GPU; ``target`` may only name that one."""
    info = check_target(target, info)
    local = gpu_compute_capability()
    if not info.is_rtx:
        return f"sm{local[0] * 10 + local[1]}"
    cc = parse_target(target, info)
    if cc is None:
        cc = info.module.ComputeCapability.CURRENT
        name = f"sm{local[0]}{local[1]}"
    else:
        name = str(cc).split(".")[-1].lower()
    config.num_compute_capabilities = 1
    config.set_compute_capability(cc, 0)
    return name


def default_target() -> str | None:
    """The local GPU (None: let the backend use it) when there is one, else ``sm89``."""
    return None if gpu_compute_capability() is not None else DEFAULT_TARGET


def target_name(target: str | None) -> str:
    """``target`` (validated) as "sm89"; None -> the local GPU's, or "local"."""
    if target is None:
        cc = gpu_compute_capability()
        return f"sm{cc[0]}{cc[1]}" if cc else "local"
    cc = parse_target(target)  # validates (BuildError names the supported targets)
    return str(cc).split(".")[-1].lower() if not isinstance(cc, int) else f"sm{cc}"
