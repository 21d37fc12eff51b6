"""The attention every variant builds on: config, masking, heads, the Q/K/V/O module.

Conventions (variants.md): hidden states ``x`` are ``[B, L, d_model]``; heads are
``[B, H, L, Dh]``; ``attention_mask`` is ``[B, L]`` with 1 = token, 0 = padding.

**Attention paths.** Every variant computes the same function along one of three paths,
chosen by :func:`attention_path` (a context manager; the default is ``"fast"``):

- ``fast``: the exact fast path (fused ``scaled_dot_product_attention``, the variants' exact
  rewrites). What inference runs, and what the ``rewrite`` lowering exports.
- ``reference``: the literal formulas of variants.md (explicit scores and softmax); what
  tests and ``attnx check`` compare against. ``with reference(): ...``
- ``plugin``: the custom ops that become TensorRT plugins (the ``plugin`` lowering).

A hook observing the scores or the pattern makes a layer take its explicit path.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from attnx.interp.hooks import HookPoint
from attnx.models.signature import InputSpec, check_choice, check_inputs

# --------------------------------------------------------------------------- paths

PATHS = ("fast", "reference", "plugin")
_PATH: contextvars.ContextVar[str] = contextvars.ContextVar("attnx_attention_path", default="fast")


@contextlib.contextmanager
def attention_path(path: str):
    """Run the attention of every variant along ``path`` (``fast`` | ``reference`` | ``plugin``)."""
    check_choice("attention path", path, PATHS)
    token = _PATH.set(path)
    try:
        yield
    finally:
        _PATH.reset(token)


def reference():
    """``with reference(): model(x)`` runs the literal formulas (tests, ``attnx check``)."""
    return attention_path("reference")


def current_path() -> str:
    return _PATH.get()


# --------------------------------------------------------------------------- config

@dataclass
class AttentionConfig:
    """Options shared by every variant's attention."""

    d_model: int = 256
    n_heads: int = 4
    dropout: float = 0.0  # on the attention pattern, training only
    is_causal: bool = False  # decoder use: key j > query i is masked
    qkv_bias: bool = True

    def __post_init__(self) -> None:
        if self.d_model <= 0 or self.n_heads <= 0:
            raise ValueError(f"d_model and n_heads must be positive, got {self.d_model} and {self.n_heads}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)



# --------------------------------------------------------------------------- masking


def mask_bias(attention_mask: torch.Tensor | None, lq: int, lk: int, dtype: torch.dtype,
              is_causal: bool, device=None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Additive key bias (0 or dtype-min) and row validity: ``[B, 1, 1, Lk]`` and ``[B, 1, 1, 1]`` for
    key padding alone (O(L): attention broadcasts it over heads and query rows), ``[B|1, 1, Lq, Lk]``
    and ``[B|1, 1, Lq, 1]`` for a causal model.

    The finite minimum (not -inf) keeps fully masked rows NaN-free in forward and
    backward; their pattern is then zeroed with the row validity, so padded keys
    get exactly zero weight (exp underflows) and empty rows give zeros.
    Returns (None, None) when nothing is masked.
    """
    if attention_mask is None and not is_causal:
        return None, None
    allowed = torch.ones(1, 1, lq if is_causal else 1, lk, dtype=torch.bool, device=device)
    if attention_mask is not None:
        allowed = allowed & attention_mask.bool()[:, None, None, :]  # [B, 1, 1|Lq, Lk]
    if is_causal:
        allowed = allowed & torch.ones(lq, lk, dtype=torch.bool, device=device).tril()
    bias = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)
    row_valid = allowed.any(dim=-1, keepdim=True)  # [B, 1, 1|Lq, 1]
    return bias, row_valid


def masked_softmax(scores: torch.Tensor, bias: torch.Tensor | None, row_valid: torch.Tensor | None) -> torch.Tensor:
    """softmax over keys with padded keys at exactly 0 and fully masked rows at 0."""
    if bias is None:
        return scores.softmax(dim=-1)
    pattern = _no_overflow(scores + bias).softmax(dim=-1)
    return pattern * row_valid.to(pattern.dtype)


def _no_overflow(logits: torch.Tensor) -> torch.Tensor:
    """fp16 eager only: dtype-min plus a score below -16 rounds to -inf, and a row of -inf gives NaN
    (which the row-validity product keeps). Clamp back to dtype-min. (fp32/bf16 cannot overflow here;
    exported graphs are traced in fp32 and left as they are.)"""
    if logits.dtype == torch.float16 and not torch.compiler.is_exporting():
        return logits.clamp_min(torch.finfo(logits.dtype).min)
    return logits


def masked_mean(x: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Mean over real tokens: ``[B, L, D] -> [B, D]`` (zeros for an all-padding example)."""
    if attention_mask is None:
        return x.mean(dim=1)
    w = attention_mask.to(x.dtype)[..., None]  # [B, L, 1]
    return (x * w).sum(dim=1) / w.sum(dim=1).clamp(min=1.0)


def split_heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """``[B, L, H*Dh] -> [B, L, H, Dh]`` (the hook layout; ``.transpose(1, 2)`` gives ``[B, H, L, Dh]``)."""
    b, l, d = x.shape
    return x.view(b, l, n_heads, d // n_heads)


def merge_heads(z: torch.Tensor) -> torch.Tensor:
    """``[B, L, H, Dh] -> [B, L, H*Dh]``."""
    b, l, h, dh = z.shape
    return z.reshape(b, l, h * dh)


# --------------------------------------------------------------------------- the module


class AttentionBase(nn.Module):
    """Q/K/V/O projections, hook points and the masked attention every variant builds on.

    Hook points (per layer i, under ``blocks.{i}.attn.``): ``hook_q|hook_k|hook_v``
    ``[B, L, H, Dh]``, ``hook_attn_scores|hook_pattern`` ``[B, H, Lq, Lk]``,
    ``hook_z`` ``[B, L, H, Dh]``.
    """


    def __init__(self, config: AttentionConfig):
        super().__init__()
        self.config = config
        d, h = config.d_model, config.n_heads
        self.n_heads, self.head_dim = h, config.head_dim
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.W_Q = nn.Linear(d, d, bias=config.qkv_bias)
        self.W_K = nn.Linear(d, d, bias=config.qkv_bias)
        self.W_V = nn.Linear(d, d, bias=config.qkv_bias)
        self.W_O = nn.Linear(d, d)
        self.dropout = nn.Dropout(config.dropout)
        self.hook_q, self.hook_k, self.hook_v = HookPoint(), HookPoint(), HookPoint()
        self.hook_attn_scores, self.hook_pattern, self.hook_z = HookPoint(), HookPoint(), HookPoint()

    # Per-head weights as views [H, d_model, Dh] (query_weights[h] maps x to head h's q).
    def _per_head(self, linear: nn.Linear) -> torch.Tensor:
        return linear.weight.T.view(self.config.d_model, self.n_heads, self.head_dim).permute(1, 0, 2)

    @property
    def query_weights(self) -> torch.Tensor:
        return self._per_head(self.W_Q)

    @property
    def key_weights(self) -> torch.Tensor:
        return self._per_head(self.W_K)

    @property
    def value_weights(self) -> torch.Tensor:
        return self._per_head(self.W_V)

    @property
    def output_weights(self) -> torch.Tensor:
        """``[H, Dh, d_model]``: head h's slice of W_O."""
        return self.W_O.weight.T.view(self.n_heads, self.head_dim, self.config.d_model)

    @staticmethod
    def context_inputs(config) -> list[InputSpec]:
        """The context inputs this attention's forward takes (by keyword)."""
        return []

    @property
    def context_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.context_inputs(self.config))

    def validate(self, x, attention_mask, **context) -> None:
        """ValueError naming the input when a shape or dtype is wrong (skipped while exporting)."""
        if torch.compiler.is_exporting():
            return
        specs = [InputSpec("x", ("batch", "seq", self.config.d_model), "float", "hidden_states"),
                 InputSpec("attention_mask", ("batch", "seq"), "mask", "attention_mask"), *self.context_inputs(self.config)]
        check_inputs(specs, {"x": x, "attention_mask": attention_mask, **context}, optional=("attention_mask",))

    @property
    def explicit(self) -> bool:
        """True when this layer must form scores and pattern explicitly: a hook observes them,
        or the reference path runs."""
        return self.hook_attn_scores.active or self.hook_pattern.active or current_path() == "reference"

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x ``[B, L, D]`` -> q, k, v ``[B, H, L, Dh]`` (through the hook points)."""
        h = self.n_heads
        q = self.hook_q(split_heads(self.W_Q(x), h)).transpose(1, 2)
        k = self.hook_k(split_heads(self.W_K(x), h)).transpose(1, 2)
        v = self.hook_v(split_heads(self.W_V(x), h)).transpose(1, 2)
        return q, k, v

    def mask(self, attention_mask, lq: int, lk: int, dtype) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return mask_bias(attention_mask, lq, lk, dtype, self.config.is_causal,
                         device=None if attention_mask is None else attention_mask.device)

    def attend(self, scores: torch.Tensor, v: torch.Tensor, bias, row_valid) -> torch.Tensor:
        """Explicit path: scores ``[B, H, Lq, Lk]`` -> z ``[B, H, Lq, Dh]``."""
        scores = self.hook_attn_scores(scores)
        pattern = self.hook_pattern(masked_softmax(scores, bias, row_valid))
        return self.dropout(pattern) @ v

    def attend_fused(self, q, k, v, bias, row_valid, *, extra_bias=None, scale=None) -> torch.Tensor:
        """Fused path (one ONNX ``Attention`` node): softmax(q k^T * scale + bias + extra_bias) v.

        Masks stay broadcast (``[B, 1, 1, Lk]``, a per-key bias ``[B, H, 1, Lk]``) in PyTorch. In an
        exported graph the key-padding mask is expanded to ``[B, 1, Lq, Lk]`` (ONNX Runtime's
        ``Attention`` refuses a broadcast query axis), never to ``[B, H, Lq, Lk]``: variants fold
        per-key biases into q/k before they get here when exporting."""
        attn_mask = bias if extra_bias is None else (extra_bias if bias is None else _no_overflow(bias + extra_bias))
        if attn_mask is not None and torch.compiler.is_exporting() and attn_mask.shape[-2] == 1:
            attn_mask = attn_mask.expand(*attn_mask.shape[:-2], q.shape[-2], attn_mask.shape[-1])
        z = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=self.scale if scale is None else scale,
                                           dropout_p=self.config.dropout if self.training else 0.0)
        return z if row_valid is None else z * row_valid.to(z.dtype)

    def output(self, z: torch.Tensor, head_mask: torch.Tensor | None) -> torch.Tensor:
        """z ``[B, H, L, Dh]`` -> ``[B, L, D]``: hook_z, per-head mask, then W_O."""
        z = self.hook_z(z.transpose(1, 2))  # [B, L, H, Dh]
        if head_mask is not None:
            hm = head_mask.to(z.dtype)
            if hm.dim() == 1:  # [H]
                hm = hm[None, None, :, None]
            elif hm.dim() == 2:  # [B, H]
                hm = hm[:, None, :, None]
            else:
                raise ValueError(f"head_mask: expected shape [H={self.n_heads}] or [B, H], got {list(head_mask.shape)}")
            if hm.shape[2] != self.n_heads:
                raise ValueError(f"head_mask: expected {self.n_heads} heads, got shape {list(head_mask.shape)}")
            z = z * hm
        return self.W_O(merge_heads(z))
