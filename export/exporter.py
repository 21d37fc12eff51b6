"""Export an attnx model to ONNX with the attnx custom ops.

Steps (each reported to ``progress``): trace (``torch.export`` with dynamic ``batch``/``seq``),
translate (the dynamo ONNX exporter at opset 23; each variant's torch custom ops become nodes of
its ONNX custom ops), optimise (function bodies attached, constant folding, dead-node removal, the
contract's dim names, fp16), check (full ``onnx.checker``, strict shape inference), save (external
data past 2 GB, the weights beside the file as safetensors for ``attnx check``).

Lowerings: ``plugin`` traces the ``plugin`` attention path, so custom ops appear as nodes with
function bodies (TensorRT maps them to plugins); ``rewrite`` traces the ``fast`` path and inlines
any remaining custom node's body, so the file has standard ops only.

Any model with the signature of :mod:`attnx.models.signature` exports: attnx's encoders, and the
pretrained hosts that place a variant in a real model.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
import torch

import attnx
from attnx.contract import DEFAULT_PROFILES, IR_VERSION, MIN_OPSET, ONNX_OPSET, ModelInfo, TensorEntry, check_profiles
from attnx.export import fuse as fusions
from attnx.export import ops
from attnx.export.attention_outputs import WithAttentionOutputs, parse_layers
from attnx.models.checkpoint import load_checkpoint, save_checkpoint
from attnx.export.fp16 import FP32_OPS, FP32_OPS_WITH_CACHE, to_fp16
from attnx.models.attention import attention_path
from attnx.models.build import build_encoder
from attnx.models.signature import example_tensor
from attnx.models.spec import get_spec

LOWERINGS = ("plugin", "rewrite")
STEPS = ("trace", "translate", "optimise", "check", "save")
#: The small default configuration `attnx export --variant X` uses.
DEFAULT_OPTIONS = {"d_model": 256, "n_heads": 4, "n_layers": 2}
_EXTERNAL_DATA_BYTES = 1_800_000_000  # protobuf's limit is 2 GiB; leave headroom for the graph


@dataclass
class ExportResult:
    path: Path
    model: torch.nn.Module  # the reference the file was exported from (eval mode)
    info: ModelInfo
    weights_path: Path | None = None
    steps: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # one line each for the user (e.g. a source folder's auto_map ignored)

    @property
    def config(self) -> dict:
        return self.info.config


# --------------------------------------------------------------------------- inputs and the traced wrapper

def example_inputs(model, batch: int = 2, seq: int = 8, seed: int = 0) -> dict[str, torch.Tensor]:
    """Unit-scale example inputs for every input spec (the last example right-padded)."""
    g = torch.Generator().manual_seed(seed)
    dims = {"batch": batch, "seq": seq}
    feeds = {s.name: example_tensor(s, dims, g) for s in model.input_specs()}
    for spec in model.input_specs():
        if spec.role == "attention_mask":
            feeds[spec.name][-1, max(1, seq - seq // 3):] = 0
        elif spec.role == "head_mask":
            feeds[spec.name] = torch.ones_like(feeds[spec.name])
    return feeds


class _Positional(torch.nn.Module):
    """``forward(*inputs)`` in the file's input order -> outputs in the file's output order."""

    def __init__(self, model, input_names: list[str], output_names: list[str]):
        super().__init__()
        self.model = model
        self.input_names, self.output_names = input_names, output_names

    def forward(self, *args):
        out = self.model.forward_named(dict(zip(self.input_names, args)))
        return tuple(out[n] for n in self.output_names)


def _translations(model) -> dict:
    """torch custom op -> the onnxscript function emitting its attnx node."""
    used = {b.variant for b in getattr(model, "blocks", [])} | {model.variant}
    table = {}
    for name in sorted(used):
        for op in get_spec(name).custom_ops:
            if op.torch_op is not None and op.plugin is not None:
                table[op.torch_op] = op.plugin()
    return table


@contextlib.contextmanager
def _quiet_torch_exporter():
    """torch's exporter logs a warning per torchvision op it cannot register (irrelevant here) and
    other notes on stderr; keep them out of a user's terminal while exporting."""
    loggers = [logging.getLogger(n) for n in ("torch.onnx._internal.exporter._registration",
                                                "torch.onnx._internal.exporter._core", "onnxscript")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


# --------------------------------------------------------------------------- graph post-processing

def _trace(wrapper, args, dynamic_shapes, inputs, profiles: dict):
    """``torch.export`` with dynamic batch and seq. A model whose code only holds from some length on
    (MobileBERT's trigram embedding wants seq >= 2) fails the declared ranges: export again letting
    torch find the ranges, and raise the profiles' minimum to what it found (said in the metadata)."""
    # A model may ask for more (a decoder's cache: relations between dims no Dim states become runtime asserts).
    options = dict(getattr(wrapper.model, "trace_options", {}))
    try:
        return torch.export.export(wrapper, args, dynamic_shapes=(dynamic_shapes,), strict=False, **options), profiles
    except torch._dynamo.exc.UserError as e:
        if "Constraints violated" not in str(e):
            raise
    auto = tuple({i: torch.export.Dim.DYNAMIC for i in spec} for spec in dynamic_shapes)
    program = torch.export.export(wrapper, args, dynamic_shapes=(auto,), strict=False, **options)
    lows: dict[str, int] = {}
    placeholders = [n for n in program.graph.nodes if n.op == "placeholder"][-len(inputs):]
    for spec, node in zip(inputs, placeholders):
        for axis, dim in enumerate(spec.shape):
            if isinstance(dim, str):
                size = node.meta["val"].shape[axis]
                vr = program.range_constraints.get(getattr(size, "node", size).expr) if hasattr(size, "node") else None
                if vr is not None:
                    lows[dim] = max(lows.get(dim, 1), int(vr.lower))
    profiles = dict(profiles)
    for axis, low in lows.items():
        if axis in profiles and low > profiles[axis][0]:
            lo, opt, hi = profiles[axis]
            profiles[axis] = (low, max(opt, low), max(hi, low))
    return program, profiles


def _name_dynamic_dims(model: onnx.ModelProto, specs: dict[str, tuple]) -> None:
    """Give graph inputs/outputs the dim names of the contract (``batch``, ``seq``)."""
    for vi in list(model.graph.input) + list(model.graph.output):
        shape = specs.get(vi.name)
        if shape is None:
            continue
        for d, want in zip(vi.type.tensor_type.shape.dim, shape):
            if isinstance(want, str):
                d.ClearField("dim_value")
                d.dim_param = want
            else:
                d.ClearField("dim_param")
                d.dim_value = want


def _optimise(model: onnx.ModelProto, fuse: bool = True) -> onnx.ModelProto:
    """Fold constants and drop dead nodes (graphsurgeon), then the exact fusions of
    :mod:`attnx.export.fuse`, keeping the custom-op functions."""
    import onnx_graphsurgeon as gs

    functions = list(model.functions)
    graph = gs.import_onnx(model)
    _batch_rotary_caches(graph)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph.fold_constants(error_ok=True).cleanup(remove_unused_graph_inputs=False).toposort()
        if fuse:
            graph = gs.import_onnx(_with_shapes(gs.export_onnx(graph), functions))  # patterns read shapes
            fusions.fuse(graph)
    out = gs.export_onnx(graph)
    out.ir_version = model.ir_version
    del out.functions[:]
    out.functions.extend(functions)
    out.metadata_props.extend(model.metadata_props)
    return out


def _batch_rotary_caches(graph) -> int:
    """ONNX ``RotaryEmbedding`` without ``position_ids`` wants cos/sin caches ``[B, L, D/2]``; the exporter's
    fusion of an encoder's RoPE (positions ``[1, L]``, e.g. ModernBERT) feeds ``[1, L, D/2]``, which ONNX
    Runtime refuses for B > 1. Expand them to the batch of the input (exact: the rows are the same)."""
    import onnx_graphsurgeon as gs

    fixed = 0
    for node in list(graph.nodes):
        if node.op != "RotaryEmbedding" or node.domain not in (None, "", "ai.onnx") or len(node.inputs) > 3:
            continue
        x = node.inputs[0]
        batch = gs.Variable(f"{node.name}__batch", dtype=np.int64)
        graph.nodes.append(gs.Node("Shape", inputs=[x], outputs=[batch], attrs={"start": 0, "end": 1}))
        for slot in (1, 2):
            cache = node.inputs[slot]
            rest = gs.Variable(f"{node.name}__rest{slot}", dtype=np.int64)
            shape = gs.Variable(f"{node.name}__shape{slot}", dtype=np.int64)
            expanded = gs.Variable(f"{node.name}__cache{slot}", dtype=cache.dtype)
            graph.nodes += [gs.Node("Shape", inputs=[cache], outputs=[rest], attrs={"start": 1}),
                            gs.Node("Concat", inputs=[batch, rest], outputs=[shape], attrs={"axis": 0}),
                            gs.Node("Expand", inputs=[cache, shape], outputs=[expanded])]
            node.inputs[slot] = expanded
        fixed += 1
    if fixed:
        graph.toposort()
    return fixed


def _with_shapes(model: onnx.ModelProto, functions) -> onnx.ModelProto:
    """Shape-inferred copy, the custom ops' functions attached so their outputs get shapes (the model
    itself when it is too large to infer in memory: shape patterns then do not match)."""
    if _initializer_bytes(model) > _EXTERNAL_DATA_BYTES:
        return model
    del model.functions[:]
    model.functions.extend(functions)
    return onnx.shape_inference.infer_shapes(model, data_prop=True)


def _check(model: onnx.ModelProto, path_for_large: Path | None = None) -> None:
    """Full checker and strict shape inference; every graph output must get a shape."""
    if path_for_large is not None:
        onnx.checker.check_model(str(path_for_large), full_check=True)
        return
    onnx.checker.check_model(model, full_check=True)
    inferred = onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True, data_prop=True)
    for out in inferred.graph.output:
        if not out.type.tensor_type.HasField("shape"):
            raise RuntimeError(f"shape inference gave output {out.name!r} no shape")


def _initializer_bytes(model: onnx.ModelProto) -> int:
    return sum(int(np.prod(t.dims)) * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
               for t in model.graph.initializer)


def save_model(model: onnx.ModelProto, path: Path) -> bool:
    """Save (atomically); models past ~2 GB keep their weights in ``<name>.data`` beside the file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    external = _initializer_bytes(model) > _EXTERNAL_DATA_BYTES
    tmp = path.with_name(path.name + ".tmp")
    try:
        if external:
            onnx.save_model(model, str(tmp), save_as_external_data=True, all_tensors_to_one_file=True,
                            location=path.name + ".data", size_threshold=1024)
        else:
            onnx.save_model(model, str(tmp))
        os.replace(tmp, path)
    except BaseException:  # a failed save (disk full, interrupted) leaves no half-written .tmp behind
        tmp.unlink(missing_ok=True)
        raise
    return external


def _entries(values, specs: dict) -> list[TensorEntry]:
    """Metadata entries of graph inputs/outputs: dtype and dims from the file, role/range/doc from the specs."""
    out = []
    for vi in values:
        t = vi.type.tensor_type
        spec = specs[vi.name]
        out.append(TensorEntry(name=vi.name, role=spec.role, dtype=onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).name,
                               shape=tuple(d.dim_param if d.dim_param else d.dim_value for d in t.shape.dim),
                               range=getattr(spec, "range", None), doc=spec.doc,
                               default=getattr(spec, "default", None)))
    return out


# --------------------------------------------------------------------------- public entry points

def default_path(variant: str, lowering: str = "plugin", fp16: bool = False, folder: str | Path = "attnx-out") -> Path:
    suffix = ("" if lowering == "plugin" else f"-{lowering}") + ("-fp16" if fp16 else "")
    return Path(folder) / f"{variant}{suffix}.onnx"


def export_encoder(model, path: str | Path, *, lowering: str = "plugin", fp16: bool = False,
                   opset: int = ONNX_OPSET, profiles: dict | None = None, save_weights: bool = True,
                   progress: Callable[[str], None] | None = None, tokenizer: dict | None = None,
                   attention_outputs=None, head_mask: bool = False, fuse: bool = True) -> ExportResult:
    """Export any attnx model (eval mode; see :mod:`attnx.models.signature`) to ``path``.

    ``fuse``: the exact standard-ONNX fusions of :mod:`attnx.export.fuse` (packed Q/K/V, 3-D
    attention); off only to compare against the unfused graph.

    ``tokenizer``: the text metadata of a model whose tokenizer files travel beside it.
    ``attention_outputs`` (``"all"`` or layer indices) adds outputs ``attentions.{i}``, ``head_mask``
    an input ``head_mask [n_layers, heads]`` (:mod:`attnx.export.attention_outputs`)."""
    if lowering not in LOWERINGS:
        raise ValueError(f"unknown lowering {lowering!r}; valid: {', '.join(LOWERINGS)}")
    max_opset = onnx.defs.onnx_opset_version()
    if not MIN_OPSET <= opset <= max_opset:
        raise ValueError(f"opset must be in [{MIN_OPSET}, {max_opset}], got {opset}")
    profiles = check_profiles(profiles or DEFAULT_PROFILES)
    path = Path(path)
    if path.suffix.lower() != ".onnx":
        raise ValueError(f"the output must be a .onnx file, got {path.name}")
    step = progress or (lambda name: None)
    model = model.eval()
    reference_model = model
    if attention_outputs is not None or head_mask:
        layers = [] if attention_outputs is None else parse_layers(attention_outputs, len(model.blocks))
        model = WithAttentionOutputs(model, layers, head_mask)
    ops.register_schemas()
    inputs, outputs = model.input_specs(), model.output_specs()
    input_names, output_names = [s.name for s in inputs], [s.name for s in outputs]

    step("trace")
    # A model with more dynamic dims than batch/seq (a decoder's KV cache) gives its own examples and dims.
    feeds = model.example_inputs() if hasattr(model, "example_inputs") else example_inputs(model)
    seq_max = int(getattr(model, "max_seq", 65536))  # a model with position embeddings has a limit
    dims = {"batch": torch.export.Dim("batch", min=1, max=4096), "seq": torch.export.Dim("seq", min=1, max=seq_max),
            **(model.export_dims() if hasattr(model, "export_dims") else {})}
    dynamic_shapes = tuple({i: dims[d] for i, d in enumerate(s.shape) if isinstance(d, str)} for s in inputs)
    wrapper = _Positional(model, input_names, output_names)
    args = tuple(feeds[n] for n in input_names)
    path_name = "plugin" if lowering == "plugin" else "fast"
    with attention_path(path_name), torch.no_grad(), _quiet_torch_exporter():
        program, profiles = _trace(wrapper, args, dynamic_shapes, inputs, profiles)

        step("translate")
        onnx_program = torch.onnx.export(program, args, dynamo=True, opset_version=opset, input_names=input_names,
                                         output_names=output_names, custom_translation_table=_translations(model),
                                         optimize=True, verbose=False)
    proto = onnx_program.model_proto

    step("optimise")
    proto = ops.attach_functions(proto)
    if lowering == "rewrite":
        proto = ops.inline_functions(proto)
    proto = _optimise(proto, fuse=fuse)
    _name_dynamic_dims(proto, {s.name: s.shape for s in [*inputs, *outputs]})
    if fp16:
        proto = to_fp16(proto, FP32_OPS_WITH_CACHE if hasattr(model, "cache_metadata") else FP32_OPS)
    proto.ir_version = min(proto.ir_version, IR_VERSION) if proto.ir_version else IR_VERSION
    proto.producer_name, proto.producer_version = "attnx", attnx.__version__

    weights_path = path.with_suffix(".safetensors") if save_weights else None
    specs = {s.name: s for s in [*inputs, *outputs]}
    info = ModelInfo(variant=model.variant, config=model.config_dict(), lowering=lowering,
                     precision="fp16" if fp16 else "fp32", inputs=_entries(proto.graph.input, specs),
                     outputs=_entries(proto.graph.output, specs), profiles={k: list(v) for k, v in profiles.items()},
                     version=attnx.__version__, weights=weights_path.name if weights_path else None,
                     tokenizer=tokenizer, cache=model.cache_metadata() if hasattr(model, "cache_metadata") else None)
    info.write(proto)

    step("check")
    large = _initializer_bytes(proto) > _EXTERNAL_DATA_BYTES
    if not large:
        _check(proto)

    step("save")
    save_model(proto, path)
    if large:
        _check(proto, path_for_large=path)
    if weights_path is not None:
        save_checkpoint(reference_model, weights_path)
    return ExportResult(path=path, model=model, info=info, weights_path=weights_path, steps=list(STEPS))


def export_variant(variant: str, path: str | Path | None = None, *, overrides: dict | None = None,
                   n_layers: int | None = None, lowering: str = "plugin", fp16: bool = False,
                   checkpoint: str | Path | None = None, opset: int = ONNX_OPSET, seed: int = 0,
                   profiles: dict | None = None, progress: Callable[[str], None] | None = None,
                   attention_outputs=None, head_mask: bool = False, fuse: bool = True) -> ExportResult:
    """Build ``variant`` (small default config + ``overrides``, seeded weights or ``checkpoint``) and export it."""
    options = {**DEFAULT_OPTIONS, **(overrides or {})}
    if n_layers is not None:
        options["n_layers"] = n_layers
    model = build_encoder(variant, seed=seed, **options)
    if checkpoint is not None:
        load_checkpoint(model, checkpoint)
    path = Path(path) if path is not None else default_path(variant, lowering, fp16)
    return export_encoder(model, path, lowering=lowering, fp16=fp16, opset=opset, profiles=profiles,
                          progress=progress, attention_outputs=attention_outputs, head_mask=head_mask, fuse=fuse)
