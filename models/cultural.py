"""``cultural``: Cultural Attention, additive cultural bias and gated fusion (seed 000).

Inputs: ``cultural`` c ``[B, d_c]``; ``c' = c W_C`` reshaped to ``[B, H, Dh]``;
``lambda`` a learned scalar (init 0) or, with ``lambda_mode="mlp"``, an MLP of c
giving ``[B, H]`` (last layer zero-initialised, so also 0 at init).

- ``bias_mode="key"`` (default): ``B_ij = lambda (K_j . c') / sqrt(Dh)``, a per-key
  bias toward culturally relevant tokens (the seed's stated intent).
- ``bias_mode="query"``: the seed's literal ``B_ij = lambda (Q_i . c')``. It is
  constant across keys j, so softmax over j removes it: this mode computes
  exactly ``mha`` with the same weights, whatever lambda is. It is kept for
  faithfulness; the ONNX exporter emits no nodes for it.
- ``fusion="gated"``: ``g_i = sigmoid(W_g [Q_i ; c'] + b_g)`` per head, Dh wide;
  ``z_i = g_i * z_i_att + (1 - g_i) * C_f(c)`` with ``C_f`` an MLP ``d_c -> H*Dh``.

At init (lambda = 0; W_g = 0, b_g = +4) the additive path equals ``mha``
exactly and the gated path is ``z = sigmoid(4) z_att + (1 - sigmoid(4)) C_f(c)``,
so ``|out - out_mha| <= (1 - sigmoid(4)) * |(z_att - C_f(c)) W_O|`` (1.8%).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from attnx.models.attention import AttentionBase, AttentionConfig, Mask
from attnx.models.signature import InputSpec, check_choice
from attnx.models.spec import Placement, VariantSpec, register

GATE_BIAS_INIT = 4.0


@dataclass
class CulturalConfig(AttentionConfig):
    d_cultural: int = 32
    bias_mode: str = "key"  # key | query
    lambda_mode: str = "scalar"  # scalar | mlp
    fusion: str = "additive"  # additive | gated

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("bias_mode", self.bias_mode, ("key", "query"))
        check_choice("lambda_mode", self.lambda_mode, ("scalar", "mlp"))
        check_choice("fusion", self.fusion, ("additive", "gated"))
        if self.d_cultural <= 0:
            raise ValueError(f"d_cultural must be positive, got {self.d_cultural}")


class CulturalAttention(AttentionBase):
    def __init__(self, config: CulturalConfig):
        super().__init__(config)
        h, dh, dc = config.n_heads, config.head_dim, config.d_cultural
        self.W_C = nn.Linear(dc, h * dh, bias=False)
        if config.lambda_mode == "scalar":
            self.lam = nn.Parameter(torch.zeros(()))
        else:
            self.lam_mlp = nn.Sequential(nn.Linear(dc, dc), nn.GELU(), nn.Linear(dc, h))
            nn.init.zeros_(self.lam_mlp[2].weight)
            nn.init.zeros_(self.lam_mlp[2].bias)
        if config.fusion == "gated":
            # Per-head gate over [Q_i ; c'_h] (2 Dh -> Dh); zero weights + bias 4 = near-identity start.
            self.W_g = nn.Parameter(torch.zeros(h, 2 * dh, dh))
            self.b_g = nn.Parameter(torch.full((h, dh), GATE_BIAS_INIT))
            self.C_f = nn.Sequential(nn.Linear(dc, h * dh), nn.GELU(), nn.Linear(h * dh, h * dh))

    @staticmethod
    def context_inputs(config: CulturalConfig) -> list[InputSpec]:
        return [InputSpec("cultural", ("batch", config.d_cultural), "float", "context",
                          "cultural context vector per example", default="zeros")]

    def lambda_(self, c: torch.Tensor) -> torch.Tensor:
        """``[B, H, 1, 1]`` (broadcastable) cultural strength."""
        if self.config.lambda_mode == "scalar":
            return self.lam.view(1, 1, 1, 1)
        return self.lam_mlp(c)[:, :, None, None]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask, *,
               cultural: torch.Tensor) -> torch.Tensor:
        b, h, l, dh = q.shape
        c_proj = self.W_C(cultural).view(b, h, dh, 1)  # c' per head, [B, H, Dh, 1]
        lam = self.lambda_(cultural)

        key_mode = self.config.bias_mode == "key"
        if self.explicit:
            scores = q @ k.transpose(-1, -2) * self.scale
            if key_mode:
                scores = scores + lam * (k @ c_proj).transpose(-1, -2) * self.scale  # [B, H, 1, Lk] per key
            elif not torch.compiler.is_exporting():
                scores = scores + lam * (q @ c_proj)  # [B, H, Lq, 1], the seed's literal formula
            z = self.attend_explicit(scores, v, mask)
        else:
            # key: (q_i + lam c') . k_j s = q_i . k_j s + lam (k_j . c') s, the bias folded into the queries
            # (no [B, H, L, L] term); query: constant over keys, so softmax removes it (the graph omits it).
            q_eff = q + lam * c_proj.view(b, h, 1, dh) if key_mode else q
            z = self.attend_fused(q_eff, k, v, mask)

        if self.config.fusion == "gated":
            c_heads = c_proj.view(b, h, 1, dh).expand(b, h, l, dh)
            gate_in = torch.cat([q, c_heads], dim=-1)  # [B, H, L, 2 Dh]
            g = torch.sigmoid(torch.einsum("bhli,hio->bhlo", gate_in, self.W_g) + self.b_g[None, :, None, :])
            c_value = self.C_f(cultural).view(b, h, 1, dh)  # value-space cultural vector
            z = g * z + (1.0 - g) * c_value
            if mask.row_valid is not None:
                z = z * mask.row_valid.to(z.dtype)
        return z


#: A gate bias at which sigmoid rounds to exactly 1 in fp32 and fp16 (the gate fully open).
GATE_OPEN = 30.0


def _neutral(attn: CulturalAttention) -> None:
    """Bias scale 0 and the gate open: exactly the plain attention it replaces."""
    with torch.no_grad():
        if attn.config.lambda_mode == "scalar":
            attn.lam.zero_()
        else:
            attn.lam_mlp[2].weight.zero_()
            attn.lam_mlp[2].bias.zero_()
        if attn.config.fusion == "gated":
            attn.W_g.zero_()
            attn.b_g.fill_(GATE_OPEN)


SPEC = register(VariantSpec(
    name="cultural",
    summary="cultural-context key bias and gated fusion",
    config=CulturalConfig,
    attention=CulturalAttention,
    placement=Placement(neutral=_neutral),
))
