"""The attnx TensorRT plugin library: build it, find it, read its error messages.

The package ships the C++/CUDA sources of one shared library, ``libattnx_plugins.so``, laid out
like TensorRT OSS's ``plugin/<name>/`` folders:

- ``common/``: the IPluginV3 boilerplate shared by every op (``plugin_v3.h``), helpers, the
  logger glue, the entry points ``getCreators`` / ``setLoggerFinder`` (for
  ``IPluginRegistry::loadLibrary``) and the kernels' C ABI conventions (``attnx_kernels.h``);
- one folder per custom ONNX op, ``maw_depth_select/`` (``attnx::MawDepthSelect``),
  ``maw_depth_gather/`` (``attnx::MawDepthGather``) and ``tta_distance/``
  (``attnx::TtaDistance``), each with its CUDA kernel behind the C ABI and its plugin + creator;
- ``CMakeLists.txt`` and ``cmake/``.

Python modules: :mod:`~attnx.plugins.builder` (:func:`build`: CMake + nvcc, ``attnx plugins
build`` / ``make plugins``), :mod:`~attnx.plugins.locate` (:func:`library_path`:
``$ATTNX_PLUGIN_LIB``, then ``plugins/lib/`` of a source checkout, then the user cache
``~/.cache/attnx/plugins/lib``), :mod:`~attnx.plugins.diagnostics` (:func:`plugin_errors`) and
:mod:`~attnx.plugins.kernels` (ctypes bindings of the kernels, for tests and benchmarks).
"""

from __future__ import annotations

if not __name__.startswith("attnx."):  # one file, one module: src/attnx links this folder as attnx.plugins
    raise ImportError(f"import attnx.plugins, not {__name__}: the package is attnx (pip install -e .)")

from .builder import (
    DEFAULT_ARCHS,
    ENTRY_POINTS,
    MIN_CMAKE,
    PluginBuildError,
    build,
    build_info,
    find_cmake,
    find_nvcc,
)
from .diagnostics import clear_plugin_errors, plugin_errors
from .locate import (
    ENV_LIBRARY,
    LIBRARY_NAME,
    cache_dir,
    default_build_dir,
    default_output_dir,
    library_path,
    require_library,
    source_dir,
)

__all__ = [
    "LIBRARY_NAME",
    "ENV_LIBRARY",
    "DEFAULT_ARCHS",
    "ENTRY_POINTS",
    "MIN_CMAKE",
    "PluginBuildError",
    "library_path",
    "require_library",
    "build",
    "source_dir",
    "cache_dir",
    "default_build_dir",
    "default_output_dir",
    "find_nvcc",
    "find_cmake",
    "build_info",
    "plugin_errors",
    "clear_plugin_errors",
]
