"""The plugins' own error messages, read from the loaded library (``attnx_plugins_errors``): for
callers whose TensorRT logger does not show them, and to put them into exception messages."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

from .locate import hooked_library_path


def _handle(path: str | os.PathLike | None) -> ctypes.CDLL | None:
    lib = Path(path) if path else hooked_library_path()
    if lib is None or not Path(lib).is_file():
        return None
    try:
        handle = ctypes.CDLL(str(lib))  # the same loaded object as TensorRT's registry holds
    except OSError:
        return None
    if not hasattr(handle, "attnx_plugins_errors"):
        return None
    handle.attnx_plugins_errors.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    handle.attnx_plugins_errors.restype = ctypes.c_size_t
    handle.attnx_plugins_clear_errors.argtypes = []
    handle.attnx_plugins_clear_errors.restype = None
    return handle


def plugin_errors(path: str | os.PathLike | None = None) -> list[str]:
    """The plugins' recent error messages (oldest first, duplicates removed).

    The plugins log through TensorRT's logger as well; this is for callers whose logger does
    not show them (and to put them into exception messages)."""
    handle = _handle(path)
    if handle is None:
        return []
    size = handle.attnx_plugins_errors(None, 0)
    if size == 0:
        return []
    buf = ctypes.create_string_buffer(size + 1)
    handle.attnx_plugins_errors(buf, size + 1)
    lines = buf.value.decode("utf-8", "replace").splitlines()
    return list(dict.fromkeys(line for line in lines if line.strip()))


def clear_plugin_errors(path: str | os.PathLike | None = None) -> None:
    handle = _handle(path)
    if handle is not None:
        handle.attnx_plugins_clear_errors()
