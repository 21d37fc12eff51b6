"""The pre-LN block and the encoder stack that export and serving use.

    h = x + Attn(LN1(x), mask, **context)
    y = h + FFN(LN2(h))
    y = MetaphorFusion(x, y, metaphor)          # metaphor layers only (after the FFN)
    out = LN_f(y_last)                          # final_norm=True

Each layer's variant is chosen by config (``layer_variants``); every layer of a
variant shares that variant's options. Hook points per layer ``i``:
``blocks.{i}.hook_resid_pre``, ``blocks.{i}.hook_attn_out``, ``blocks.{i}.hook_mlp_out``,
``blocks.{i}.hook_resid_post`` ``[B, L, d_model]`` and the attention's hooks under
``blocks.{i}.attn.`` (see :class:`attnx.models.common.AttentionBase`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from attnx.models.common import FeedForward, HookPoint, InputSpec, check_choice, check_inputs
from attnx.models.metaphor import MetaphorFusion


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


class Block(nn.Module):
    """One pre-LN transformer block around a variant's attention."""

    def __init__(self, variant: str, attn: nn.Module, enc: EncoderConfig, fusion: MetaphorFusion | None = None):
        super().__init__()
        d = attn.config.d_model
        self.variant = variant
        self.ln1 = nn.LayerNorm(d, eps=enc.ln_eps)
        self.attn = attn
        self.ln2 = nn.LayerNorm(d, eps=enc.ln_eps)
        self.mlp = FeedForward(d, enc.ffn_mult, enc.activation)
        self.fusion = fusion
        self.hook_resid_pre, self.hook_attn_out = HookPoint(), HookPoint()
        self.hook_mlp_out, self.hook_resid_post = HookPoint(), HookPoint()

    @property
    def config(self):
        return self.attn.config

    def context_specs(self) -> list[InputSpec]:
        specs = self.attn.context_specs()
        return specs + (self.fusion.context_specs() if self.fusion is not None else [])

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None,
                head_mask: torch.Tensor | None = None, **context) -> torch.Tensor:
        if not torch.compiler.is_exporting():  # a bare block (build_variant("metaphor")) meets ln1 first
            d = self.config.d_model
            check_inputs([InputSpec("x", ("batch", "seq", d), "float", "hidden_states"),
                          InputSpec("attention_mask", ("batch", "seq"), "mask", "attention_mask")],
                         {"x": x, "attention_mask": attention_mask}, optional=("attention_mask",))
        x = self.hook_resid_pre(x)
        attn_ctx = {k: context[k] for k in self.attn.context_names}
        h = x + self.hook_attn_out(self.attn(self.ln1(x), attention_mask, head_mask, **attn_ctx))
        y = h + self.hook_mlp_out(self.mlp(self.ln2(h)))
        if self.fusion is not None:
            y = self.fusion(x, y, context["metaphor"])
        return self.hook_resid_post(y)


class Encoder(nn.Module):
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
        for name, module in self.named_modules():
            if isinstance(module, HookPoint):
                module.name = name

    # ---- description -------------------------------------------------------------------------
    def context_inputs(self) -> list[InputSpec]:
        seen: dict[str, InputSpec] = {}
        for block in self.blocks:
            for spec in block.context_specs():
                if spec.name in seen and seen[spec.name] != spec:
                    raise ValueError(f"layers disagree on the context input {spec.name}: {seen[spec.name]} vs {spec}")
                seen.setdefault(spec.name, spec)
        return list(seen.values())

    def input_specs(self) -> list[InputSpec]:
        return [InputSpec("hidden_states", ("batch", "seq", self.d_model), "float", "hidden_states"),
                InputSpec("attention_mask", ("batch", "seq"), "mask", "attention_mask")] + self.context_inputs()

    def config_dict(self) -> dict:
        """Everything needed to rebuild this encoder with :func:`attnx.models.registry.encoder_from_config`."""
        return {"variant": self.variant, "encoder": dataclasses.asdict(self.encoder_config),
                "attention": {n: dataclasses.asdict(c) for n, c in self.variant_configs.items()}}

    @property
    def has_maw(self) -> bool:
        return any(b.variant == "maw" for b in self.blocks)

    def aux_loss(self) -> torch.Tensor | None:
        """Sum of the layers' auxiliary (GRPO) losses from the last training forward."""
        losses = [b.attn.aux_loss for b in self.blocks if getattr(b.attn, "aux_loss", None) is not None]
        return torch.stack(losses).sum() if losses else None

    # ---- interpretability (see attnx.models.hooks) ------------------------------------------
    def run_with_cache(self, *args, **kwargs):
        from attnx.models.hooks import run_with_cache

        return run_with_cache(self, *args, **kwargs)

    def run_with_hooks(self, *args, fwd_hooks=(), **kwargs):
        from attnx.models.hooks import run_with_hooks

        return run_with_hooks(self, *args, fwd_hooks=fwd_hooks, **kwargs)

    # ---- forward -----------------------------------------------------------------------------
    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                head_mask: torch.Tensor | None = None, return_depth: bool = False, **context):
        if not torch.compiler.is_exporting():
            check_inputs(self.input_specs(), {"hidden_states": hidden_states, "attention_mask": attention_mask,
                                              **context}, optional=("attention_mask",))
        if head_mask is not None:
            n, h = len(self.blocks), self.n_heads
            given = list(head_mask.shape)
            if head_mask.dim() == 1:
                head_mask = head_mask.expand(n, -1)
            if head_mask.shape != (n, h):
                raise ValueError(f"head_mask: expected shape [n_layers={n}, H={h}] or [H={h}], got {given}")
        x = hidden_states
        for i, block in enumerate(self.blocks):
            x = block(x, attention_mask, None if head_mask is None else head_mask[i], **context)
        if self.ln_f is not None:
            x = self.ln_f(x)
        if not return_depth:
            return x
        maw_blocks = [b for b in self.blocks if b.variant == "maw"]
        if not maw_blocks:
            raise ValueError("return_depth=True needs a maw layer")
        return x, maw_blocks[-1].attn.last_depth
