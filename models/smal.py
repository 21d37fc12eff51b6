"""``smal``: Self-Modulated Attention with Trace Tensor Attention (seed 004).

Inputs: ``self_state`` s ``[B, d_self]``; ``trace`` T ``[B, Dh, Dh]`` (shared by heads)
or ``[B, H, Dh, Dh]`` (``per_head_trace=True``); unbatched ``[Dh, Dh]`` / ``[H, Dh, Dh]``
broadcast over the batch.

    beta   = sigmoid(w_beta . s + b_beta)                       # [B]
    D_ij   = (q_i - k_j)^T T (q_i - k_j)                        # [B, H, Lq, Lk]
    S_ij   = q_i . k_j / sqrt(Dh) - gamma * beta * D_ij         # mode="smal"
    S_ij   = -D_ij                                              # mode="tta" (the seed's pure form)
    out    = softmax(S + mask) V W_O

``gamma`` is a learned scalar (``gamma_init``, default 1.0); ``gamma_init=0``
makes the module exactly ``mha`` with the same weights.

Exact rewrite (``use_rewrite=True``; a fast path, never the reference): the
``q_i^T T q_i`` term of D is constant across j, so
``softmax_j(S_ij) = softmax_j(q_i M k_j^T - gamma beta (k_j^T T k_j))`` with
``M = I/sqrt(Dh) + gamma beta (T + T^T)`` (tta: ``M = T + T^T``, bias ``-k^T T k``):
ordinary fused attention with queries ``Q M``, scale 1 and a per-key bias, O(L) memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from attnx.models.common import AttentionBase, AttentionConfig, InputSpec, check_choice
from attnx.models.custom_ops import tta_distance


@dataclass
class SmalConfig(AttentionConfig):
    d_self: int = 32
    per_head_trace: bool = False
    gamma_init: float = 1.0
    mode: str = "smal"  # smal | tta
    use_rewrite: bool = False  # exact rewrite fast path (inference)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("mode", self.mode, ("smal", "tta"))
        if self.d_self <= 0:
            raise ValueError(f"d_self must be positive, got {self.d_self}")


class SelfModulatedAttention(AttentionBase):
    context_names = ("self_state", "trace")

    def __init__(self, config: SmalConfig):
        super().__init__(config)
        self.self_gate = nn.Linear(config.d_self, 1)  # w_beta, b_beta
        self.gamma = nn.Parameter(torch.tensor(float(config.gamma_init)))

    def context_specs(self) -> list[InputSpec]:
        dh = self.head_dim
        trace_shape = ("batch", self.n_heads, dh, dh) if self.config.per_head_trace else ("batch", dh, dh)
        return [InputSpec("self_state", ("batch", self.config.d_self), "float", "context", "self state s"),
                InputSpec("trace", trace_shape, "float", "context", "trace tensor T", broadcast_batch=True)]

    def trace_heads(self, trace: torch.Tensor, batch: int) -> torch.Tensor:
        """Any accepted trace layout -> ``[B, 1|H, Dh, Dh]``."""
        dh, h = self.head_dim, self.n_heads
        per_head = self.config.per_head_trace
        want = (h, dh, dh) if per_head else (dh, dh)
        if tuple(trace.shape[-len(want):]) != want or trace.dim() not in (len(want), len(want) + 1):
            raise ValueError(f"trace: expected shape [B, {', '.join(map(str, want))}] or "
                             f"[{', '.join(map(str, want))}], got {list(trace.shape)}")
        if trace.dim() == len(want):
            trace = trace.unsqueeze(0).expand(batch, *want)
        return trace if per_head else trace.unsqueeze(1)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None,
                head_mask: torch.Tensor | None = None, *, self_state: torch.Tensor,
                trace: torch.Tensor) -> torch.Tensor:
        self.validate(x, attention_mask, self_state=self_state, trace=trace)
        b, l, _ = x.shape
        q, k, v = self.project(x)  # [B, H, L, Dh]
        T = self.trace_heads(trace, b).to(q.dtype)  # [B, 1|H, Dh, Dh]
        beta = torch.sigmoid(self.self_gate(self_state)).view(b, 1, 1, 1)  # [B, 1, 1, 1]
        gb = self.gamma * beta
        tta = self.config.mode == "tta"
        bias, row_valid = self.mask(attention_mask, l, l, q.dtype)

        if self.config.use_rewrite and not self.pattern_hooked:
            T_sym = T + T.transpose(-1, -2)
            eye = torch.eye(self.head_dim, dtype=q.dtype, device=q.device)
            M = T_sym if tta else eye * self.scale + gb * T_sym  # [B, 1|H, Dh, Dh]
            kTk = ((k @ T) * k).sum(-1)[:, :, None, :]  # [B, H, 1, Lk]
            key_bias = -kTk if tta else -gb * kTk
            z = self.attend_fused(q @ M, k, v, bias, row_valid, extra_bias=key_bias.expand(b, self.n_heads, l, l),
                                  scale=1.0)
        else:
            D = tta_distance(q, k, T)  # [B, H, Lq, Lk]
            scores = -D if tta else q @ k.transpose(-1, -2) * self.scale - gb * D
            z = self.attend(scores, v, bias, row_valid)
        return self.output(z, head_mask)
