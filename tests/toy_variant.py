"""A sixth variant defined entirely outside the package: temperature-scaled attention.

    A = softmax(Q K^T / (sqrt(Dh) * tau_b * exp(s_h)) + mask)     # tau [batch] a context input,
    out = A V W_O                                                  # s [H] learned (init 0)

It is what docs/architecture.md's "adding a variant" walks through: one file, a config, an
attention module, a ``VariantSpec``. ``tests/test_toy_variant.py`` registers it (in-process, and
through ``ATTNX_VARIANTS=toy_variant`` for the command line) and runs it through export,
``attnx check`` and a served request with no file of the package edited.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from attnx.models.attention import AttentionBase, AttentionConfig
from attnx.models.signature import InputSpec
from attnx.models.spec import Placement, VariantSpec, register


@dataclass
class ToyConfig(AttentionConfig):
    """Only the shared options."""


class TemperatureAttention(AttentionBase):
    def __init__(self, config: ToyConfig):
        super().__init__(config)
        self.log_scale = nn.Parameter(torch.zeros(config.n_heads))  # s_h

    @staticmethod
    def context_inputs(config: ToyConfig) -> list[InputSpec]:
        return [InputSpec("temperature", ("batch",), "float", "context", "softmax temperature per example (> 0)")]

    def forward(self, x, attention_mask=None, head_mask=None, *, temperature):
        self.validate(x, attention_mask, temperature=temperature)
        b, l, _ = x.shape
        q, k, v = self.project(x)  # [B, H, L, Dh]
        # Dividing the queries by the temperature scales every logit of a row: the fused path stays fused.
        q = q / (temperature.view(b, 1, 1, 1) * self.log_scale.exp().view(1, -1, 1, 1))
        bias, row_valid = self.mask(attention_mask, l, l, q.dtype)
        if self.explicit:
            z = self.attend(q @ k.transpose(-1, -2) * self.scale, v, bias, row_valid)
        else:
            z = self.attend_fused(q, k, v, bias, row_valid)
        return self.output(z, head_mask)


def _neutral(attn: TemperatureAttention) -> None:
    with torch.no_grad():
        attn.log_scale.zero_()


SPEC = register(VariantSpec(
    name="toy",
    summary="temperature-scaled attention (a test variant defined outside the package)",
    config=ToyConfig,
    attention=TemperatureAttention,
    placement=Placement(neutral=_neutral),
), replace=True)
