"""Export an attnx model to ONNX with the attnx custom ops.

Steps (each reported to ``progress``): trace (``torch.export`` with dynamic ``batch``/``seq``),
translate (the dynamo ONNX exporter at opset 23; each variant's torch custom ops become nodes of
its ONNX custom ops), optimise (:mod:`attnx.export.graph`: constant folding, function bodies, the
fusions, the contract's dim names, fp16), check (full ``onnx.checker``, strict shape inference),
save (:mod:`attnx.export.onnx_file`: one file, or external data past ~1.8 GB; the weights for
``attnx check`` beside it). Nothing copies the weights: the graph's tensors are views of the
PyTorch parameters until each is written, so an export peaks near the model's own size; a model built
without its weights (:mod:`attnx.pretrained.streamed`) has each read from its checkpoint when it is
written instead (:mod:`attnx.export.streaming`), so the export peaks near its largest tensor. Weight-only
quantization (``weight_only_bits``) is a pass of the optimise step: each weight is quantized as it is written.

Every file is written under a staging folder and made visible as a whole (:mod:`attnx.export.staging`).

Lowerings: ``plugin`` traces the ``plugin`` attention path, so custom ops appear as nodes with
function bodies (TensorRT maps them to plugins); ``rewrite`` traces the ``fast`` path and inlines
any remaining custom node's body, so the file has standard ops only.

Any model with the signature of :mod:`attnx.models.signature` exports: attnx's encoders, and the
pretrained hosts that place a variant in a real model.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

import onnx
import torch

import attnx
from attnx.contract import (DEFAULT_PROFILES, IR_VERSION, MIN_OPSET, ONNX_OPSET, PREFIX, ModelInfo, TensorEntry,
                            check_profiles)
from attnx.export import fuse as fusions
from attnx.export import graph as passes
from attnx.export import onnx_file, ops
from attnx.export.attention_outputs import WithAttentionOutputs, parse_layers
from attnx.export.decompose import only_what_onnx_lacks
from attnx.export.protocol import check_exportable, is_cached
from attnx.export.type_promotion import promotion_from_the_trace
from attnx.models.checkpoint import load_checkpoint, save_checkpoint
from attnx.export.fp16 import FP32_OPS, FP32_OPS_WITH_CACHE, to_fp16
from attnx.export.saving import save_model, write_info  # noqa: F401  (their home before)
from attnx.export.staging import Staging, check_room
from attnx.export.streaming import bind_initializers
from attnx.models.attention import attention_path
from attnx.models.build import build_encoder
from attnx.models.signature import example_tensor
from attnx.models.spec import get_spec

LOWERINGS = ("plugin", "rewrite")
STEPS = ("load", "trace", "translate", "optimise", "check", "save", "commit")
#: The small default configuration `attnx export --variant X` uses.
DEFAULT_OPTIONS = {"d_model": 256, "n_heads": 4, "n_layers": 2}


class Progress(Protocol):
    """``progress(step)`` when a step starts; ``progress(step, done, total)`` as a counted step advances
    (``save``: bytes written)."""

    def __call__(self, step: str, done: int | None = None, total: int | None = None) -> None: ...


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


try:  # torch's exporter internals, for the shared registry below (absent in other versions: no sharing)
    from torch.onnx._internal.exporter import _constants as _torch_onnx_constants
    from torch.onnx._internal.exporter import _registration
    _TORCHLIB_OPSET = _torch_onnx_constants.TORCHLIB_OPSET
except (ImportError, AttributeError):  # pragma: no cover
    _registration, _TORCHLIB_OPSET = None, 18
_REGISTRY_LOCK = threading.Lock()


#: torch's own method, bound before any export replaces it for its duration.
_FROM_TORCHLIB = getattr(getattr(_registration, "ONNXRegistry", None), "from_torchlib", None)


@functools.cache
def _torchlib_registry(opset: int):
    return _FROM_TORCHLIB(opset_version=opset)


@contextlib.contextmanager
def _no_needless_reruns():
    """torch's exporter without what runs the whole program again for nothing: the retrace that decomposes
    (only what ONNX lacks: :mod:`attnx.export.decompose`), the re-run that promotes types (from the trace's
    values: :mod:`attnx.export.type_promotion`), and the fake-tensor cache, which pays when a trace meets the
    same operator and shapes again and again: one export mostly fills entries it never reads (a small model's
    trace 25% faster without it, a 16-layer decoder's equal)."""
    no_fake_cache = torch._dynamo.config.patch(fake_tensor_cache_enabled=False)
    with only_what_onnx_lacks(), promotion_from_the_trace(), no_fake_cache:
        yield


@contextlib.contextmanager
def _shared_torchlib_registry():
    """torch's exporter builds its registry of the ~2,000 torchlib functions on every call (about a second,
    a fifth of a small model's export): build it once per process, give each export a copy of its own (the
    custom translations are added to the copy)."""
    cls = getattr(_registration, "ONNXRegistry", None)
    original = cls.__dict__.get("from_torchlib") if cls is not None else None
    if (_FROM_TORCHLIB is None or not isinstance(original, classmethod)
            or not isinstance(getattr(cls(), "functions", None), dict)):
        yield
        return

    def from_torchlib(opset_version=_TORCHLIB_OPSET):
        base = _torchlib_registry(opset_version)
        registry = cls()
        registry._opset_version = base._opset_version
        registry.functions = {target: list(metas) for target, metas in base.functions.items()}
        return registry

    with _REGISTRY_LOCK:  # one export at a time replaces it (torch.export's tracing is not concurrent either)
        cls.from_torchlib = staticmethod(from_torchlib)
        try:
            yield
        finally:
            cls.from_torchlib = original


# --------------------------------------------------------------------------- the graph

#: Above these weights an export collects the traced programs' reference cycles before optimising.
GC_AFTER_TRACE_BYTES = 32 << 20


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


def build_graph(model, inputs, outputs, *, lowering: str, opset: int, profiles: dict, fuse: bool, fp16: bool,
                step: Progress):
    """``(onnx-ir model, profiles)``: ``model`` traced, translated and optimised; its tensors are views of
    ``model``'s parameters or computed from them when written (:mod:`attnx.export.graph`)."""
    input_names, output_names = [s.name for s in inputs], [s.name for s in outputs]
    step("trace")
    # A model with more dynamic dims than batch/seq (a decoder's KV cache) gives its own examples and dims.
    feeds = model.example_inputs() if is_cached(model) else example_inputs(model)
    seq_max = int(getattr(model, "max_seq", 65536))  # a model with position embeddings has a limit
    dims = {"batch": torch.export.Dim("batch", min=1, max=4096), "seq": torch.export.Dim("seq", min=1, max=seq_max),
            **(model.export_dims() if is_cached(model) else {})}
    dynamic_shapes = tuple({i: dims[d] for i, d in enumerate(s.shape) if isinstance(d, str)} for s in inputs)
    wrapper = _Positional(model, input_names, output_names)
    args = tuple(feeds[n] for n in input_names)
    path_name = "plugin" if lowering == "plugin" else "fast"
    with attention_path(path_name), torch.no_grad(), _quiet_torch_exporter(), _shared_torchlib_registry(), \
            _no_needless_reruns():
        program, profiles = _trace(wrapper, args, dynamic_shapes, inputs, profiles)

        step("translate")
        onnx_program = torch.onnx.export(program, args, dynamo=True, opset_version=opset, input_names=input_names,
                                         output_names=output_names, custom_translation_table=_translations(model),
                                         optimize=False, verbose=False)
    graph = onnx_program.model
    del onnx_program, program
    bind_initializers(graph, model)  # a streamed model's weights: read from its checkpoint when written
    if estimate_bytes(model) > GC_AFTER_TRACE_BYTES:
        # The traced programs (FX graphs hold reference cycles): memory for the steps that follow. A full
        # collection costs ~0.5 s in a process holding torch and transformers, more than a small model frees.
        gc.collect()

    step("optimise")
    passes.fold_constants(graph)
    passes.attach_functions(graph)
    if lowering == "rewrite":
        passes.inline_functions(graph)
        passes.fold_constants(graph, inline=False)
    passes.batch_rotary_caches(graph)
    if fuse:
        fusions.fuse(graph)
    passes.name_dims(graph, {s.name: s.shape for s in [*inputs, *outputs]})
    if fp16:
        to_fp16(graph, FP32_OPS_WITH_CACHE if is_cached(model) else FP32_OPS)
    passes.remove_dead(graph)
    passes.strip_metadata(graph)
    graph.ir_version = min(graph.ir_version, IR_VERSION) if graph.ir_version else IR_VERSION
    graph.producer_name, graph.producer_version = "attnx", attnx.__version__
    return graph, profiles


def _entries(values, specs: dict) -> list[TensorEntry]:
    """Metadata entries of graph inputs/outputs: dtype and dims from the graph, role/range/doc from the specs."""
    out = []
    for name, dtype, shape in passes.io_entries(values):
        spec = specs[name]
        out.append(TensorEntry(name=name, role=spec.role, dtype=dtype, shape=shape, range=getattr(spec, "range", None),
                               doc=spec.doc, default=getattr(spec, "default", None)))
    return out


def export_names(path: Path) -> set[str]:
    """The final names an export to ``path`` writes or replaces beside it."""
    return {path.name, path.name + ".data", path.with_suffix(".safetensors").name, f"{path.stem}.tokenizer"}


# --------------------------------------------------------------------------- public entry points

def default_path(variant: str, lowering: str = "plugin", fp16: bool = False, folder: str | Path = "attnx-out") -> Path:
    suffix = ("" if lowering == "plugin" else f"-{lowering}") + ("-fp16" if fp16 else "")
    return Path(folder) / f"{variant}{suffix}.onnx"


def export_encoder(model, path: str | Path, *, lowering: str = "plugin", fp16: bool = False,
                   opset: int = ONNX_OPSET, profiles: dict | None = None, save_weights: bool = True,
                   progress: Progress | None = None, tokenizer: dict | None = None,
                   attention_outputs=None, head_mask: bool = False, fuse: bool = True,
                   staging: Staging | None = None, weight_names=None, reference: dict | None = None,
                   int8_weight_bits: int | None = None, weight_only_bits: int | None = None,
                   weight_only_options: dict | None = None) -> ExportResult:
    """Export any attnx model (eval mode; see :mod:`attnx.models.signature`) to ``path``.

    ``fuse``: the exact standard-ONNX fusions of :mod:`attnx.export.fuse` (packed Q/K/V, 3-D
    attention); off only to compare against the unfused graph.

    ``tokenizer``: the text metadata of a model whose tokenizer files travel beside it.
    ``attention_outputs`` (``"all"`` or layer indices) adds outputs ``attentions.{i}``, ``head_mask``
    an input ``head_mask [n_layers, heads]`` (:mod:`attnx.export.attention_outputs`).

    Files: ``path`` (and ``<name>.data`` past ~1.8 GB of weights), ``<stem>.safetensors`` (the weights
    ``attnx check`` rebuilds the reference from: those named by ``weight_names``, default all; with
    ``reference`` the rest come from the source folder it names). ``staging``: write into that
    staging (the caller adds files and commits); default: staged and committed here.
    ``int8_weight_bits``: quantize (:func:`attnx.export.quantize.quantize_file`) before the files appear;
    ``weight_only_bits`` (4 or 8): weight-only MatMulNBits instead (:mod:`attnx.export.weight_only`), with
    ``weight_only_options`` (``block_size``, ``lm_head_bits``: :func:`~attnx.export.weight_only.quantize_graph`)."""
    check_exportable(model)  # one line naming what a model lacks (attnx.export.protocol)
    if lowering not in LOWERINGS:
        raise ValueError(f"unknown lowering {lowering!r}; valid: {', '.join(LOWERINGS)}")
    max_opset = onnx.defs.onnx_opset_version()
    if not MIN_OPSET <= opset <= max_opset:
        raise ValueError(f"opset must be in [{MIN_OPSET}, {max_opset}], got {opset}")
    profiles = check_profiles(profiles or DEFAULT_PROFILES)
    path = Path(path)
    if path.suffix.lower() != ".onnx":
        raise ValueError(f"the output must be a .onnx file, got {path.name}")
    kwargs = dict(lowering=lowering, fp16=fp16, opset=opset, profiles=profiles, save_weights=save_weights,
                  progress=progress, tokenizer=tokenizer, attention_outputs=attention_outputs, head_mask=head_mask,
                  fuse=fuse, weight_names=weight_names, reference=reference, int8_weight_bits=int8_weight_bits,
                  weight_only_bits=weight_only_bits, weight_only_options=weight_only_options)
    if staging is None:
        with Staging(path, owned=export_names(path)) as stage:
            check_room(path.parent, estimate_bytes(model, fp16, int8_weight_bits or weight_only_bits))
            result = export_encoder(model, path, staging=stage, **kwargs)
            (progress or (lambda *a: None))("commit")
            stage.commit()
        return result
    step = progress or (lambda name, done=None, total=None: None)
    model = model.eval()
    reference_model = model
    if attention_outputs is not None or head_mask:
        layers = [] if attention_outputs is None else parse_layers(attention_outputs, len(model.blocks))
        model = WithAttentionOutputs(model, layers, head_mask)
    ops.register_schemas()
    # inputs the file gives a default (a decoder's logits_to_keep): last, each an initializer of its own name
    defaults = model.input_defaults() if is_cached(model) else []
    inputs, outputs = model.input_specs() + [spec for spec, _ in defaults], model.output_specs()
    graph, profiles = build_graph(model, inputs, outputs, lowering=lowering, opset=opset, profiles=profiles, fuse=fuse,
                                  fp16=fp16, step=step)
    passes.give_defaults(graph, defaults)

    quantization = None
    if weight_only_bits is not None:  # each weight quantized when it is written (attnx.export.weight_only)
        from attnx.export import weight_only

        step("weights")
        try:
            quantization = weight_only.quantize_graph(graph, weight_only_bits, **(weight_only_options or {}))
        except Exception as e:  # one line; the staging folder goes, so nothing appears under the final name
            msg = " ".join(str(e).split())[:200] or type(e).__name__
            raise ValueError(f"{path}: int{weight_only_bits} weight-only quantization failed ({type(e).__name__}: "
                             f"{msg}); nothing was written under that name") from None
    weights_path = path.with_suffix(".safetensors") if save_weights else None
    specs = {s.name: s for s in [*inputs, *outputs]}
    precision = "fp16" if fp16 else "fp32" if weight_only_bits is None else f"int{weight_only_bits}-weights"
    info = ModelInfo(variant=model.variant, config=model.config_dict(), lowering=lowering,
                     precision=precision, inputs=_entries(passes.required_inputs(graph), specs),
                     outputs=_entries(graph.graph.outputs, specs), profiles={k: list(v) for k, v in profiles.items()},
                     version=attnx.__version__, weights=weights_path.name if weights_path else None,
                     tokenizer=tokenizer, cache=model.cache_metadata() if is_cached(model) else None,
                     reference=reference)
    if quantization is not None:
        info.quantization = quantization
    write_info(graph, info)

    step("check")
    onnx_file.check(graph)

    step("save")
    staged = staging.path(path.name)
    # A decoder with its KV cache keeps its weights in <name>.data (onnxruntime-genai's layout): ONNX Runtime
    # memory-maps them, so loading holds no second copy (SmolLM2-135M fp32: 689 MB peak instead of 826 MB).
    onnx_file.save(graph, staged, external=True if info.cache else None,
                   progress=lambda done, total: step("save", done, total))
    del graph
    if weights_path is not None:
        save_checkpoint(reference_model, staging.path(weights_path.name), names=weight_names)
    if int8_weight_bits is not None:
        from attnx.export.quantize import quantize_file

        step("int8")
        try:
            quantize_file(staged, staged, weight_bits=int8_weight_bits)
        except Exception as e:  # one line; the staging folder goes, so nothing appears under the final name
            msg = " ".join(str(e).split())[:200] or type(e).__name__
            raise ValueError(f"{path}: int8 quantization failed ({type(e).__name__}: {msg}); nothing was written "
                             "under that name") from None
        info = ModelInfo.read(staged)  # precision and how it was quantized
    return ExportResult(path=path, model=model, info=info, weights_path=weights_path, steps=list(STEPS))


def estimate_bytes(model, fp16: bool = False, int8_weight_bits: int | None = None) -> int:
    """What an export of ``model`` writes, about: its weights once, in the file's precision (an int8
    export stages the fp32 file first)."""
    seen, n = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            n += p.numel()
    per = 2 if fp16 else 4
    return n * per + (n if int8_weight_bits else 0) + (1 << 20)


def export_variant(variant: str, path: str | Path | None = None, *, overrides: dict | None = None,
                   n_layers: int | None = None, lowering: str = "plugin", fp16: bool = False,
                   checkpoint: str | Path | None = None, opset: int = ONNX_OPSET, seed: int = 0,
                   profiles: dict | None = None, progress: Progress | None = None,
                   attention_outputs=None, head_mask: bool = False, fuse: bool = True,
                   int8_weight_bits: int | None = None) -> ExportResult:
    """Build ``variant`` (small default config + ``overrides``, seeded weights or ``checkpoint``) and export it."""
    options = {**DEFAULT_OPTIONS, **(overrides or {})}
    if n_layers is not None:
        options["n_layers"] = n_layers
    model = build_encoder(variant, seed=seed, **options)
    if checkpoint is not None:
        load_checkpoint(model, checkpoint)
    path = Path(path) if path is not None else default_path(variant, lowering, fp16)
    return export_encoder(model, path, lowering=lowering, fp16=fp16, opset=opset, profiles=profiles,
                          progress=progress, attention_outputs=attention_outputs, head_mask=head_mask, fuse=fuse,
                          int8_weight_bits=int8_weight_bits)
