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

from attnx.models.hooks import HookPoint
from attnx.models.signature import InputSpec, check_choice, check_inputs

# --------------------------------------------------------------------------- paths


class TracedVar:
    """A ``ContextVar`` that ``torch.compile`` can trace. Eager code reads the context variable (per
    thread and task); Dynamo cannot trace ``ContextVar.get``/``set`` (a graph break at every layer), so
    every set is mirrored in a plain attribute and code being compiled reads and writes that instead
    (one graph for a whole placed model; the mirror follows the last set, whichever thread made it)."""

    def __init__(self, name: str, default):
        self.var = contextvars.ContextVar(name, default=default)
        self.traced = default

    def get(self):
        return self.traced if torch.compiler.is_dynamo_compiling() else self.var.get()

    def set(self, value) -> tuple:
        old, self.traced = self.traced, value
        return (None if torch.compiler.is_dynamo_compiling() else self.var.set(value)), old

    def reset(self, token: tuple) -> None:
        var_token, self.traced = token
        if var_token is not None:
            self.var.reset(var_token)


PATHS = ("fast", "reference", "plugin")
_PATH = TracedVar("attnx_attention_path", "fast")


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

    d_model: int = 256  # the hidden size the layer reads and writes
    n_heads: int = 4
    dropout: float = 0.0  # on the attention pattern, training only
    is_causal: bool = False  # decoder use: key j > query i is masked
    qkv_bias: bool = True
    head_size: int | None = None  # a host whose heads are not d_model / n_heads wide (Gemma, Qwen3)

    def __post_init__(self) -> None:
        if self.d_model <= 0 or self.n_heads <= 0:
            raise ValueError(f"d_model and n_heads must be positive, got {self.d_model} and {self.n_heads}")
        if self.head_size is None and self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        if self.head_size is not None and self.head_size <= 0:
            raise ValueError(f"head_dim must be positive, got {self.head_size}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")

    @property
    def head_dim(self) -> int:
        return self.head_size or self.d_model // self.n_heads

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
    if is_causal:  # lower-right aligned: the last query sees every key (decoding with a cache)
        allowed = allowed & torch.ones(lq, lk, dtype=torch.bool, device=device).tril(lk - lq)
    return bias_from_allowed(allowed, dtype)


def bias_from_allowed(allowed: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A boolean mask (True = attend; e.g. transformers' ``sdpa_mask``) -> (additive bias, row validity)."""
    bias = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)
    return bias, allowed.any(dim=-1, keepdim=True)


@dataclass
class Mask:
    """What one attention call knows besides q/k/v: the additive ``bias`` ``[B|1, 1, Lq|1, Lk]`` and
    ``row_valid`` ``[B|1, 1, Lq|1, 1]`` (None: nothing masked), and the sequence the call came from:
    ``tokens`` ``[B, Lk]`` (1 = token) and ``hidden``, the attention's input ``[B, Lq, d_model]``, for
    variants that pool the sequence (maw's policy). Hosts fill what they know; None is "unknown"."""

    bias: torch.Tensor | None = None
    row_valid: torch.Tensor | None = None
    tokens: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    #: grouped-query attention: (k, v repeated to every head, k, v with the host's key/value heads), so
    #: a fused attention on the repeated pair runs on the grouped one (one ONNX Attention with
    #: kv_num_heads; no copies of k/v per head). Set by :meth:`AttentionBase.core`.
    grouped: tuple | None = None
    #: a decoder's cached forward: this layer's :class:`attnx.models.cache.LayerCache` (what the variant
    #: declared in ``cache_state`` beside k and v); None without a cache.
    cache: object | None = None


def masked_softmax(scores: torch.Tensor, bias: torch.Tensor | None, row_valid: torch.Tensor | None) -> torch.Tensor:
    """softmax over keys with padded keys at exactly 0 and fully masked rows at 0."""
    if bias is None:
        return scores.softmax(dim=-1)
    pattern = _no_overflow(scores + bias).softmax(dim=-1)
    return pattern if row_valid is None else pattern * row_valid.to(pattern.dtype)


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


def repeat_kv(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Grouped-query attention: ``[B, H_kv, L, Dh] -> [B, H, L, Dh]``, kv head j serving query heads
    ``j * H / H_kv ...`` (transformers' ``repeat_kv``)."""
    b, h_kv, l, dh = x.shape
    if h_kv == n_heads:
        return x
    return x[:, :, None].expand(b, h_kv, n_heads // h_kv, l, dh).reshape(b, n_heads, l, dh)


# --------------------------------------------------------------------------- the module

_WITHOUT_PROJECTIONS: contextvars.ContextVar[bool] = contextvars.ContextVar("attnx_without_projections",
                                                                            default=False)


@contextlib.contextmanager
def without_projections():
    """Build attention modules without W_Q/W_K/W_V/W_O: a host that projects q/k/v with its own code
    (a transformers model, :mod:`attnx.pretrained`) keeps only the variant's own parameters."""
    token = _WITHOUT_PROJECTIONS.set(True)
    try:
        yield
    finally:
        _WITHOUT_PROJECTIONS.reset(token)


class AttentionBase(nn.Module):
    """Q/K/V/O projections, hook points and the masked attention every variant builds on.

    A variant implements :meth:`attend` (q, k, v ``[B, H, L, Dh]`` -> z ``[B, H, Lq, Dh]``) and declares
    its own parameters; ``forward(x, attention_mask, head_mask, **context)`` projects, attends and
    projects out. A host with its own projections calls :meth:`core` on its q/k/v instead.

    Hook points (per layer i, under ``blocks.{i}.attn.``): ``hook_q|hook_k|hook_v`` ``[B, L, H, Dh]``
    (k and v with the host's key/value heads under grouped-query attention),
    ``hook_attn_scores|hook_pattern`` ``[B, H, Lq, Lk]``, ``hook_z`` ``[B, L, H, Dh]``.
    """

    def __init__(self, config: AttentionConfig):
        super().__init__()
        self.config = config
        d, h, dh = config.d_model, config.n_heads, config.head_dim
        self.n_heads, self.head_dim = h, dh
        self.scale = 1.0 / math.sqrt(dh)  # a host may set its own (Gemma's query_pre_attn_scalar)
        self.softcap: float | None = None  # tanh soft-capping of the logits (Gemma 2), set by a host
        if not _WITHOUT_PROJECTIONS.get():
            self.W_Q = nn.Linear(d, h * dh, bias=config.qkv_bias)
            self.W_K = nn.Linear(d, h * dh, bias=config.qkv_bias)
            self.W_V = nn.Linear(d, h * dh, bias=config.qkv_bias)
            self.W_O = nn.Linear(h * dh, d)
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

    @staticmethod
    def cache_state(config) -> list:
        """What this attention keeps in a decoder's cache besides k and v (:mod:`attnx.models.cache`)."""
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
        """True when this layer must form scores and pattern explicitly: a hook observes them, the
        reference path runs, or the logits are soft-capped (no fused kernel does that)."""
        return (self.hook_attn_scores.active or self.hook_pattern.active or current_path() == "reference"
                or self.softcap is not None)

    # ---- the attention ---------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None,
                head_mask: torch.Tensor | None = None, **context) -> torch.Tensor:
        """x ``[B, L, d_model]`` -> ``[B, L, d_model]``."""
        self.validate(x, attention_mask, **context)
        q, k, v = self.project(x)  # [B, H, L, Dh]
        mask = self.mask(attention_mask, x.shape[1], x.shape[1], q.dtype, hidden=x)
        return self.W_O(merge_heads(self.core(q, k, v, mask, head_mask, **context)))

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x ``[B, L, D]`` -> q, k, v ``[B, H, L, Dh]``."""
        h = self.n_heads
        return tuple(split_heads(w(x), h).transpose(1, 2) for w in (self.W_Q, self.W_K, self.W_V))

    def mask(self, attention_mask, lq: int, lk: int, dtype, hidden=None) -> Mask:
        bias, row_valid = mask_bias(attention_mask, lq, lk, dtype, self.config.is_causal,
                                    device=None if attention_mask is None else attention_mask.device)
        return Mask(bias, row_valid, attention_mask, hidden)

    def core(self, q, k, v, mask: Mask, head_mask: torch.Tensor | None = None, **context) -> torch.Tensor:
        """The attention between the projections: q ``[B, H, Lq, Dh]``, k/v ``[B, H|H_kv, Lk, Dh]`` ->
        z ``[B, Lq, H, Dh]`` (through the hook points, the variant's :meth:`attend`, the head mask)."""
        q = self.hook_q(q.transpose(1, 2)).transpose(1, 2)
        k = self.hook_k(k.transpose(1, 2)).transpose(1, 2)
        v = self.hook_v(v.transpose(1, 2)).transpose(1, 2)
        if k.shape[1] != self.n_heads:  # variants see every head's k and v; a fused attention, the groups
            k_all, v_all = repeat_kv(k, self.n_heads), repeat_kv(v, self.n_heads)
            mask = dataclasses.replace(mask, grouped=(k_all, v_all, k, v))
            k, v = k_all, v_all
        z = self.hook_z(self.attend(q, k, v, mask, **context).transpose(1, 2))  # [B, L, H, Dh]
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
        return z

    def attend(self, q, k, v, mask: Mask, **context) -> torch.Tensor:
        """The variant's attention: q, k, v ``[B, H, L, Dh]`` -> z ``[B, H, Lq, Dh]``."""
        raise NotImplementedError(f"{type(self).__name__} must implement attend(q, k, v, mask, **context)")

    def attend_explicit(self, scores: torch.Tensor, v: torch.Tensor, mask: Mask) -> torch.Tensor:
        """Explicit path: scores ``[B, H, Lq, Lk]`` -> z ``[B, H, Lq, Dh]``."""
        if self.softcap is not None:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        scores = self.hook_attn_scores(scores)
        pattern = self.hook_pattern(masked_softmax(scores, mask.bias, mask.row_valid))
        return self.dropout(pattern) @ v

    def attend_fused(self, q, k, v, mask: Mask, *, extra_bias=None, scale=None) -> torch.Tensor:
        """Fused path (one ONNX ``Attention`` node): softmax(q k^T * scale + bias + extra_bias) v.

        Masks stay broadcast (``[B, 1, 1, Lk]``, a per-key bias ``[B, H, 1, Lk]``) in PyTorch. In an
        exported graph the key-padding mask is expanded to ``[B, 1, Lq, Lk]`` (ONNX Runtime's
        ``Attention`` refuses a broadcast query axis), never to ``[B, H, Lq, Lk]``: variants fold
        per-key biases into q/k before they get here when exporting."""
        bias = mask.bias
        attn_mask = bias if extra_bias is None else (extra_bias if bias is None else _no_overflow(bias + extra_bias))
        if attn_mask is not None and torch.compiler.is_exporting() and attn_mask.shape[-2] == 1:
            attn_mask = attn_mask.expand(*attn_mask.shape[:-2], q.shape[-2], attn_mask.shape[-1])
        grouped = mask.grouped is not None and k is mask.grouped[0] and v is mask.grouped[1]
        if grouped:
            k, v = mask.grouped[2], mask.grouped[3]
        z = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=self.scale if scale is None else scale,
                                           dropout_p=self.dropout.p if self.training else 0.0, enable_gqa=grouped)
        return z if mask.row_valid is None else z * mask.row_valid.to(z.dtype)
