"""ONNX -> TensorRT network: :func:`parse_onnx` (attnx plugins loaded, plugin override on) and what
can be read off a network (inputs, outputs, layer counts by type, plugin layers), plus
:func:`prepare_attention`, the adjustment TensorRT-RTX 1.7 needs to build ONNX ``Attention`` layers.

A custom op without a plugin in the loaded library is a :class:`ParseError` naming it. The
parser's plugin-override flag makes custom nodes that also carry a local function become
plugin layers instead of the inlined function body. (TensorRT-RTX 1.7 picks a registered plugin
even without the flag; it is set anyway, as TensorRT documents it.)
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from attnx.contract import DOMAIN, load_onnx
from attnx.engine.discovery import backend, rtx_link_problem
from attnx.engine.errors import ParseError, PluginLoadError, unique
from attnx.engine.forms import engine_form
from attnx.engine.logger import get_logger
from attnx.engine.plugins import PluginLibrary, clear_plugin_errors, load_plugins, plugin_errors

_log = logging.getLogger("attnx.tensorrt")


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


def _tensors(network, count: int, get) -> list[TensorInfo]:
    trt = backend().module
    return [TensorInfo(t.name, tuple(t.shape), _dtype_name(trt, t.dtype)) for t in (get(i) for i in range(count))]


def network_inputs(network) -> list[TensorInfo]:
    return _tensors(network, network.num_inputs, network.get_input)


def network_outputs(network) -> list[TensorInfo]:
    return _tensors(network, network.num_outputs, network.get_output)


def layers(network):
    for i in range(network.num_layers):
        yield network.get_layer(i)


def _kind(layer) -> str:
    return str(layer.type).split(".")[-1]


def layer_type_counts(network) -> dict[str, int]:
    """Layers of a network by type name (``{"PLUGIN_V3": 2, "MATRIX_MULTIPLY": 8, ...}``)."""
    counts: dict[str, int] = {}
    for layer in layers(network):
        counts[_kind(layer)] = counts.get(_kind(layer), 0) + 1
    return dict(sorted(counts.items()))


def custom_nodes(proto) -> dict[str, int]:
    """attnx custom-op nodes TensorRT parses, by op type: the model's main graph with each op that has a
    TensorRT form replaced by it (:func:`attnx.engine.forms.engine_form`; smal's attention: its distance)."""
    counts: dict[str, int] = {}
    for node in (engine_form(proto) or proto).graph.node:
        if node.domain == DOMAIN:
            counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return dict(sorted(counts.items()))


@dataclass
class ParsedNetwork:
    """A parsed network and the objects that must outlive it."""

    path: Path
    builder: Any
    network: Any
    parser: Any
    plugins: PluginLibrary | None
    #: What :func:`prepare_attention` did to the network (set by ``build_engine``), else None.
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
        return [(layer.name, _kind(layer)) for layer in layers(self.network) if _kind(layer).startswith("PLUGIN")]


def _load_for(used_ops: list[str], plugins) -> PluginLibrary | None:
    """The plugin library a model with ``used_ops`` needs (``plugins`` as in :func:`parse_onnx`)."""
    if not plugins:
        return None
    try:
        return load_plugins(None if plugins is True else plugins)
    except PluginLoadError:
        if used_ops:
            raise
        return None  # a model without attnx nodes does not need them


def _require_ops(library: PluginLibrary, ops: list[str], model: str) -> None:
    """Every custom op of the model needs a creator (``attnx::<Op>`` v1) in the loaded library;
    otherwise TensorRT would inline the op's function body, or fail on an op without one."""
    missing = library.missing(ops)
    if missing:
        raise ParseError(f"the plugin library {library.path} has no plugin for {', '.join(missing)}, which "
                         f"{model} uses (an older build? rebuild it with `attnx plugins build`)")


def parse_onnx(path: str | os.PathLike, *, plugin_override: bool = True,
               plugins: str | os.PathLike | bool | None = True, strongly_typed: bool = True) -> ParsedNetwork:
    """Parse an ONNX file into a (strongly typed) network.

    ``plugins``: True loads the built attnx plugin library (required when the model has
    ``attnx`` nodes), a path loads that library, False/None loads none (custom nodes are then
    inlined). Raises :class:`ParseError` with the parser's errors and the plugins' messages."""
    info = backend()
    trt = info.module
    logger = get_logger()
    onnx_path = Path(path)
    if not onnx_path.is_file():
        raise FileNotFoundError(f"no ONNX file at {onnx_path}")
    in_file = load_onnx(onnx_path)
    model = engine_form(in_file)  # None: TensorRT parses the file as it is
    used_ops = list(custom_nodes(in_file if model is None else model))
    library = _load_for(used_ops, plugins)
    if used_ops and info.is_rtx and rtx_link_problem():
        raise ParseError(rtx_link_problem())
    if library is not None:
        _require_ops(library, used_ops, onnx_path.name)
    elif used_ops:
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
    clear_plugin_errors(library)
    parsed = parser.parse_from_file(str(onnx_path)) if model is None else \
        parser.parse(model.SerializeToString(), str(onnx_path))  # the path: for external weights
    if not parsed:
        errors = []
        for i in range(parser.num_errors):
            e = parser.get_error(i)
            try:
                where = e.node_name() or f"node {e.node()}"
                errors.append(f"{where} ({e.node_operator()}): {e.desc()}")
            except Exception:
                errors.append(str(e))
        detail = unique([*plugin_errors(library), *logger.plugin_messages(mark), *errors])
        raise ParseError(f"TensorRT ({info.describe()}) could not parse {onnx_path}: " + " | ".join(detail),
                         errors=detail)
    return ParsedNetwork(path=onnx_path, builder=builder, network=network, parser=parser, plugins=library)


def prepare_attention(network) -> dict:
    """Make the ONNX ``Attention`` layers buildable by TensorRT-RTX 1.7 (measured here;
    ``build_engine`` calls it on every network it builds):

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
    for layer in layers(network):
        for j in range(layer.num_outputs):
            producers[layer.get_output(j).name] = layer
    for layer in layers(network):
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
