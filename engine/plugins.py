"""The attnx plugin library inside TensorRT.

- :func:`load_plugins`: load it through TensorRT's plugin registry (``IPluginRegistry.load_library``,
  which calls the library's ``getCreators`` / ``setLoggerFinder``; not ``dlopen``), once per path.
- :func:`plugin_errors` / :func:`clear_plugin_errors`: the plugins' own error messages, kept by the
  library (TensorRT-RTX hands them no logger), so parse and build errors can quote them.
- :func:`resolve_plugin_library`: what ``--plugins`` means: the given file, else the built one,
  built when missing and the model needs it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from attnx.contract import PLUGIN_NAMESPACE, PLUGIN_VERSION
from attnx.engine.discovery import backend, lock
from attnx.engine.errors import EngineBuildError, PluginLoadError, unique
from attnx.engine.logger import get_logger


@dataclass(frozen=True)
class PluginLibrary:
    path: Path
    creators: tuple[tuple[str, str, str], ...]  # (name, version, namespace) of the attnx creators
    handle: Any = field(repr=False, compare=False, default=None)

    def missing(self, ops: Iterable[str]) -> list[str]:
        """``attnx::<Op> v1`` for each of ``ops`` that has no creator here."""
        return [f"{PLUGIN_NAMESPACE}::{op} v{PLUGIN_VERSION}" for op in sorted(set(ops))
                if (op, PLUGIN_VERSION, PLUGIN_NAMESPACE) not in self.creators]


_loaded_plugins: dict[str, PluginLibrary] = {}


def load_plugins(path: str | os.PathLike | None = None) -> PluginLibrary:
    """Load the attnx plugin library through TensorRT's plugin registry (once per path).

    ``path`` defaults to :func:`attnx.plugins.require_library`. Raises :class:`PluginLoadError`
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
    with lock:
        if key in _loaded_plugins:
            return _loaded_plugins[key]
        registry = info.module.get_plugin_registry()
        mark = logger.mark()
        try:
            handle = registry.load_library(key)
        except Exception as e:  # some versions raise instead of returning None
            handle = None
            failure = f"{type(e).__name__}: {e}"
        else:
            failure = ""
        if handle is None:
            detail = "; ".join(unique([failure, *logger.messages(mark, ("internal_error", "error", "warning"))]))
            raise PluginLoadError(f"{info.describe()} refused the plugin library {key}"
                                  + (f": {detail}" if detail else "")
                                  + " (it must export getCreators and setLoggerFinder; rebuild with `attnx plugins build`)")
        creators = tuple(sorted({(c.name, c.plugin_version, c.plugin_namespace) for c in registry.all_creators
                                 if c.plugin_namespace == PLUGIN_NAMESPACE}))
        if not creators:
            raise PluginLoadError(f"{key} loaded but provides no {PLUGIN_NAMESPACE} plugins")
        loaded = PluginLibrary(path=Path(key), creators=creators, handle=handle)
        _loaded_plugins[key] = loaded
        return loaded


def plugin_errors(library: PluginLibrary | None) -> list[str]:
    """The errors the plugins of ``library`` recorded since the last :func:`clear_plugin_errors`."""
    if library is None:
        return []
    from attnx.plugins import plugin_errors as read  # noqa: PLC0415

    return read(library.path)


def clear_plugin_errors(library: PluginLibrary | None) -> None:
    if library is not None:
        from attnx.plugins import clear_plugin_errors as clear  # noqa: PLC0415

        clear(library.path)


def resolve_plugin_library(plugins: str | os.PathLike | None, *, needed: bool,
                           console=None, build_missing: bool = True, target: str | None = None) -> Path | None:
    """The plugin library to load: ``plugins`` when given (must exist), else the built one.

    When none is built: builds it (``attnx.plugins.build()``) if the model needs it (``needed``: it has
    attnx custom ops) and ``build_missing``, for ``target`` only ("sm89"; every default architecture
    when None), which takes a fraction of the full build; returns None for a model without custom
    ops. A library built here earlier without ``target``'s architecture is rebuilt with it added."""
    from attnx import plugins as plugin_pkg  # noqa: PLC0415

    if plugins is not None:
        lib = Path(plugins).expanduser()
        if not lib.is_file():
            raise EngineBuildError(f"plugin library {lib} does not exist (build it with `attnx plugins build`, "
                                   "or leave --plugins out to use the built one)")
        return lib.resolve()
    arch = target.removeprefix("sm") if target and target.startswith("sm") else None
    lib = plugin_pkg.library_path()
    if not needed:
        return lib
    archs = None
    if lib is not None:
        built_for = (plugin_pkg.build_info(lib) or {}).get("cuda_archs")
        if arch is None or built_for is None or arch in built_for or not build_missing:
            return lib  # a library built elsewhere (no build record) is the user's to keep
        archs = [*built_for, arch]
    elif not build_missing:
        raise EngineBuildError("the attnx plugin library is not built: run `attnx plugins build`")
    elif arch is not None:
        archs = [arch]
    if console is not None:
        what = f"sm{', sm'.join(archs)}" if archs else "every default GPU architecture"
        console.print(f"compiling the attnx plugin library for {what} with nvcc (a minute or more; "
                      "`attnx plugins build` makes it once for every architecture)", highlight=False)
    try:
        return plugin_pkg.build(archs=archs, console=console)
    except plugin_pkg.PluginBuildError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else "unknown reason"
        raise EngineBuildError(f"the model needs the attnx plugin library, which is not built and could not be "
                               f"built here: {first}") from None
