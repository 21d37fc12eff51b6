"""Where the plugin library and its sources are: ``$ATTNX_PLUGIN_LIB``, then ``plugins/lib/`` of
a source checkout (editable install), then the user cache (``~/.cache/attnx/plugins/lib``, used
when the package directory is not a writable checkout)."""

from __future__ import annotations

import importlib
import json
import os
from importlib import metadata
from pathlib import Path

LIBRARY_NAME = "libattnx_plugins.so"
ENV_LIBRARY = "ATTNX_PLUGIN_LIB"

_SOURCE_DIR = Path(__file__).resolve().parent


def source_dir() -> Path:
    """Folder holding CMakeLists.txt and the C++/CUDA sources."""
    return _SOURCE_DIR


def _is_checkout() -> bool:
    # An editable install (PEP 610's direct_url.json says so) builds into its own plugins/ when it may write there.
    try:
        direct_url = json.loads(metadata.distribution("attnx").read_text("direct_url.json") or "{}")
    except metadata.PackageNotFoundError:
        return False
    return bool(direct_url.get("dir_info", {}).get("editable")) and os.access(_SOURCE_DIR, os.W_OK)


def cache_dir() -> Path:
    """Per-user cache for builds of an installed (non-editable) package: ``$ATTNX_CACHE_DIR`` or
    ``$XDG_CACHE_HOME/attnx`` or ``~/.cache/attnx``, plus ``/plugins``."""
    root = os.environ.get("ATTNX_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "attnx")
    return Path(root) / "plugins"


def default_build_dir() -> Path:
    return _SOURCE_DIR / "build" if _is_checkout() else cache_dir() / "build"


def default_output_dir() -> Path:
    return _SOURCE_DIR / "lib" if _is_checkout() else cache_dir() / "lib"


def _candidates() -> list[Path]:
    paths = []
    env = os.environ.get(ENV_LIBRARY)
    if env:
        paths.append(Path(env).expanduser())
    paths.append(_SOURCE_DIR / "lib" / LIBRARY_NAME)
    paths.append(cache_dir() / "lib" / LIBRARY_NAME)
    return paths


def library_path() -> Path | None:
    """The built plugin library, or None: ``$ATTNX_PLUGIN_LIB`` (when it exists), then
    ``plugins/lib/`` of a checkout, then the user cache."""
    for path in _candidates():
        if path.is_file():
            return path.resolve()
    return None


def require_library() -> Path:
    """:func:`library_path`, or a clear error saying how to build it."""
    path = hooked_library_path()
    if path is None:
        looked = ", ".join(str(p) for p in _candidates())
        raise FileNotFoundError(
            f"the attnx plugin library is not built (looked in {looked}); run `attnx plugins build` "
            f"(or set ${ENV_LIBRARY} to a built {LIBRARY_NAME})")
    return path


def hooked_library_path() -> Path | None:
    """:func:`library_path` as the package (``attnx.plugins``) currently names it, so that replacing
    ``attnx.plugins.library_path`` (tests, embedding applications) reaches every caller here."""
    return importlib.import_module(__package__).library_path()
