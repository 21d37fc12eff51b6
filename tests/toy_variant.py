"""A sixth variant defined entirely outside the package: temperature-scaled attention.

    A = softmax(Q K^T / (sqrt(Dh) * tau_b^a * exp(s_h)) + mask)   # tau [batch] a context input,
    out = A V W_O                                                  # s [H] (init 0), a (init 1) learned

Placed in a pretrained model it starts neutral, ``a = 0`` and ``s = 0``: plain attention whatever
the temperature.

It is what docs/architecture.md's "adding a variant" walks through: one file, a config, an
attention module with its own parameters and ``attend(q, k, v, mask, **context)``, a
``VariantSpec``. ``tests/test_toy_variant.py`` registers it (in-process, and through
``ATTNX_VARIANTS=toy_variant`` for the command line) and runs it through export, ``attnx check``
and a served request, in attnx's encoder and in every transformers family of the support matrix,
with no file of the package edited.
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
        self.exponent = nn.Parameter(torch.ones(()))  # a: how strongly the temperature acts

    @staticmethod
    def context_inputs(config: ToyConfig) -> list[InputSpec]:
        return [InputSpec("temperature", ("batch",), "float", "context", "softmax temperature per example (> 0)",
                          default="ones")]

    def attend(self, q, k, v, mask, *, temperature):
        # q, k, v [B, H, L, Dh] from whatever host projected them (attnx's encoder, a transformers model).
        # Dividing the queries by the temperature scales every logit of a row: the fused path stays fused.
        q = q / (temperature.view(-1, 1, 1, 1) ** self.exponent * self.log_scale.exp().view(1, -1, 1, 1))
        if self.explicit:
            return self.attend_explicit(q @ k.transpose(-1, -2) * self.scale, v, mask)
        return self.attend_fused(q, k, v, mask)


def _neutral(attn: TemperatureAttention) -> None:
    with torch.no_grad():
        attn.log_scale.zero_()
        attn.exponent.zero_()


SPEC = register(VariantSpec(
    name="toy",
    summary="temperature-scaled attention (a test variant defined outside the package)",
    config=ToyConfig,
    attention=TemperatureAttention,
    placement=Placement(neutral=_neutral),
), replace=True)
