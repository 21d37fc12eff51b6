"""What every pretrained host shares: placing a variant in it, appended layers, the export signature.

A *host* is a real model rebuilt from attnx pieces (``bert.py``, ``gpt2.py``) whose blocks hold
attnx attention modules: plain ``mha`` where the pretrained attention stays, the chosen variant
where it is placed (:class:`Placement`). A placed variant takes over the pretrained Q/K/V/O (every
attention has ``W_Q``/``W_K``/``W_V``/``W_O``) and starts at its spec's neutral values, so the host
computes exactly the original model until the variant's own parameters are trained (or loaded with
:meth:`Host.load_variant_checkpoint`). Appended layers (MAW's own form) are residual branches after
the last block whose output projection starts at zero.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from attnx.interp.hooks import HookPoint, Hooked
from attnx.models.encoder import context_inputs, expand_head_mask, extra_outputs, read_extras
from attnx.models.signature import InputSpec
from attnx.models.spec import ExtraOutput, VariantSpec, get_spec


@dataclass
class Placement:
    """Where the variant goes: ``layers`` replaced (None = all), ``append`` layers after the last block."""

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
        if d.get("layers") is not None:
            d["layers"] = tuple(int(i) for i in d["layers"])
        return cls(**d)

    def check(self) -> VariantSpec:
        spec = get_spec(self.variant)
        if self.append < 0:
            raise ValueError(f"append must be >= 0, got {self.append}")
        if self.append and not spec.placement.append:
            raise ValueError(f"variant {self.variant!r} cannot be appended after the encoder; place it in layers")
        if self.layers and not spec.placement.replace:
            raise ValueError(f"variant {self.variant!r} cannot replace a pretrained attention; append it")
        return spec


def attention_config(spec: VariantSpec, d_model: int, n_heads: int, options: dict, **shared):
    """The variant's config for a host layer: the host's sizes, the user's options for the rest."""
    clash = sorted(set(options) & {"d_model", "n_heads", *shared})
    if clash:
        raise ValueError(f"option(s) {', '.join(clash)} come from the pretrained model's config.json and cannot be set")
    return spec.make_config(d_model=d_model, n_heads=n_heads, dropout=0.0, qkv_bias=True, **shared, **options)


def make_neutral(spec: VariantSpec, attn: nn.Module, fusion: nn.Module | None) -> None:
    """Set a placed layer's new parameters to the values at which it equals plain attention."""
    if spec.placement.neutral is not None:
        spec.placement.neutral(attn)
    if fusion is not None and spec.placement.neutral_fusion is not None:
        spec.placement.neutral_fusion(fusion)


class AppendedBlock(nn.Module):
    """``y = x + Attn(LN(x))``: a variant layer after the host's last block; ``W_O`` starts at zero."""

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


class Host(Hooked, nn.Module):
    """Base of the pretrained hosts: ``blocks`` (pretrained layers, then appended ones), the export signature."""

    kind = ""  # "bert" | "gpt2"

    def __init__(self, hf_config: dict, placement: Placement, source: str | None):
        super().__init__()
        self.hf_config = hf_config
        self.placement = placement
        self.source = source
        self.pretrained_names: set[str] = set()  # state_dict keys that came from the checkpoint

    # ---- what the subclasses provide ---------------------------------------------------------
    def base_input_specs(self) -> list[InputSpec]:
        raise NotImplementedError

    def base_output_specs(self) -> list:
        raise NotImplementedError

    def run(self, inputs: dict[str, torch.Tensor], head_mask, context) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    # ---- the signature -----------------------------------------------------------------------
    @property
    def variant(self) -> str:
        return self.placement.variant

    @property
    def max_seq(self) -> int:
        """The longest sequence the model takes (its position embeddings)."""
        raise NotImplementedError

    @property
    def n_heads(self) -> int:
        return self.blocks[0].config.n_heads

    def context_inputs(self) -> list[InputSpec]:
        return context_inputs(self.blocks)

    def input_specs(self) -> list[InputSpec]:
        return self.base_input_specs() + self.context_inputs()

    def extra_outputs(self) -> list[tuple[ExtraOutput, int]]:
        return extra_outputs(self.blocks)

    def output_specs(self) -> list:
        from attnx.contract import Role
        from attnx.models.signature import OutputSpec

        extras = [OutputSpec(o.name, o.shape, o.dtype, Role.AUX, o.doc) for o, _ in self.extra_outputs()]
        return self.base_output_specs() + extras

    def output_names(self) -> list[str]:
        return [o.name for o in self.output_specs()]

    def config_dict(self) -> dict:
        return {"kind": "pretrained", "host": self.kind, "hf_config": self.hf_config,
                "placement": self.placement.to_dict(), "source": self.source}

    def forward_named(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        base = {s.name for s in self.base_input_specs()} | {"head_mask"}
        context = {k: v for k, v in inputs.items() if k not in base}
        head_mask = expand_head_mask(inputs.get("head_mask"), len(self.blocks), self.n_heads)
        out = self.run(inputs, head_mask, context)
        out.update(read_extras(self.blocks, self.extra_outputs()))
        return out

    # ---- variant parameters --------------------------------------------------------------------
    def variant_parameter_names(self) -> list[str]:
        return sorted(set(self.state_dict()) - self.pretrained_names)

    def load_variant_checkpoint(self, path: str | Path) -> None:
        """Load the placed variant's trained parameters (and, optionally, fine-tuned pretrained ones);
        strict: every variant parameter must be there, nothing unknown may be."""
        from attnx.export.checkpoint import read_checkpoint

        state = read_checkpoint(self, path, required=self.variant_parameter_names(),
                                what=f"{self.variant} placement")
        self.load_state_dict(state, strict=False)

    def metadata_extra(self) -> dict[str, Any]:
        return {}
