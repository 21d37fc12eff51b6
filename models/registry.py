"""The variant registry: names -> (config dataclass, attention module), seeded builders."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn

from attnx.models.cultural import CulturalAttention, CulturalConfig
from attnx.models.encoder import Block, Encoder, EncoderConfig
from attnx.models.maw import MawAttention, MawConfig
from attnx.models.metaphor import MetaphorConfig, MetaphorFusion
from attnx.models.mha import MhaConfig, MultiHeadAttention
from attnx.models.smal import SelfModulatedAttention, SmalConfig


@dataclass(frozen=True)
class Variant:
    name: str
    config_cls: type
    attention_cls: type
    summary: str


_VARIANTS = {
    "mha": Variant("mha", MhaConfig, MultiHeadAttention,
                   "multi-head attention with hooks, head interventions and activation patching"),
    "cultural": Variant("cultural", CulturalConfig, CulturalAttention,
                        "cultural-context key bias and gated fusion"),
    "metaphor": Variant("metaphor", MetaphorConfig, MultiHeadAttention,
                        "metaphor-aware gated fusion after each block's FFN"),
    "maw": Variant("maw", MawConfig, MawAttention,
                   "5-D multi-perspective attention, GRPO depth selection, argmax at inference"),
    "smal": Variant("smal", SmalConfig, SelfModulatedAttention,
                    "self-modulated attention with a trace-tensor distance"),
}
VARIANTS: tuple[str, ...] = tuple(_VARIANTS)
ENCODER_OPTIONS = tuple(f.name for f in fields(EncoderConfig))


def get_variant(name: str) -> Variant:
    if name not in _VARIANTS:
        raise ValueError(f"unknown variant {name!r}; valid variants: {', '.join(VARIANTS)}")
    return _VARIANTS[name]


def variant_options(name: str) -> dict[str, Any]:
    """Option name -> default for one variant's attention config."""
    return {f.name: f.default for f in fields(get_variant(name).config_cls)}


def make_config(name: str, **options):
    """A variant's config dataclass; unknown options are an error listing the valid ones."""
    valid = variant_options(name)
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(f"unknown option(s) {', '.join(unknown)} for variant {name!r}; "
                         f"valid options: {', '.join(valid)}")
    return get_variant(name).config_cls(**options)


def _seeded(seed: int | None):
    # Construction under a fixed seed, without disturbing the caller's RNG state.
    class _Ctx:
        def __enter__(self):
            self._fork = torch.random.fork_rng(devices=[])
            self._fork.__enter__()
            if seed is not None:
                torch.manual_seed(seed)

        def __exit__(self, *exc):
            return self._fork.__exit__(*exc)

    return _Ctx()


def _attention(name: str, config) -> nn.Module:
    return get_variant(name).attention_cls(config)


def build_variant(name: str, *, seed: int | None = 0, ffn_mult: int = 4, **options) -> nn.Module:
    """One variant's attention module, ``forward(x, attention_mask=None, **context)``.

    ``metaphor`` acts after a block's FFN, so its module is a whole pre-LN block with
    the fusion (same signature).
    """
    config = make_config(name, **options)
    with _seeded(seed):
        if name == "metaphor":
            return Block(name, MultiHeadAttention(config), EncoderConfig(n_layers=1, ffn_mult=ffn_mult),
                         MetaphorFusion(config))
        return _attention(name, config)


def build_encoder(variant: str, *, seed: int | None = 0, **options) -> Encoder:
    """The encoder stack; options are the encoder's (``n_layers``, ``layer_variants``, ...)
    plus those of every variant used. Weights are reproducible from ``seed``."""
    get_variant(variant)
    enc_opts = {k: options.pop(k) for k in list(options) if k in ENCODER_OPTIONS}
    enc = EncoderConfig(**enc_opts)
    layer_variants = list(enc.layer_variants or [variant] * enc.n_layers)
    used = list(dict.fromkeys(layer_variants))
    for name in used:
        get_variant(name)
    known = set().union(*(variant_options(n) for n in used))
    unknown = sorted(set(options) - known)
    if unknown:
        valid = sorted(known | set(ENCODER_OPTIONS))
        raise ValueError(f"unknown option(s) {', '.join(unknown)} for an encoder of {', '.join(used)}; "
                         f"valid options: {', '.join(valid)}")
    configs = {n: make_config(n, **{k: v for k, v in options.items() if k in variant_options(n)}) for n in used}
    with _seeded(seed):
        blocks = []
        for name in layer_variants:
            cfg = configs[name]
            blocks.append(Block(name, _attention(name, cfg), enc, MetaphorFusion(cfg) if name == "metaphor" else None))
        model = Encoder(variant, blocks, enc, configs)
    return model.eval()


def encoder_from_config(config: dict, *, seed: int | None = 0) -> Encoder:
    """Rebuild an encoder from :meth:`Encoder.config_dict` (e.g. read from ONNX metadata)."""
    enc = dict(config["encoder"])
    options: dict[str, Any] = {}
    for attn in config["attention"].values():
        options.update(attn)
    return build_encoder(config["variant"], seed=seed, **enc, **options)


def describe_variants() -> list[dict]:
    """For ``attnx variants``: each variant's options (with defaults) and context inputs."""
    out = []
    for name, v in _VARIANTS.items():
        cfg = make_config(name)
        ctx = []
        for spec in build_encoder(name, n_layers=1, seed=None).context_inputs():
            ctx.append({"name": spec.name, "shape": list(spec.shape), "dtype": spec.dtype, "doc": spec.doc})
        out.append({"name": name, "summary": v.summary, "options": dataclasses.asdict(cfg), "context": ctx,
                    "outputs": ["output"] + (["maw_depth"] if name == "maw" else [])})
    return out
