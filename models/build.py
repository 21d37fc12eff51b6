"""Builders: a variant's attention module, an encoder stack, an encoder rebuilt from a file's config.

Weights are reproducible from ``seed`` (construction runs under a fixed seed without disturbing
the caller's RNG). Everything variant-specific comes from the registry (:mod:`attnx.models.spec`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import fields
from typing import Any

import torch
from torch import nn

from attnx.models.encoder import Block, Encoder, EncoderConfig
from attnx.models.spec import get_spec, variant_names

ENCODER_OPTIONS = tuple(f.name for f in fields(EncoderConfig))


def variant_options(name: str) -> dict[str, Any]:
    """Option name -> default for one variant's attention config."""
    return get_spec(name).options()


def make_config(name: str, **options):
    """A variant's config dataclass; unknown options are an error listing the valid ones."""
    return get_spec(name).make_config(**options)


@contextlib.contextmanager
def seeded(seed: int | None):
    """Construction under a fixed seed, without disturbing the caller's RNG state."""
    with torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)
        yield


def make_block(name: str, config, enc: EncoderConfig) -> Block:
    spec = get_spec(name)
    fusion = spec.fusion(config) if spec.fusion is not None else None
    return Block(spec, spec.attention(config), enc, fusion)


def build_variant(name: str, *, seed: int | None = 0, ffn_mult: int = 4, **options) -> nn.Module:
    """One variant's module, ``forward(x, attention_mask=None, **context)``: its attention, or a
    whole pre-LN block when the variant acts after the FFN (it has a fusion)."""
    spec = get_spec(name)
    config = spec.make_config(**options)
    with seeded(seed):
        if spec.fusion is not None:
            return make_block(name, config, EncoderConfig(n_layers=1, ffn_mult=ffn_mult))
        return spec.attention(config)


def build_encoder(variant: str, *, seed: int | None = 0, **options) -> Encoder:
    """The encoder stack; options are the encoder's (``n_layers``, ``layer_variants``, ...)
    plus those of every variant used. Weights are reproducible from ``seed``."""
    get_spec(variant)
    enc_opts = {k: options.pop(k) for k in list(options) if k in ENCODER_OPTIONS}
    enc = EncoderConfig(**enc_opts)
    layer_variants = list(enc.layer_variants or [variant] * enc.n_layers)
    used = list(dict.fromkeys(layer_variants))
    known = set().union(*(variant_options(n) for n in used))
    unknown = sorted(set(options) - known)
    if unknown:
        valid = sorted(known | set(ENCODER_OPTIONS))
        raise ValueError(f"unknown option(s) {', '.join(unknown)} for an encoder of {', '.join(used)}; "
                         f"valid options: {', '.join(valid)}")
    configs = {n: make_config(n, **{k: v for k, v in options.items() if k in variant_options(n)}) for n in used}
    with seeded(seed):
        blocks = [make_block(name, configs[name], enc) for name in layer_variants]
        model = Encoder(variant, blocks, enc, configs)
    return model.eval()


def encoder_from_config(config: dict, *, seed: int | None = 0) -> Encoder:
    """Rebuild an encoder from :meth:`Encoder.config_dict` (e.g. read from ONNX metadata)."""
    enc = dict(config["encoder"])
    options: dict[str, Any] = {}
    for name, attn in config["attention"].items():
        valid = variant_options(name)
        options.update({k: v for k, v in attn.items() if k in valid})  # options an older attnx wrote are dropped
    return build_encoder(config["variant"], seed=seed, **enc, **options)


def describe_variants() -> list[dict]:
    """For ``attnx variants``: each variant's options (with defaults), context inputs and outputs."""
    out = []
    for name in variant_names():
        spec = get_spec(name)
        cfg = spec.make_config()
        ctx = [{"name": s.name, "shape": list(s.shape), "dtype": s.dtype, "doc": s.doc}
               for s in spec.context_inputs(cfg)]
        out.append({"name": name, "summary": spec.summary, "options": dataclasses.asdict(cfg), "context": ctx,
                    "outputs": ["output"] + [o.name for o in spec.extra_outputs],
                    "custom_ops": [op.name for op in spec.custom_ops if op.torch_op is not None],
                    "kv_cache": spec.cache_summary()})
    return out
