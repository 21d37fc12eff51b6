"""``VariantSpec``: everything attnx needs to know about a variant, declared in the variant's own file.

A variant is one file (``models/<name>.py``): its config dataclass, its attention module, and
at the bottom ``SPEC = register(VariantSpec(...))``. Encoder, exporter, parity, serving and the
CLI read the spec and never name a variant. A variant outside this package registers the same
way, from its own module, which attnx imports when the module is named in the ``ATTNX_VARIANTS``
environment variable (comma-separated) or in a package's ``attnx.variants`` entry point.

What a spec declares:

- ``config`` / ``attention``: the options dataclass (an ``AttentionConfig``) and the module
  ``attention(config)`` with ``forward(x, attention_mask=None, head_mask=None, **context)``;
  its static ``context_inputs(config)`` lists the context it takes.
- ``fusion``: a module applied after a block's FFN, ``fusion(x, y, **context)`` (optional).
- ``extra_outputs``: tensors besides the main output that an export returns (:class:`ExtraOutput`).
- ``custom_ops``: the ONNX custom ops the variant lowers to, with their schemas, function bodies
  and lowerings (:class:`CustomOp`).
- ``tolerances``: per precision and output, the parity bounds that differ from the defaults.
- ``placement``: what a pretrained host needs to put the variant in (:class:`Placement`).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from torch import nn

from attnx.models.signature import InputSpec

#: Parity bounds ``(atol, rtol, mean_atol)``: an element fails past both atol and rtol; the mean
#: absolute error must stay under mean_atol. Variants override per precision and output.
Tolerance = tuple[float, float, float]


@dataclass(frozen=True)
class ExtraOutput:
    """An output besides the main one, read from the last layer of the variant after a forward.

    ``read(attention)`` returns the tensor from that layer's attention module. ``margin(module)``, when given, returns per row how
    clear the decision behind an exact output was (e.g. top-1 minus top-2 policy logit), so
    parity can report a near-tie that flips in fp16 as a tie rather than an error;
    ``tie_margin[precision]`` is the margin under which that is allowed.
    """

    name: str
    shape: tuple  # ints, "batch", "seq"
    dtype: str  # numpy dtype name of the file's output: "int64", "float32"
    read: Callable[[nn.Module], Any]
    doc: str = ""
    exact: bool = True
    margin: Callable[[nn.Module], Any] | None = None
    tie_margin: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class CustomOp:
    """An ONNX custom op (domain ``attnx``) a variant lowers to.

    - ``name``: the ONNX ``op_type``, which is also the TensorRT plugin's name.
    - ``schema()``: an ``onnx.defs.OpSchema`` (registered so the checker and shape inference know it).
    - ``function(opset)``: a model-local ``FunctionProto`` of standard ops, so ONNX Runtime runs it.
    - ``torch_op``: the torch custom op traced into the exported graph (None for an op kept only so
      files exported by an earlier attnx still load).
    - ``plugin()``: the onnxscript function the exporter maps ``torch_op`` onto under the ``plugin``
      lowering (a node of this op). The ``rewrite`` lowering inlines ``function`` instead.
    - ``engine_function(opset)``: for an op with no TensorRT plugin of its own, its body in ops that
      have one (smal's whole attention: the distance plugin and a softmax). ``function`` is then the
      fast form ONNX Runtime runs, and the file carries this one too (domain
      :data:`attnx.contract.ENGINE_DOMAIN`), which ``attnx build-engine`` inlines before parsing.
    """

    name: str
    schema: Callable[[], Any]
    function: Callable[[int], Any]
    torch_op: Any = None
    plugin: Callable[[], Callable] | None = None
    doc: str = ""
    engine_function: Callable[[int], Any] | None = None


@dataclass(frozen=True)
class Placement:
    """How a pretrained host (a BERT-family encoder, GPT-2) takes this variant.

    ``replace``: the variant can stand in for a layer's attention; it takes over the pretrained
    Q/K/V/O (``AttentionBase``'s ``W_Q``/``W_K``/``W_V``/``W_O``). ``append``: it can be appended
    after the encoder as residual layers (MAW's own form). ``neutral(module)`` sets the variant's
    new parameters so the layer computes exactly the plain attention it replaces, and
    ``neutral_fusion(fusion)`` does the same for a variant's fusion (``exact`` says whether such
    values exist: when not, a placed variant starts from its own init). Appended layers start as
    residual branches whose output projection is zero, whatever the variant.
    """

    replace: bool = True
    append: bool = False
    default: str = "replace"
    neutral: Callable[[nn.Module], None] | None = None
    neutral_fusion: Callable[[nn.Module], None] | None = None
    exact: bool = True


def _no_context(config) -> list[InputSpec]:
    return []


@dataclass(frozen=True)
class VariantSpec:
    name: str
    summary: str
    config: type
    attention: type
    fusion: type | None = None
    extra_outputs: tuple[ExtraOutput, ...] = ()
    custom_ops: tuple[CustomOp, ...] = ()
    tolerances: Mapping[str, Mapping[str, Tolerance]] = field(default_factory=dict)
    placement: Placement = Placement()
    #: decoding with a KV cache: what the cached step computes, where it is not simply "exact" (the
    #: state the attention declares in ``cache_state`` is listed beside it by :meth:`cache_summary`)
    cache_note: str = ""

    def context_inputs(self, config) -> list[InputSpec]:
        """The context inputs of one layer of this variant (attention's, then the fusion's)."""
        specs = list(self.attention.context_inputs(config))
        if self.fusion is not None:
            specs += self.fusion.context_inputs(config)
        return specs

    def cache_summary(self) -> str:
        """What a decoder's KV cache holds for this variant, and how its cached step relates to re-running
        the whole sequence (``attnx variants``, ``attnx.cache`` metadata)."""
        declare = getattr(self.attention, "cache_state", None)
        entries = [e.name for e in declare(self.make_config())] if declare is not None else []
        held = "k, v" + "".join(f", {name}" for name in entries)
        return f"caches {held}; " + (self.cache_note or "a cached step equals re-running the sequence")

    def make_config(self, **options):
        """The config dataclass; an unknown option is an error listing the valid ones."""
        valid = self.options()
        unknown = sorted(set(options) - set(valid))
        if unknown:
            raise ValueError(f"unknown option(s) {', '.join(unknown)} for variant {self.name!r}; "
                             f"valid options: {', '.join(valid)}")
        return self.config(**options)

    def options(self) -> dict[str, Any]:
        """Option name -> default."""
        from dataclasses import MISSING, fields

        return {f.name: (f.default if f.default is not MISSING else f.default_factory())  # type: ignore[misc]
                for f in fields(self.config)}


# --------------------------------------------------------------------------- the registry

_REGISTRY: dict[str, VariantSpec] = {}
_EXTERNAL_LOADED = False
ENV_MODULES = "ATTNX_VARIANTS"
ENTRY_POINT_GROUP = "attnx.variants"


def register(spec: VariantSpec, *, replace: bool = False) -> VariantSpec:
    """Add a variant; returns the spec (``SPEC = register(VariantSpec(...))``)."""
    if not spec.name.isidentifier():
        raise ValueError(f"variant name {spec.name!r} must be an identifier (it names files and ONNX inputs)")
    if spec.name in _REGISTRY and not replace and _REGISTRY[spec.name] is not spec:
        raise ValueError(f"variant {spec.name!r} is already registered")
    _REGISTRY[spec.name] = spec
    return spec


def unregister(name: str) -> None:
    _REGISTRY.pop(name, None)


def _load_external() -> None:
    """Import the variant modules named by ``$ATTNX_VARIANTS`` and ``attnx.variants`` entry points."""
    global _EXTERNAL_LOADED
    if _EXTERNAL_LOADED:
        return
    _EXTERNAL_LOADED = True
    for module in filter(None, (m.strip() for m in os.environ.get(ENV_MODULES, "").split(","))):
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise ValueError(f"${ENV_MODULES} names {module!r}, which does not import: {e}") from None
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        loaded = ep.load()
        if isinstance(loaded, VariantSpec):
            register(loaded, replace=True)


def get_spec(name: str) -> VariantSpec:
    if name not in _REGISTRY:
        _load_external()
    if name not in _REGISTRY:
        raise ValueError(f"unknown variant {name!r}; valid variants: {', '.join(variant_names())}")
    return _REGISTRY[name]


def variant_names() -> tuple[str, ...]:
    _load_external()
    return tuple(_REGISTRY)


def all_specs() -> list[VariantSpec]:
    return [_REGISTRY[n] for n in variant_names()]


def all_custom_ops() -> list[CustomOp]:
    """Every custom op of every registered variant (for schema registration and function bodies)."""
    return [op for spec in all_specs() for op in spec.custom_ops]


class _Names(Sequence):
    """``VARIANTS``: the registered names, read live (a variant registered later is in it)."""

    def __getitem__(self, index):
        return variant_names()[index]

    def __len__(self) -> int:
        return len(variant_names())

    def __repr__(self) -> str:
        return repr(variant_names())

    def __eq__(self, other) -> bool:
        return tuple(self) == tuple(other) if isinstance(other, (tuple, list, _Names)) else NotImplemented


VARIANTS: Sequence[str] = _Names()
