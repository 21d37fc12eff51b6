"""``maw``: Multi-Attention-Weight attention with GRPO depth selection (seed 003).

Depth ``d`` (``depth_dim``). Per head, learned depth projections ``U_q, U_k [H, Dh, d]``:

    q' = Q U_q,  k' = K U_k                                   # [B, H, L, d]
    A5[b,h,i,j,t] = q'[b,h,i,t] * k'[b,h,j,t] * s,  s = 1/sqrt(Dh)   # [B, H, Lq, Lk, d]
    policy_logits = Linear(D, 2D) -> GELU -> Linear(2D, d) of masked-mean(x)   # [B, d]
    w = gumbel_softmax(policy_logits, tau[, hard])    (training)
      = one_hot(argmax(policy_logits))                (inference)
    A = sum_t w_t A5[..., t];  out = softmax(A + mask) V W_O

``A5`` is never built: ``sum_t w_t A5[..., t] = s (q' * w) k'^T`` in training, and
at inference only the selected slice is read (``attnx::maw_depth_select``), which
is exactly attention computed from that slice alone. :func:`maw_logits_5d` builds
the literal 5-D tensor for tests and benchmarks.

GRPO (training only; never changes the forward output): for each example draw a
group of ``G`` depths from ``Categorical(softmax(policy_logits))``; the reward of
a depth is the negative entropy (or negative variance) of its masked attention
rows, averaged over heads and valid query rows, computed without gradient;
``advantage = (r - mean_group(r)) / (std_group(r) + eps)``;
``policy_loss = -mean(advantage * log pi(t))``; ``value_loss = MSE(value(x), mean_group(r))``.
``aux_loss = policy_loss + value_coef * value_loss`` is exposed on the module after
a training forward (the encoder sums them); an EMA (0.95) reward baseline is kept
for logging.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from attnx.models.common import AttentionBase, AttentionConfig, check_choice, masked_mean, masked_softmax
from attnx.models.custom_ops import maw_depth_select


@dataclass
class MawConfig(AttentionConfig):
    depth_dim: int = 5
    tau: float = 1.0  # Gumbel-softmax temperature
    hard: bool = False  # straight-through one-hot in training
    group_size: int = 8  # GRPO samples per example
    reward: str = "neg_entropy"  # neg_entropy | neg_variance
    value_coef: float = 0.5
    baseline_momentum: float = 0.95

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("reward", self.reward, ("neg_entropy", "neg_variance"))
        if self.depth_dim < 1 or self.group_size < 2 or self.tau <= 0:
            raise ValueError("need depth_dim >= 1, group_size >= 2 and tau > 0")


def maw_logits_5d(q_depth: torch.Tensor, k_depth: torch.Tensor, scale: float) -> torch.Tensor:
    """The literal 5-D logits ``[B, H, Lq, Lk, d]`` (for tests and benchmarks only)."""
    return q_depth[:, :, :, None, :] * k_depth[:, :, None, :, :] * scale


def attention_rewards(scores: torch.Tensor, bias, row_valid, kind: str) -> torch.Tensor:
    """Reward per example ``[B]`` of attention logits ``[B, H, Lq, Lk]``: -entropy or -variance
    of the masked rows, averaged over heads and the query rows that ``row_valid`` marks valid
    (pass it with padded query rows cleared, as ``MawAttention`` does)."""
    p = masked_softmax(scores, bias, row_valid)
    if kind == "neg_entropy":
        per_row = (p * torch.log(p.clamp_min(1e-12))).sum(-1)  # -entropy, [B, H, Lq]
    else:
        if bias is None:
            per_row = -p.var(dim=-1, unbiased=False)
        else:
            keys = (bias == 0).to(p.dtype)  # [B, 1, Lq, Lk] valid keys
            n = keys.sum(-1).clamp_min(1.0)
            mean = (p * keys).sum(-1) / n
            per_row = -(((p - mean[..., None]) ** 2) * keys).sum(-1) / n
    if row_valid is None:
        return per_row.mean(dim=(1, 2))
    rows = row_valid[..., 0].to(p.dtype).expand_as(per_row)  # [B, H, Lq]
    return (per_row * rows).sum(dim=(1, 2)) / rows.sum(dim=(1, 2)).clamp_min(1.0)


class MawAttention(AttentionBase):
    def __init__(self, config: MawConfig):
        super().__init__(config)
        h, dh, d, dm = config.n_heads, config.head_dim, config.depth_dim, config.d_model
        self.U_q = nn.Parameter(torch.randn(h, dh, d) / math.sqrt(dh))
        self.U_k = nn.Parameter(torch.randn(h, dh, d) / math.sqrt(dh))
        self.policy = nn.Sequential(nn.Linear(dm, 2 * dm), nn.GELU(), nn.Linear(2 * dm, d))
        self.value = nn.Sequential(nn.Linear(dm, 2 * dm), nn.GELU(), nn.Linear(2 * dm, 1))
        self.register_buffer("reward_baseline", torch.zeros(()), persistent=False)
        self.aux_loss: torch.Tensor | None = None
        self.last_depth: torch.Tensor | None = None

    def depth_projections(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k ``[B, H, L, Dh]`` -> q', k' ``[B, H, L, d]``."""
        return q @ self.U_q, k @ self.U_k  # U [H, Dh, d] broadcasts over the batch

    def policy_logits(self, x: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        return self.policy(masked_mean(x, attention_mask))  # [B, d]

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None,
                head_mask: torch.Tensor | None = None) -> torch.Tensor:
        self.validate(x, attention_mask)
        b, l, _ = x.shape
        q, k, v = self.project(x)  # [B, H, L, Dh]
        q_depth, k_depth = self.depth_projections(q, k)  # [B, H, L, d]
        pooled = masked_mean(x, attention_mask)  # [B, D]
        logits_pi = self.policy(pooled)  # [B, d]
        bias, row_valid = self.mask(attention_mask, l, l, q.dtype)

        if self.training:
            w = F.gumbel_softmax(logits_pi, tau=self.config.tau, hard=self.config.hard)  # [B, d]
            scores = ((q_depth * w[:, None, None, :]) @ k_depth.transpose(-1, -2)) * self.scale  # = sum_t w_t A5_t
            self.last_depth = w.argmax(-1)
            # Rewards average over real query tokens only (padded query rows carry no meaning).
            reward_rows = row_valid if attention_mask is None else row_valid & attention_mask.bool()[:, None, :, None]
            self.aux_loss = self.grpo_loss(logits_pi, pooled, q_depth, k_depth, bias, reward_rows)
        else:
            scores, self.last_depth = maw_depth_select(q_depth, k_depth, logits_pi, self.scale)
            self.aux_loss = None
        z = self.attend(scores, v, bias, row_valid)
        return self.output(z, head_mask)

    def grpo_loss(self, logits_pi, pooled, q_depth, k_depth, bias, row_valid) -> torch.Tensor:
        """Group-relative policy loss + value loss (see module docstring)."""
        cfg = self.config
        with torch.no_grad():
            # Reward of every depth once ([B, d]); sampled depths index into it.
            rewards_all = torch.stack([
                attention_rewards(q_depth[..., t:t + 1] @ k_depth[..., t:t + 1].transpose(-1, -2) * self.scale,
                                  bias, row_valid, cfg.reward)
                for t in range(cfg.depth_dim)], dim=-1)
        dist = torch.distributions.Categorical(logits=logits_pi)
        samples = dist.sample((cfg.group_size,))  # [G, B]
        rewards = rewards_all.gather(1, samples.T).T  # [G, B]
        advantage = (rewards - rewards.mean(0)) / (rewards.std(0) + 1e-6)
        policy_loss = -(advantage * dist.log_prob(samples)).mean()
        value_loss = F.mse_loss(self.value(pooled).squeeze(-1), rewards.mean(0))
        with torch.no_grad():
            m = cfg.baseline_momentum
            self.reward_baseline.mul_(m).add_((1 - m) * rewards.mean())
        return policy_loss + cfg.value_coef * value_loss
