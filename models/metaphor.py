"""``metaphor``: the Metaphor-Aware gated fusion applied after a block's FFN (seed 001).

    y_base = Block(x)                       # the pre-LN block's output, [B, L, D]
    m'  = m W_M                             # [B, L, D] (per-sequence m broadcast over L)
    r_i = tanh(W_r [x_i ; m'_i])            # x: the block input
    g_i = sigmoid(W_g [y_base_i ; r_i] + b_g)   # D wide; b_g is W_g's own bias (init +4)
    y_i = g_i * y_base_i + (1 - g_i) * f_m(r_i)  # f_m: Linear -> GELU -> Linear
    y   = LayerNorm(y) if post_norm

``metaphor`` m is ``[B, d_m]`` (``metaphor_input="sequence"``), ``[B, L, d_m]``
(``"token"``), or integer type ids ``[B]`` (``"type"``) / ``[B, L]``
(``"token_type"``) looked up in a learned table of ``n_metaphor_types`` rows.

At init W_g's weight is 0 and its bias +4, so ``g = sigmoid(4)`` everywhere and
``|y - y_base| <= (1 - sigmoid(4)) * |f_m(r) - y_base|`` elementwise (1.8%).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from attnx.models.attention import AttentionConfig
from attnx.models.signature import InputSpec, check_choice, check_tensor
from attnx.models.mha import MultiHeadAttention
from attnx.models.spec import Placement, VariantSpec, register

GATE_BIAS_INIT = 4.0
METAPHOR_INPUTS = ("sequence", "token", "type", "token_type")


@dataclass
class MetaphorConfig(AttentionConfig):
    d_metaphor: int = 32
    metaphor_input: str = "sequence"  # sequence | token | type | token_type
    n_metaphor_types: int = 16
    post_norm: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("metaphor_input", self.metaphor_input, METAPHOR_INPUTS)
        if self.d_metaphor <= 0 or self.n_metaphor_types <= 0:
            raise ValueError("d_metaphor and n_metaphor_types must be positive")


def metaphor_spec(config: MetaphorConfig) -> InputSpec:
    mode = config.metaphor_input
    shape = {"sequence": ("batch", config.d_metaphor), "token": ("batch", "seq", config.d_metaphor),
             "type": ("batch",), "token_type": ("batch", "seq")}[mode]
    ids = mode in ("type", "token_type")
    return InputSpec("metaphor", shape, "int64" if ids else "float", "context", f"metaphor input ({mode})",
                     range=(0, config.n_metaphor_types) if ids else None, default="zeros")


class MetaphorFusion(nn.Module):
    """The gated fusion of a block's output with metaphor features (see module docstring)."""

    def __init__(self, config: MetaphorConfig):
        super().__init__()
        self.config = config
        d, dm = config.d_model, config.d_metaphor
        if config.metaphor_input in ("type", "token_type"):
            self.type_embedding = nn.Embedding(config.n_metaphor_types, dm)
        self.W_M = nn.Linear(dm, d, bias=False)
        self.W_r = nn.Linear(2 * d, d)
        self.W_g = nn.Linear(2 * d, d)
        nn.init.zeros_(self.W_g.weight)
        nn.init.constant_(self.W_g.bias, GATE_BIAS_INIT)
        self.f_m = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, d))
        self.post_norm = nn.LayerNorm(d) if config.post_norm else None

    context_names = ("metaphor",)

    @staticmethod
    def context_inputs(config: MetaphorConfig) -> list[InputSpec]:
        return [metaphor_spec(config)]

    def features(self, metaphor: torch.Tensor, length: int | None) -> torch.Tensor:
        """m' as ``[B, L, D]`` (``length`` None: a per-sequence input stays ``[B, D]``)."""
        if self.config.metaphor_input in ("type", "token_type"):
            metaphor = self.type_embedding(metaphor)
        m_proj = self.W_M(metaphor)
        if m_proj.dim() == 2 and length is not None:  # per sequence -> every token
            m_proj = m_proj[:, None, :].expand(-1, length, -1)
        return m_proj

    def forward(self, x: torch.Tensor, y_base: torch.Tensor, *, metaphor: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_exporting():
            check_tensor(metaphor_spec(self.config), metaphor, {"batch": x.shape[0], "seq": x.shape[1]})
        # W [a ; b] = W_a a + W_b b, computed as the two products: m' W_r's half is then one row per sequence
        # (not per token), nothing [B, L, 2D] is written, and r's two readers (W_g's half, f_m's first
        # layer) share one GEMM in the export (attnx.export.fuse). 5 D^2 per token instead of 6 D^2 and two
        # concatenations: 1.41x -> 1.24x mha on ONNX Runtime at 2x1024 (benchmarks/bench_default_export.py), the
        # rest being the arithmetic itself.
        d = x.shape[-1]
        w_r, w_g = self.W_r.weight, self.W_g.weight
        m_term = F.linear(self.features(metaphor, None), w_r[:, d:], self.W_r.bias)  # [B, D] or [B, L, D]
        r = torch.tanh(F.linear(x, w_r[:, :d]) + (m_term[:, None] if m_term.dim() == 2 else m_term))  # [B, L, D]
        g = torch.sigmoid(F.linear(y_base, w_g[:, :d]) + F.linear(r, w_g[:, d:], self.W_g.bias))  # [B, L, D]
        y = g * y_base + (1.0 - g) * self.f_m(r)  # not f + g (y_base - f): a closed gate must give y_base exactly
        return self.post_norm(y) if self.post_norm is not None else y


#: A gate bias at which sigmoid rounds to exactly 1 in fp32 and fp16 (the gate closed onto y_base).
GATE_CLOSED = 30.0


def _neutral(attn: MultiHeadAttention) -> None:
    """Nothing to do in the attention: the fusion's gate is closed by ``neutral_fusion``."""


def neutral_fusion(fusion: MetaphorFusion) -> None:
    """Gate closed onto the base path: ``y = y_base`` exactly (without ``post_norm``)."""
    with torch.no_grad():
        fusion.W_g.weight.zero_()
        fusion.W_g.bias.fill_(GATE_CLOSED)


SPEC = register(VariantSpec(
    name="metaphor",
    summary="metaphor-aware gated fusion after each block's FFN",
    config=MetaphorConfig,
    attention=MultiHeadAttention,
    fusion=MetaphorFusion,
    placement=Placement(neutral=_neutral, neutral_fusion=neutral_fusion),
))
