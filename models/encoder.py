"""The pre-LN block and the encoder stack that export and serving use.

    h = x + Attn(LN1(x), mask, **context)
    y = h + FFN(LN2(h))
    y = Fusion(x, y, **context)                 # variants with a fusion only (after the FFN)
    out = LN_f(y_last)                          # final_norm=True

Each layer's variant is chosen by config (``layer_variants``); every layer of a variant shares
that variant's options, and everything variant-specific comes from its ``VariantSpec``.
Hook points per layer ``i``: ``blocks.{i}.hook_resid_pre``, ``blocks.{i}.hook_attn_out``,
``blocks.{i}.hook_mlp_out``, ``blocks.{i}.hook_resid_post`` ``[B, L, d_model]`` and the
attention's under ``blocks.{i}.attn.`` (:class:`attnx.models.attention.AttentionBase`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from attnx.contract import Role
from attnx.models.hooks import HookPoint, Hooked, name_hook_points
from attnx.models.signature import InputSpec, OutputSpec, check_choice, check_inputs
from attnx.models.spec import ExtraOutput, VariantSpec


class FeedForward(nn.Module):
    """Linear -> GELU -> Linear, ``mult`` x wide (or ``d_ff`` wide)."""

    def __init__(self, d_model: int, mult: int = 4, activation: str = "gelu", d_ff: int | None = None):
        super().__init__()
        check_choice("activation", activation, ("gelu", "gelu_tanh"))
        d_ff = d_ff or mult * d_model
        self.fc_in = nn.Linear(d_model, d_ff)
        self.fc_out = nn.Linear(d_ff, d_model)
        self.approximate = "tanh" if activation == "gelu_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(F.gelu(self.fc_in(x), approximate=self.approximate))


@dataclass
class EncoderConfig:
    n_layers: int = 2
    layer_variants: tuple | None = None  # one variant name per layer; default: all the main variant
    ffn_mult: int = 4
    activation: str = "gelu"  # gelu | gelu_tanh
    final_norm: bool = True
    ln_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.n_layers < 1:
            raise ValueError(f"n_layers must be >= 1, got {self.n_layers}")
        check_choice("activation", self.activation, ("gelu", "gelu_tanh"))
        if self.layer_variants is not None:
            self.layer_variants = tuple(self.layer_variants)
            if len(self.layer_variants) != self.n_layers:
                raise ValueError(f"layer_variants has {len(self.layer_variants)} entries for {self.n_layers} layers")


def _hidden_and_mask(d_model: int) -> list[InputSpec]:
    return [InputSpec("hidden_states", ("batch", "seq", d_model), "float", Role.HIDDEN_STATES),
            InputSpec("attention_mask", ("batch", "seq"), "mask", Role.ATTENTION_MASK)]


class Block(nn.Module):
    """One pre-LN transformer block around a variant's attention (and its fusion, if any)."""

    def __init__(self, spec: VariantSpec, attn: nn.Module, enc: EncoderConfig, fusion: nn.Module | None = None):
        super().__init__()
        d = attn.config.d_model
        self.spec = spec
        self.ln1 = nn.LayerNorm(d, eps=enc.ln_eps)
        self.attn = attn
        self.ln2 = nn.LayerNorm(d, eps=enc.ln_eps)
        self.mlp = FeedForward(d, enc.ffn_mult, enc.activation)
        self.fusion = fusion
        self.hook_resid_pre, self.hook_attn_out = HookPoint(), HookPoint()
        self.hook_mlp_out, self.hook_resid_post = HookPoint(), HookPoint()

    @property
    def variant(self) -> str:
        return self.spec.name

    @property
    def config(self):
        return self.attn.config

    def context_inputs(self) -> list[InputSpec]:
        return self.spec.context_inputs(self.config)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None,
                head_mask: torch.Tensor | None = None, **context) -> torch.Tensor:
        if not torch.compiler.is_exporting():  # a bare block (build_variant of a fused variant) meets ln1 first
            x_spec, mask_spec = _hidden_and_mask(self.config.d_model)
            check_inputs([dataclasses.replace(x_spec, name="x"), mask_spec], {"x": x, "attention_mask": attention_mask}, optional=("attention_mask",))
        x = self.hook_resid_pre(x)
        attn_ctx = {k: context[k] for k in self.attn.context_names}
        h = x + self.hook_attn_out(self.attn(self.ln1(x), attention_mask, head_mask, **attn_ctx))
        y = h + self.hook_mlp_out(self.mlp(self.ln2(h)))
        if self.fusion is not None:
            y = self.fusion(x, y, **{k: context[k] for k in self.fusion.context_names})
        return self.hook_resid_post(y)


class Encoder(Hooked, nn.Module):
    """A stack of blocks; ``forward(hidden_states, attention_mask, **context)``."""

    def __init__(self, variant: str, blocks: list[Block], enc: EncoderConfig, variant_configs: dict):
        super().__init__()
        self.variant = variant
        self.encoder_config = enc
        self.variant_configs = variant_configs  # name -> config dataclass
        self.blocks = nn.ModuleList(blocks)
        d = blocks[0].config.d_model
        self.d_model, self.n_heads = d, blocks[0].config.n_heads
        self.ln_f = nn.LayerNorm(d, eps=enc.ln_eps) if enc.final_norm else None
        name_hook_points(self)

    # ---- description -------------------------------------------------------------------------
    def context_inputs(self) -> list[InputSpec]:
        return context_inputs(self.blocks)

    def input_specs(self) -> list[InputSpec]:
        return _hidden_and_mask(self.d_model) + self.context_inputs()

    def extra_outputs(self) -> list[tuple[ExtraOutput, int]]:
        return extra_outputs(self.blocks)

    def output_specs(self) -> list[OutputSpec]:
        main = OutputSpec("output", ("batch", "seq", self.d_model), "float", Role.OUTPUT, "the last block's output")
        return [main] + [OutputSpec(out.name, out.shape, out.dtype, Role.AUX, out.doc) for out, _ in self.extra_outputs()]

    def output_names(self) -> list[str]:
        return [o.name for o in self.output_specs()]

    def config_dict(self) -> dict:
        """Everything needed to rebuild this encoder with :func:`attnx.models.build.encoder_from_config`."""
        return {"variant": self.variant, "encoder": dataclasses.asdict(self.encoder_config),
                "attention": {n: dataclasses.asdict(c) for n, c in self.variant_configs.items()}}

    def aux_loss(self) -> torch.Tensor | None:
        """Sum of the layers' auxiliary (e.g. GRPO) losses from the last training forward."""
        losses = [b.attn.aux_loss for b in self.blocks if getattr(b.attn, "aux_loss", None) is not None]
        return torch.stack(losses).sum() if losses else None

    # ---- forward -----------------------------------------------------------------------------
    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                head_mask: torch.Tensor | None = None, return_extras: bool = False, **context):
        """Output ``[B, L, d_model]``; with ``return_extras`` also ``{name: tensor}`` of the variants'
        extra outputs (e.g. the depth a layer chose)."""
        if not torch.compiler.is_exporting():
            check_inputs(self.input_specs(), {"hidden_states": hidden_states, "attention_mask": attention_mask,
                                              **context}, optional=("attention_mask",))
        head_mask = expand_head_mask(head_mask, len(self.blocks), self.n_heads)
        x = hidden_states
        for i, block in enumerate(self.blocks):
            x = block(x, attention_mask, None if head_mask is None else head_mask[i], **context)
        if self.ln_f is not None:
            x = self.ln_f(x)
        if not return_extras:
            return x
        return x, read_extras(self.blocks, self.extra_outputs())


    def forward_named(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The export/serving signature: inputs and outputs by name (:meth:`input_specs`, :meth:`output_specs`)."""
        context = {k: v for k, v in inputs.items() if k not in ("hidden_states", "attention_mask", "head_mask")}
        extras = bool(self.extra_outputs())
        result = self(inputs["hidden_states"], inputs.get("attention_mask"), head_mask=inputs.get("head_mask"),
                      return_extras=extras, **context)
        out, found = (result if extras else (result, {}))
        return {"output": out, **found}


def context_inputs(blocks) -> list[InputSpec]:
    """The context inputs of every layer, each once (layers of one variant share its inputs)."""
    seen: dict[str, InputSpec] = {}
    for block in blocks:
        for spec in block.spec.context_inputs(block.config):
            if spec.name in seen and seen[spec.name] != spec:
                raise ValueError(f"layers disagree on the context input {spec.name}: {seen[spec.name]} vs {spec}")
            seen.setdefault(spec.name, spec)
    return list(seen.values())


def extra_outputs(blocks) -> list[tuple[ExtraOutput, int]]:
    """Each extra output of the variants used, with the index of the last layer that gives it."""
    found: dict[str, tuple[ExtraOutput, int]] = {}
    for i, block in enumerate(blocks):
        for out in block.spec.extra_outputs:
            found[out.name] = (out, i)
    return list(found.values())


def expand_head_mask(head_mask: torch.Tensor | None, n_layers: int, n_heads: int) -> torch.Tensor | None:
    """``[H]`` or ``[n_layers, H]`` -> ``[n_layers, H]`` (one clear error otherwise)."""
    if head_mask is None:
        return None
    given = list(head_mask.shape)
    if head_mask.dim() == 1:
        head_mask = head_mask.expand(n_layers, -1)
    if tuple(head_mask.shape) != (n_layers, n_heads):
        raise ValueError(f"head_mask: expected shape [n_layers={n_layers}, H={n_heads}] or [H={n_heads}], got {given}")
    return head_mask


def read_extras(blocks, extras: list[tuple[ExtraOutput, int]]) -> dict[str, torch.Tensor]:
    """The extra outputs after a forward, read from the layers that give them."""
    return {spec.name: spec.read(blocks[index].attn) for spec, index in extras}
