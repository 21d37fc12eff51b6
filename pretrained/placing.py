"""Place a variant in any transformers model whose family routes attention through the AttentionInterface.

    model = transformers.AutoModel.from_pretrained(folder)
    place(model, "smal", layers=[0, 3])          # smal in layers 0 and 3, plain mha elsewhere
    model(**batch, self_state=s, trace=T)         # an ordinary transformers model: train it, save_pretrained it

What placing does, generically (no code per family):

1. switches the model to attnx's attention backend (:mod:`attnx.pretrained.backend`) and runs one
   tiny forward that records which modules call the attention interface, in order (layer i's
   attention is the i-th), with their heads, key/value heads, head size, scaling and causality;
2. attaches to each of them an attnx attention without projections (``module.attnx``): the
   variant's in the chosen layers (its own parameters, at their neutral values), plain ``mha``
   elsewhere, both with TransformerLens' hook points (``blocks.{i}.attn.hook_pattern`` ...);
3. finds the layer list (the ``ModuleList`` whose items hold those attentions, one each) and hooks
   its layers: ``blocks.{i}.hook_resid_pre|post``, a variant's fusion after the layer (metaphor's,
   applied to the layer's output), and appended layers after the last one (maw's own form);
4. records the placement in ``model.config.attnx``, so ``save_pretrained`` writes it and
   :func:`attnx.pretrained.load` rebuilds the same model from the saved folder.

Context inputs (smal's ``self_state``/``trace``, cultural, metaphor) go in through the model call
as keywords; hooks on the model take them out before the family's forward sees them.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from attnx.models.hooks import HookPoint
from attnx.models.attention import AttentionBase, without_projections
from attnx.models.signature import InputSpec
from attnx.models.spec import ExtraOutput, VariantSpec, get_spec
from attnx.pretrained import backend, forward


@dataclass
class Placement:
    """Where the variant goes: ``layers`` replaced (None = all), ``append`` layers after the last one."""

    variant: str = "mha"
    layers: tuple[int, ...] | None = None
    append: int = 0
    options: dict = field(default_factory=dict)  # the variant's own options (e.g. d_self)

    def replaced(self, n_layers: int) -> list[int]:
        if self.variant == "mha" and not self.layers:
            return []
        layers = list(range(n_layers)) if self.layers is None else sorted(set(self.layers))
        bad = [i for i in layers if not 0 <= i < n_layers]
        if bad:
            raise ValueError(f"layer {bad[0]} out of range: the model has {n_layers} layers (0..{n_layers - 1})")
        return layers

    def to_dict(self) -> dict:
        out = asdict(self)
        out["layers"] = None if self.layers is None else list(self.layers)
        return out

    @classmethod
    def from_dict(cls, d: dict | None) -> "Placement":
        d = dict(d or {})
        unknown = sorted(set(d) - {"variant", "layers", "append", "options"})
        if unknown:
            raise ValueError(f"placement: unknown key(s) {', '.join(unknown)}")
        if d.get("layers") is not None:
            d["layers"] = tuple(int(i) for i in d["layers"])
        return cls(**d)

    def check(self) -> VariantSpec:
        spec = get_spec(self.variant)
        if self.append < 0:
            raise ValueError(f"append must be >= 0, got {self.append}")
        if self.append and not spec.placement.append:
            raise ValueError(f"variant {self.variant!r} cannot be appended after the last layer; place it in layers")
        if self.layers and not spec.placement.replace:
            raise ValueError(f"variant {self.variant!r} cannot replace a pretrained attention; append it")
        return spec


def placement_for(variant: str, layers=None, append: int | None = None, options: dict | None = None) -> Placement:
    """The placement a user means: ``layers`` replaced (default: all, or none for a variant whose
    natural form is appended), ``append`` layers after the last one (default: 1 for such a variant)."""
    spec = get_spec(variant)
    appended_by_default = spec.placement.default == "append"
    if append is None:
        append = 1 if appended_by_default and layers is None else 0
    if layers is None and (appended_by_default or variant == "mha"):
        layers = ()
    return Placement(variant, None if layers is None else tuple(int(i) for i in layers), int(append),
                     dict(options or {}))


# --------------------------------------------------------------------------- what gets attached

class AppendedBlock(nn.Module):
    """``y = x + Attn(LN(x))``: a variant layer after the host's last layer; ``W_O`` starts at zero."""

    def __init__(self, spec: VariantSpec, attn: nn.Module, ln_eps: float):
        super().__init__()
        self.spec, self.attn, self.fusion = spec, attn, None
        self.ln = nn.LayerNorm(attn.config.d_model, eps=ln_eps)
        with torch.no_grad():
            attn.W_O.weight.zero_()
            attn.W_O.bias.zero_()
        self.hook_resid_pre, self.hook_attn_out, self.hook_resid_post = HookPoint(), HookPoint(), HookPoint()

    @property
    def variant(self) -> str:
        return self.spec.name

    @property
    def config(self):
        return self.attn.config

    def forward(self, x, attention_mask=None, head_mask=None, **context):
        x = self.hook_resid_pre(x)
        ctx = {k: context[k] for k in self.attn.context_names}
        return self.hook_resid_post(x + self.hook_attn_out(self.attn(self.ln(x), attention_mask, head_mask, **ctx)))


class LayerHooks(nn.Module):
    """Attached to each layer of the layer list as ``attnx_layer``: its hook points, the variant's
    fusion (applied to the layer's output) and, on the last layer, the appended layers."""

    def __init__(self, index: int, fusion: nn.Module | None = None, first: bool = False, last: bool = False):
        super().__init__()
        self.index = index
        self.first, self.last = first, last  # the first layer opens a forward's Call, the last one closes it
        self.hook_resid_pre, self.hook_resid_post = HookPoint(), HookPoint()
        self.fusion = fusion
        self.appended: nn.ModuleList | None = None


@dataclass
class PlacedBlock:
    """Layer i of a placed model as the rest of attnx sees a block: its attnx attention, spec, fusion."""

    attn: AttentionBase
    spec: VariantSpec
    fusion: nn.Module | None = None

    @property
    def config(self):
        return self.attn.config

    @property
    def variant(self) -> str:
        return self.spec.name


# --------------------------------------------------------------------------- placing

def text_config(model):
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def supports(model_or_class) -> bool:
    return bool(getattr(model_or_class, "_supports_attention_backend", False))


def unsupported_message(model_type: str, architecture: str) -> str:
    return (f"model_type {model_type!r} ({architecture}) does not route attention through transformers' "
            "AttentionInterface, so attnx cannot place a variant in it; attnx supports the families that do "
            "(BERT, RoBERTa, XLM-R, DistilBERT, ELECTRA, ModernBERT, GPT-2, Llama, Mistral, Qwen2/3, Gemma, "
            "Phi-3 and most others of transformers 5)")


def place(model, variant: str | Placement = "mha", *, layers=None, append: int | None = None,
          options: dict | None = None):
    """Place ``variant`` in ``model`` (a transformers ``PreTrainedModel``), in place; returns the model."""
    placement = variant if isinstance(variant, Placement) else placement_for(variant, layers, append, options)
    spec = placement.check()
    if not supports(model):
        raise ValueError(unsupported_message(str(getattr(model.config, "model_type", "?")), type(model).__name__))
    if getattr(model, "attnx_attention", None) is not None:
        raise ValueError("this model already has a placed variant; load it afresh to place another")
    name = backend.register(placement.variant)
    backend.register("mha")
    model.set_attn_implementation(name)
    probed = _probe(model)
    n_layers = len(probed)
    replaced = set(placement.replaced(n_layers))
    cfg = text_config(model)
    d_model = int(cfg.hidden_size)
    mha = get_spec("mha")
    names = {m: n for n, m in model.named_modules()}
    for i, call in enumerate(probed):
        layer_spec = spec if i in replaced else mha
        config = _attention_config(layer_spec, placement.options if i in replaced else {}, d_model=d_model,
                                   n_heads=call.n_heads, head_size=call.head_dim, is_causal=call.is_causal)
        with without_projections():
            core = layer_spec.attention(config)
        core.scale = float(call.scaling) if call.scaling is not None else 1.0 / math.sqrt(call.head_dim)
        core.softcap = call.softcap
        core.layer_index, core.variant = i, layer_spec.name
        core.kv_heads = call.n_kv_heads  # the host's key/value heads: what its KV cache holds per layer
        if i in replaced:
            make_neutral(spec, core, None)
        call.module.attnx = core
        call.module.register_forward_pre_hook(forward.attention_pre, with_kwargs=True)
    model.attnx_attention = [names[c.module] for c in probed]

    layer_list = _layer_list(model, [c.module for c in probed])
    needs_layers = placement.append or (spec.fusion is not None and replaced)
    if layer_list is None and needs_layers:
        raise ValueError(f"{type(model).__name__}: cannot find its layer list (a ModuleList holding one attention "
                         f"per item), which {spec.name}'s {'appended layers' if placement.append else 'fusion'} need")
    model.attnx_layers = None if layer_list is None else names[layer_list]
    if layer_list is not None:
        for i, layer in enumerate(layer_list):
            fusion = None
            if i in replaced and spec.fusion is not None:
                fusion = spec.fusion(_attention_config(spec, placement.options, d_model=d_model,
                                                       n_heads=probed[i].n_heads, head_size=probed[i].head_dim,
                                                       is_causal=probed[i].is_causal))
                make_neutral(spec, None, fusion)
            layer.attnx_layer = LayerHooks(i, fusion, first=i == 0, last=i == len(layer_list) - 1)
            layer.register_forward_pre_hook(forward.layer_pre, with_kwargs=True)
            layer.register_forward_hook(forward.layer_post, with_kwargs=True, always_call=True)
        if placement.append:
            eps = float(getattr(cfg, "layer_norm_eps", None) or getattr(cfg, "rms_norm_eps", None) or 1e-5)
            last = probed[-1]
            blocks = []
            for _ in range(placement.append):
                config = _attention_config(spec, placement.options, d_model=d_model, n_heads=last.n_heads,
                                           head_size=last.head_dim, is_causal=last.is_causal)
                blocks.append(AppendedBlock(spec, spec.attention(config), eps))
            layer_list[-1].attnx_layer.appended = nn.ModuleList(blocks)
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if isinstance(embeddings, nn.Module):  # TransformerLens' hook_embed: the token embeddings, any family
        embeddings.attnx_hook_embed = HookPoint()
        embeddings.register_forward_hook(forward.embeddings_post)
    _name_hooks(model)
    model.attnx_context = tuple(s.name for s in context_inputs(model))
    for m in _entry_modules(model):
        m.register_forward_pre_hook(forward.model_pre, with_kwargs=True)
        m.register_forward_hook(forward.model_post, with_kwargs=True, always_call=True)
    model.attnx_placement = placement
    model.config.attnx = {"placement": placement.to_dict()}
    return model


def make_neutral(spec: VariantSpec, attn: nn.Module | None, fusion: nn.Module | None) -> None:
    """Set a placed layer's new parameters to the values at which it equals plain attention."""
    if attn is not None and spec.placement.neutral is not None:
        spec.placement.neutral(attn)
    if fusion is not None and spec.placement.neutral_fusion is not None:
        spec.placement.neutral_fusion(fusion)


def _attention_config(spec: VariantSpec, options: dict, **host):
    """The variant's config for a host layer: the host's sizes, the user's options for the rest."""
    clash = sorted(set(options) & {"d_model", "n_heads", "head_size", "is_causal", "dropout", "qkv_bias"})
    if clash:
        raise ValueError(f"option(s) {', '.join(clash)} come from the model's config.json and cannot be set")
    return spec.make_config(dropout=0.0, qkv_bias=True, **host, **options)


def _probe(model) -> list[backend.ProbedCall]:
    """One forward on a few tokens, recording the attention calls (see the module doc)."""
    cfg = text_config(model)
    vocab = int(getattr(cfg, "vocab_size", 2) or 2)
    ids = (torch.arange(4) % max(1, vocab - 1))[None] + (1 if vocab > 2 else 0)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    kwargs = {"input_ids": ids.to(device), "attention_mask": torch.ones_like(ids).to(device)}
    if "use_cache" in inspect.signature(model.forward).parameters:
        kwargs["use_cache"] = False
    was_training = model.training
    model.eval()
    try:
        with backend.probing() as calls, torch.no_grad():
            model(**kwargs)
    finally:
        model.train(was_training)
    seen, unique = set(), []
    for call in calls:
        if id(call.module) not in seen:
            seen.add(id(call.module))
            unique.append(call)
    if not unique:
        raise ValueError(f"{type(model).__name__} made no call to the attention interface on a test input; "
                         "attnx cannot place a variant in it")
    return unique


def _layer_list(model, attentions: list[nn.Module]) -> nn.ModuleList | None:
    """The ModuleList whose i-th item holds the i-th attention (and no other)."""
    for module in model.modules():
        if not isinstance(module, nn.ModuleList) or len(module) != len(attentions):
            continue
        if all(sum(a is m for m in item.modules() for a in attentions) == 1 and
               any(m is attentions[i] for m in item.modules()) for i, item in enumerate(module)):
            return module
    return None


def _entry_modules(model) -> list[nn.Module]:
    """The model and its base model (a task model calls it; users may call it directly)."""
    out = [model]
    base = getattr(model, "base_model", None)
    if isinstance(base, nn.Module) and base is not model:
        out.append(base)
    return out


def _name_hooks(model) -> None:
    for module in model.modules():
        if isinstance(getattr(module, "attnx_hook_embed", None), HookPoint):
            module.attnx_hook_embed.name = "hook_embed"
    for i, block in enumerate(blocks(model)):
        prefix = f"blocks.{i}."
        for name, hp in block.attn.named_modules():
            if isinstance(hp, HookPoint):
                hp.name = f"{prefix}attn.{name}"
        if isinstance(block, AppendedBlock):
            for name in ("hook_resid_pre", "hook_attn_out", "hook_resid_post"):
                getattr(block, name).name = prefix + name
    for layer in layers(model) or []:
        for name in ("hook_resid_pre", "hook_resid_post"):
            getattr(layer.attnx_layer, name).name = f"blocks.{layer.attnx_layer.index}.{name}"


# --------------------------------------------------------------------------- reading a placed model

def placement_of(model) -> Placement | None:
    return getattr(model, "attnx_placement", None)


def layers(model) -> nn.ModuleList | None:
    name = getattr(model, "attnx_layers", None)
    return None if name is None else model.get_submodule(name)


def appended(model) -> list[AppendedBlock]:
    found = layers(model)
    extra = None if found is None else found[-1].attnx_layer.appended
    return [] if extra is None else list(extra)


def blocks(model) -> list:
    """Layer by layer (then the appended ones) as blocks: ``.attn``, ``.spec``, ``.fusion``, ``.config``."""
    found = layers(model)
    out = []
    for i, name in enumerate(model.attnx_attention):
        core = model.get_submodule(name).attnx
        fusion = None if found is None else found[i].attnx_layer.fusion
        out.append(PlacedBlock(core, get_spec(core.variant), fusion))
    return out + appended(model)


def context_inputs(model) -> list[InputSpec]:
    """The context inputs of every layer, each once (layers of one variant share its inputs)."""
    seen: dict[str, InputSpec] = {}
    for block in blocks(model):
        for spec in block.spec.context_inputs(block.config):
            if spec.name in seen and seen[spec.name] != spec:
                raise ValueError(f"layers disagree on the context input {spec.name}: {seen[spec.name]} vs {spec}")
            seen.setdefault(spec.name, spec)
    return list(seen.values())


def extra_outputs(model) -> list[tuple[ExtraOutput, int]]:
    found: dict[str, tuple[ExtraOutput, int]] = {}
    for i, block in enumerate(blocks(model)):
        for out in block.spec.extra_outputs:
            found[out.name] = (out, i)
    return list(found.values())


def variant_parameter_names(model) -> list[str]:
    """State-dict names of what placing added (the variants' parameters), in ``model``'s naming."""
    return sorted(n for n in model.state_dict() if any(f".{a}." in f".{n}" for a in ("attnx", "attnx_layer")))


def aux_loss(model) -> torch.Tensor | None:
    """Sum of the placed layers' auxiliary losses of the last training forward (maw's GRPO loss)."""
    losses = [b.attn.aux_loss for b in blocks(model) if getattr(b.attn, "aux_loss", None) is not None]
    return torch.stack(losses).sum() if losses else None
