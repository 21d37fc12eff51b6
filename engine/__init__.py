"""TensorRT: build engines and run them (``attnx build-engine``; serving's engine sessions).

One thin layer over ``tensorrt`` or TensorRT for RTX, in small modules, one concern each:

- :mod:`~attnx.engine.discovery`: which TensorRT (:func:`backend`, :class:`BackendInfo`), install hints,
  the RTX library-name trap, Polygraphy's ``tensorrt_rtx`` alias;
- :mod:`~attnx.engine.cuda`: the CUDA runtime through ctypes (:func:`gpu_compute_capability`);
- :mod:`~attnx.engine.logger`: the process-wide TensorRT logger;
- :mod:`~attnx.engine.plugins`: the attnx plugin library through TensorRT's registry;
- :mod:`~attnx.engine.network`: ONNX -> network (plugin override), layer counts, ``prepare_attention``;
- :mod:`~attnx.engine.profiles`, :mod:`~attnx.engine.targets`, :mod:`~attnx.engine.fp16`: what a
  build is for (shapes, GPU architecture, the fp16 file);
- :mod:`~attnx.engine.build`: :func:`build_engine` (ONNX -> plan) and :func:`build` (plan + sidecar);
- :mod:`~attnx.engine.runner`: :class:`Engine` (deserialize, run);
- :mod:`~attnx.engine.errors`: the exceptions and :func:`explain`.

Typical use::

    from attnx import engine
    engine.backend()                                   # BackendInfo(name, version, is_rtx)
    net = engine.parse_onnx("maw.onnx")                # loads the plugins, plugin override on
    net.layer_type_counts()                            # {"PLUGIN_V3": 2, ...}
    built = engine.build("maw.onnx", fp16=True)        # maw-fp16.engine + maw-fp16.engine.json
    eng = engine.load_engine(built.engine_path)        # needs the GPU it was built for
    outputs = eng.run({"hidden_states": x, "attention_mask": m})

Importing this package imports no TensorRT: :func:`backend` does, on first use.
"""

if not __name__.startswith("attnx."):  # one file, one module: src/attnx links this folder as attnx.engine
    raise ImportError(f"import attnx.engine, not {__name__}: the package is attnx (pip install -e .)")

from attnx.engine.build import EngineBuild, NetworkHook, build, build_engine, default_engine_path, parse_size
from attnx.engine.cuda import gpu_compute_capability
from attnx.engine.discovery import (
    BACKEND_ENV,
    INSTALL_HINT,
    BackendInfo,
    backend,
    is_available,
    register_polygraphy_alias,
    reset_backend,
    select_backend,
)
from attnx.engine.errors import (
    BuildError,
    EngineBuildError,
    EngineUnavailable,
    ParseError,
    PluginLoadError,
    TensorRTError,
    TensorRTUnavailable,
    explain,
)
from attnx.engine.fp16 import ensure_fp16, fp16_path
from attnx.engine.logger import Logger, get_logger
from attnx.engine.network import (
    ParsedNetwork,
    TensorInfo,
    custom_nodes,
    layer_type_counts,
    network_inputs,
    network_outputs,
    parse_onnx,
    prepare_attention,
)
from attnx.engine.plugins import PluginLibrary, load_plugins, resolve_plugin_library
from attnx.engine.profiles import parse_shapes, resolve_profiles
from attnx.engine.runner import Engine, IOTensor, deserialize, load_engine, runnable_here
from attnx.engine.targets import DEFAULT_TARGET, apply_target, default_target, parse_target, target_name

__all__ = [
    "BACKEND_ENV", "INSTALL_HINT", "BackendInfo", "select_backend", "backend", "is_available", "reset_backend",
    "register_polygraphy_alias", "gpu_compute_capability",
    "TensorRTError", "TensorRTUnavailable", "PluginLoadError", "ParseError", "BuildError", "EngineUnavailable",
    "EngineBuildError", "explain",
    "Logger", "get_logger", "PluginLibrary", "load_plugins", "resolve_plugin_library",
    "ParsedNetwork", "TensorInfo", "parse_onnx", "layer_type_counts", "network_inputs", "network_outputs",
    "custom_nodes", "prepare_attention",
    "parse_shapes", "resolve_profiles", "DEFAULT_TARGET", "parse_target", "apply_target", "default_target", "target_name",
    "ensure_fp16", "fp16_path", "NetworkHook", "build_engine", "build", "EngineBuild", "parse_size",
    "default_engine_path", "Engine", "IOTensor", "deserialize", "load_engine", "runnable_here",
]
