"""``mha``: multi-head attention with interpretability hooks (seed 002).

    Q = x W_Q + b_Q,  K = x W_K + b_K,  V = x W_V + b_V        # [B, H, L, Dh]
    A = softmax(Q K^T / sqrt(Dh) + mask)                         # [B, H, Lq, Lk]
    z = A V;  out = concat_h(head_mask_h * z_h) W_O + b_O

With no hook observing the scores or the pattern, the fused
``scaled_dot_product_attention`` path runs (one ONNX ``Attention`` node on
export); with one (or on the reference path), the explicit path runs and feeds
``hook_attn_scores`` and ``hook_pattern``. Both compute the same function.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnx.models.attention import AttentionBase, AttentionConfig, Mask
from attnx.models.spec import Placement, VariantSpec, register


@dataclass
class MhaConfig(AttentionConfig):
    """Plain multi-head attention: only the shared options."""


class MultiHeadAttention(AttentionBase):
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask) -> torch.Tensor:
        if self.explicit:
            return self.attend_explicit(q @ k.transpose(-1, -2) * self.scale, v, mask)
        return self.attend_fused(q, k, v, mask)


SPEC = register(VariantSpec(
    name="mha",
    summary="multi-head attention with hooks, head interventions and activation patching",
    config=MhaConfig,
    attention=MultiHeadAttention,
    placement=Placement(neutral=lambda attn: None),  # nothing new: it is the plain attention
))
