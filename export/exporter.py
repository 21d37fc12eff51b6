"""Export an attnx encoder to ONNX with the attnx custom ops.

Steps (each reported to ``progress``): trace (``torch.export`` with dynamic
``batch``/``seq``), translate (the dynamo ONNX exporter at opset 23, our torch
custom ops mapped onto ``attnx::MawDepthSelect`` / ``attnx::TtaDistance`` or onto
standard ops), optimise (constant folding, dead-node removal, fp16), check
(full ``onnx.checker``, strict shape inference), save (external data past 2 GB,
the weights beside the file as safetensors for ``attnx check``).

Lowerings: ``plugin`` (custom-op nodes with function bodies) and ``rewrite``
(standard ops only: maw's selected slice via GatherElements, smal through the
exact rewrite on the ``Attention`` op with a per-key bias).
"""

from __future__ import annotations

import contextlib
import hashlib
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
import torch

import attnx
from attnx.export import ops as xops
from attnx.export.fp16 import to_fp16
from attnx.export.metadata import ModelInfo, write_metadata
from attnx.models.encoder import Encoder
from attnx.models.registry import build_encoder

LOWERINGS = ("plugin", "rewrite")
STEPS = ("trace", "translate", "optimise", "check", "save")
DEFAULT_PROFILES = {"batch": (1, 8, 32), "seq": (1, 128, 512)}
#: The small default configuration `attnx export --variant X` uses.
DEFAULT_OPTIONS = {"d_model": 256, "n_heads": 4, "n_layers": 2}
_EXTERNAL_DATA_BYTES = 1_800_000_000  # protobuf's limit is 2 GiB; leave headroom for the graph
_MIN_OPSET = 18  # the dynamo exporter's minimum


@dataclass
class ExportResult:
    path: Path
    model: Encoder  # the reference the file was exported from (eval mode)
    info: ModelInfo
    weights_path: Path | None = None
    steps: list[str] = field(default_factory=list)

    @property
    def config(self) -> dict:
        return self.info.config


# --------------------------------------------------------------------------- torch custom op translations

def _translations(lowering: str) -> dict:
    """torch custom op -> onnxscript function, per lowering."""
    import onnxscript
    from onnxscript import opset23 as op

    attnx_ops = onnxscript.values.Opset(xops.DOMAIN, xops.DOMAIN_VERSION)
    plugin_attrs = {"plugin_version": xops.PLUGIN_VERSION, "plugin_namespace": xops.PLUGIN_NAMESPACE}

    def maw_plugin(q_depth, k_depth, policy_logits, scale: float):
        return attnx_ops.MawDepthSelect(q_depth, k_depth, policy_logits, scale=scale, **plugin_attrs)

    def tta_plugin(q, k, trace):
        return attnx_ops.TtaDistance(q, k, trace, **plugin_attrs)

    def maw_rewrite(q_depth, k_depth, policy_logits, scale: float):
        # Read only the selected depth slice: GatherElements along the depth axis (rank 4 throughout).
        depth = op.ArgMax(policy_logits, axis=1, keepdims=0)  # [B]
        index = op.Reshape(depth, op.Constant(value_ints=[-1, 1, 1, 1]))  # [B, 1, 1, 1]
        one = op.Constant(value_ints=[1])
        q_shape = op.Concat(op.Shape(q_depth, start=0, end=3), one, axis=0)
        k_shape = op.Concat(op.Shape(k_depth, start=0, end=3), one, axis=0)
        q_sel = op.GatherElements(q_depth, op.Expand(index, q_shape), axis=3)  # [B, H, Lq, 1]
        k_sel = op.GatherElements(k_depth, op.Expand(index, k_shape), axis=3)  # [B, H, Lk, 1]
        scale_t = op.CastLike(op.Constant(value_float=scale), q_sel)
        logits = op.MatMul(op.Mul(q_sel, scale_t), op.Transpose(k_sel, perm=[0, 1, 3, 2]))
        return logits, depth

    def tta_rewrite(q, k, trace):
        # q^T T q + k^T T k - q^T (T + T^T) k
        qq = op.ReduceSum(op.Mul(op.MatMul(q, trace), q), op.Constant(value_ints=[-1]), keepdims=1)
        kk = op.ReduceSum(op.Mul(op.MatMul(k, trace), k), op.Constant(value_ints=[-1]), keepdims=1)
        t_sym = op.Add(trace, op.Transpose(trace, perm=[0, 1, 3, 2]))
        cross = op.MatMul(q, op.Transpose(op.MatMul(k, t_sym), perm=[0, 1, 3, 2]))
        return op.Sub(op.Add(qq, op.Transpose(kk, perm=[0, 1, 3, 2])), cross)

    maw, tta = (maw_plugin, tta_plugin) if lowering == "plugin" else (maw_rewrite, tta_rewrite)
    return {torch.ops.attnx.maw_depth_select.default: maw, torch.ops.attnx.tta_distance.default: tta}


# --------------------------------------------------------------------------- the traced wrapper

class _ExportWrapper(torch.nn.Module):
    """Positional inputs in the file's order; outputs ``output`` (+ ``maw_depth``)."""

    def __init__(self, encoder: Encoder, context_names: list[str]):
        super().__init__()
        self.encoder = encoder
        self.context_names = context_names

    def forward(self, hidden_states, attention_mask, *context):
        ctx = dict(zip(self.context_names, context))
        return self.encoder(hidden_states, attention_mask, return_depth=self.encoder.has_maw, **ctx)


def example_inputs(model: Encoder, batch: int = 2, seq: int = 8, seed: int = 0) -> dict[str, torch.Tensor]:
    """Unit-scale example inputs (the last example right-padded) for every input spec."""
    g = torch.Generator().manual_seed(seed)
    dims = {"batch": batch, "seq": seq}
    feeds: dict[str, torch.Tensor] = {}
    for spec in model.input_specs():
        shape = [dims.get(d, d) if isinstance(d, str) else d for d in spec.shape]
        if spec.role == "attention_mask":
            mask = torch.ones(shape, dtype=torch.int64)
            mask[-1, max(1, seq - seq // 3):] = 0
            feeds[spec.name] = mask
        elif spec.dtype == "int64":
            n_types = model.variant_configs["metaphor"].n_metaphor_types
            feeds[spec.name] = torch.randint(0, n_types, shape, generator=g)
        else:
            feeds[spec.name] = torch.randn(shape, generator=g)
    return feeds


@contextlib.contextmanager
def _lowering_mode(model: Encoder, lowering: str):
    """smal layers take the exact rewrite path under the rewrite lowering (restored afterwards)."""
    # Layers of one variant share one config object: record each object once.
    configs = {id(b.attn.config): b.attn.config for b in model.blocks if b.variant == "smal"}
    saved = {key: cfg.use_rewrite for key, cfg in configs.items()}
    for cfg in configs.values():
        cfg.use_rewrite = lowering == "rewrite"
    try:
        yield
    finally:
        for key, cfg in configs.items():
            cfg.use_rewrite = saved[key]


# --------------------------------------------------------------------------- graph post-processing

def _name_dynamic_dims(model: onnx.ModelProto, specs: dict[str, tuple]) -> None:
    """Give graph inputs/outputs the dim names of the contract (``batch``, ``seq``)."""
    for vi in list(model.graph.input) + list(model.graph.output):
        shape = specs.get(vi.name)
        if shape is None:
            continue
        dims = vi.type.tensor_type.shape.dim
        for d, want in zip(dims, shape):
            if isinstance(want, str):
                d.ClearField("dim_value")
                d.dim_param = want
            else:
                d.ClearField("dim_param")
                d.dim_value = want


def _optimise(model: onnx.ModelProto) -> onnx.ModelProto:
    """Fold constants and drop dead nodes (graphsurgeon), keeping the custom-op functions."""
    import onnx_graphsurgeon as gs

    functions = list(model.functions)
    graph = gs.import_onnx(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph.fold_constants(error_ok=True).cleanup(remove_unused_graph_inputs=False).toposort()
    out = gs.export_onnx(graph)
    out.ir_version = model.ir_version
    del out.functions[:]
    out.functions.extend(functions)
    out.metadata_props.extend(model.metadata_props)
    return out


def _check(model: onnx.ModelProto, path_for_large: Path | None = None) -> onnx.ModelProto:
    """Full checker and strict shape inference; every graph output must get a shape."""
    if path_for_large is not None:
        onnx.checker.check_model(str(path_for_large), full_check=True)
        return model
    onnx.checker.check_model(model, full_check=True)
    inferred = onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True, data_prop=True)
    for out in inferred.graph.output:
        if not out.type.tensor_type.HasField("shape"):
            raise RuntimeError(f"shape inference gave output {out.name!r} no shape")
    return model


def _initializer_bytes(model: onnx.ModelProto) -> int:
    return sum(int(np.prod(t.dims)) * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
               for t in model.graph.initializer)


def _save(model: onnx.ModelProto, path: Path) -> bool:
    """Save; models past ~2 GB keep their weights in ``<name>.data`` beside the file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    external = _initializer_bytes(model) > _EXTERNAL_DATA_BYTES
    if external:
        onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=path.name + ".data", size_threshold=1024)
    else:
        onnx.save_model(model, str(path))
    return external


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# --------------------------------------------------------------------------- checkpoints

def load_checkpoint(model: Encoder, checkpoint: str | Path) -> None:
    """Load safetensors weights; any missing, unexpected or mis-shaped tensor is a clear error."""
    from safetensors.torch import load_file

    path = Path(checkpoint)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    try:
        state = load_file(str(path))
    except Exception as e:  # safetensors raises its own error types
        raise ValueError(f"cannot read checkpoint {path}: {e}") from None
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    mismatched = [f"{k} {list(state[k].shape)} (model expects {list(own[k].shape)})"
                  for k in sorted(set(own) & set(state)) if state[k].shape != own[k].shape]
    problems = []
    if missing:
        problems.append(f"missing {len(missing)}: {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}")
    if unexpected:
        problems.append(f"unexpected {len(unexpected)}: {', '.join(unexpected[:4])}"
                        f"{' ...' if len(unexpected) > 4 else ''}")
    if mismatched:
        problems.append(f"wrong shape {len(mismatched)}: {'; '.join(mismatched[:3])}")
    if problems:
        raise ValueError(f"checkpoint {path.name} does not fit this {model.variant} model: " + " | ".join(problems))
    model.load_state_dict(state)


def save_checkpoint(model: Encoder, path: str | Path) -> Path:
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, str(path))
    return path


# --------------------------------------------------------------------------- public entry points

def default_path(variant: str, lowering: str = "plugin", fp16: bool = False, folder: str | Path = "attnx-out") -> Path:
    suffix = ("" if lowering == "plugin" else f"-{lowering}") + ("-fp16" if fp16 else "")
    return Path(folder) / f"{variant}{suffix}.onnx"


def export_encoder(model: Encoder, path: str | Path, *, lowering: str = "plugin", fp16: bool = False,
                   opset: int = xops.ONNX_OPSET, profiles: dict | None = None, save_weights: bool = True,
                   progress: Callable[[str], None] | None = None) -> ExportResult:
    """Export any attnx :class:`Encoder` (eval mode) to ``path``."""
    if lowering not in LOWERINGS:
        raise ValueError(f"unknown lowering {lowering!r}; valid: {', '.join(LOWERINGS)}")
    max_opset = onnx.defs.onnx_opset_version()
    if not _MIN_OPSET <= opset <= max_opset:
        raise ValueError(f"opset must be in [{_MIN_OPSET}, {max_opset}], got {opset}")
    profiles = _check_profiles(profiles or DEFAULT_PROFILES)
    path = Path(path)
    step = progress or (lambda name: None)
    model = model.eval()
    specs = model.input_specs()
    context_names = [s.name for s in specs if s.role == "context"]
    input_names = [s.name for s in specs]
    output_names = ["output"] + (["maw_depth"] if model.has_maw else [])

    step("trace")
    feeds = example_inputs(model)
    batch = torch.export.Dim("batch", min=1, max=4096)
    seq = torch.export.Dim("seq", min=1, max=65536)
    dims = {"batch": batch, "seq": seq}

    def dyn(spec):
        return {i: dims[d] for i, d in enumerate(spec.shape) if isinstance(d, str)}

    dynamic_shapes = (dyn(specs[0]), dyn(specs[1]))
    if context_names:
        dynamic_shapes += (tuple(dyn(s) for s in specs[2:]),)
    wrapper = _ExportWrapper(model, context_names)
    args = tuple(feeds[n] for n in input_names)
    with _lowering_mode(model, lowering), torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.export.export(wrapper, args, dynamic_shapes=dynamic_shapes, strict=False)

        step("translate")
        onnx_program = torch.onnx.export(program, args, dynamo=True, opset_version=opset, input_names=input_names,
                                         output_names=output_names, custom_translation_table=_translations(lowering),
                                         optimize=True, verbose=False)
    proto = onnx_program.model_proto

    step("optimise")
    proto = xops.attach_functions(proto)
    proto = _optimise(proto)
    shapes = {s.name: s.shape for s in specs}
    shapes.update({"output": ("batch", "seq", model.d_model), "maw_depth": ("batch",)})
    _name_dynamic_dims(proto, shapes)
    if fp16:
        proto = to_fp16(proto)
    proto.ir_version = min(proto.ir_version, xops.IR_VERSION) if proto.ir_version else xops.IR_VERSION
    proto.producer_name, proto.producer_version = "attnx", attnx.__version__

    weights_path = path.with_suffix(".safetensors") if save_weights else None
    info = ModelInfo.for_encoder(model, lowering=lowering, precision="fp16" if fp16 else "fp32", profiles=profiles,
                                 proto=proto, weights=weights_path.name if weights_path else None)
    write_metadata(proto, info)

    step("check")
    large = _initializer_bytes(proto) > _EXTERNAL_DATA_BYTES
    if not large:
        _check(proto)

    step("save")
    _save(proto, path)
    if large:
        _check(proto, path_for_large=path)
    if weights_path is not None:
        save_checkpoint(model, weights_path)
    return ExportResult(path=path, model=model, info=info, weights_path=weights_path, steps=list(STEPS))


def export_variant(variant: str, path: str | Path | None = None, *, overrides: dict | None = None,
                   n_layers: int | None = None, lowering: str = "plugin", fp16: bool = False,
                   checkpoint: str | Path | None = None, opset: int = xops.ONNX_OPSET, seed: int = 0,
                   profiles: dict | None = None, progress: Callable[[str], None] | None = None) -> ExportResult:
    """Build ``variant`` (small default config + ``overrides``, seeded weights or ``checkpoint``) and export it."""
    options = {**DEFAULT_OPTIONS, **(overrides or {})}
    if n_layers is not None:
        options["n_layers"] = n_layers
    model = build_encoder(variant, seed=seed, **options)
    if checkpoint is not None:
        load_checkpoint(model, checkpoint)
    path = Path(path) if path is not None else default_path(variant, lowering, fp16)
    return export_encoder(model, path, lowering=lowering, fp16=fp16, opset=opset, profiles=profiles,
                          progress=progress)


def _check_profiles(profiles: dict) -> dict:
    out = {}
    for axis in ("batch", "seq"):
        if axis not in profiles:
            raise ValueError(f"profiles need '{axis}': (min, opt, max)")
        lo, opt, hi = (int(v) for v in profiles[axis])
        if not 1 <= lo <= opt <= hi:
            raise ValueError(f"profile {axis}={lo},{opt},{hi}: need 1 <= min <= opt <= max")
        out[axis] = [lo, opt, hi]
    return out

