"""attnx variants as a transformers attention backend: one attention function, one mask function.

transformers routes every attention of its models through ``ALL_ATTENTION_FUNCTIONS`` (the
``AttentionInterface``) and builds their masks through ``ALL_MASK_ATTENTION_FUNCTIONS``. attnx
registers :func:`attention` under ``attnx`` and under ``attnx_<variant>`` for each variant, with
:func:`mask` beside it (without a mask function of its own, a custom attention receives a mask it
misreads: measured 5.6 off on padded rows, silently). The family's own code projects q/k/v,
applies RoPE and keeps grouped-query heads; :func:`attention` hands them to the attnx module
:func:`attnx.pretrained.place` attached to that attention module (``module.attnx``: a variant's
parameters and hook points, or plain ``mha``), which returns ``[B, L, H, Dh]`` as transformers expects.

What the attention function is not given by the family travels in the :class:`Call` of the
running forward (a context variable set by the placed model's forward hooks, or by :func:`context`):
the variants' context inputs (smal's ``self_state``/``trace``...), the 2-D token mask (maw pools
the sequence), a head mask, and each attention's input hidden states.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from attnx.models.attention import Mask, TracedVar, bias_from_allowed, mask_bias
from attnx.models.signature import check_tensor

NAME = "attnx"


@dataclass
class Call:
    """The state of one forward of a placed model that transformers does not pass to attention."""

    context: dict[str, torch.Tensor] = field(default_factory=dict)
    tokens: torch.Tensor | None = None  # [B, L] 1 = token, 0 = padding
    head_mask: torch.Tensor | None = None  # [n_layers, H] (1 keeps a head, 0 ablates it)
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # id(attnx module) -> its input
    layer_inputs: dict[int, torch.Tensor] = field(default_factory=dict)  # layer index -> the layer's input
    #: a decoder's cached forward (attnx.pretrained.cached.CachedState): each layer's variant state beside k/v
    cache: object | None = None
    #: the additive bias of the boolean mask transformers passes every layer: (that mask, dtype, bias)
    bias: tuple | None = None

    opened: tuple | None = None  # the TracedVar token of a Call a model's first layer opened (open_forward)

    def extended(self, context: dict | None = None, tokens=None) -> "Call":
        return Call({**self.context, **(context or {})}, self.tokens if tokens is None else tokens, self.head_mask,
                    cache=self.cache)


_CALL = TracedVar("attnx_call", None)  # the running forward's Call (a ContextVar torch.compile can trace)
_PROBE = TracedVar("attnx_probe", None)


def current_call() -> Call:
    return _CALL.get() or Call()


@contextlib.contextmanager
def calling(call: Call):
    token = _CALL.set(call)
    try:
        yield call
    finally:
        _CALL.reset(token)


def open_forward() -> None:
    """A placed model's first layer starts a forward: a fresh Call (inheriting the caller's context), after
    closing one a failed forward left open."""
    stale = _CALL.get()
    while stale is not None and stale.opened is not None:
        _CALL.reset(stale.opened)
        stale = _CALL.get()
    call = current_call().extended()
    call.opened = _CALL.set(call)


def close_forward() -> None:
    call = _CALL.get()
    if call is not None and call.opened is not None:
        _CALL.reset(call.opened)


@contextlib.contextmanager
def context(**tensors: torch.Tensor):
    """Context inputs for every placed-model forward in the block, e.g. while a trainer that knows
    nothing of them runs (``with attnx.pretrained.context(self_state=s, trace=T): trainer.train()``).
    A tensor whose batch dim is 1 is shared by every example of a batch."""
    outer = current_call()
    with calling(outer.extended(tensors)):
        yield


@contextlib.contextmanager
def probing():
    """Record each attention call (module and what the family passed) instead of needing attnx modules."""
    calls: list = []
    token = _PROBE.set(calls)
    try:
        yield calls
    finally:
        _PROBE.reset(token)


@dataclass
class ProbedCall:
    module: torch.nn.Module
    n_heads: int
    n_kv_heads: int
    head_dim: int
    scaling: float | None
    softcap: float | None
    is_causal: bool


_UNSUPPORTED = {"position_bias": "a relative position bias (T5-style)", "s_aux": "attention sinks",
                "cache": "a paged cache"}


def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
              is_causal: bool | None = None, **kwargs):
    """transformers' attention signature: q ``[B, H, Lq, Dh]``, k/v ``[B, H_kv, Lk, Dh]`` and the mask of
    :func:`mask` -> (``[B, Lq, H, Dh]``, None)."""
    for key_name, what in _UNSUPPORTED.items():
        if kwargs.get(key_name) is not None:
            raise ValueError(f"{type(module).__name__} passes {what}, which attnx's attention does not implement")
    causal = bool(getattr(module, "is_causal", False) if is_causal is None else is_causal)
    probe = _PROBE.get()
    if probe is not None:
        probe.append(ProbedCall(module, query.shape[1], key.shape[1], query.shape[-1], scaling,
                                kwargs.get("softcap"), causal))
    core = getattr(module, "attnx", None)
    if core is None:
        if probe is None:
            raise RuntimeError(f"{type(module).__name__} has no attnx attention: place a variant in the model first "
                               "(attnx.pretrained.place(model, 'mha'))")
        from attnx.models.attention import repeat_kv

        n = query.shape[1]
        return torch.nn.functional.scaled_dot_product_attention(
            query, repeat_kv(key, n), repeat_kv(value, n), attn_mask=attention_mask, scale=scaling,
            is_causal=attention_mask is None and causal and query.shape[2] > 1).transpose(1, 2), None
    call = current_call()
    lq, lk = query.shape[2], key.shape[2]
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            # No row-validity product: a fully masked row (a left-padded query) gets the uniform average
            # of the finite-minimum bias, exactly as transformers' eager attention gives it (and no pass
            # over the output for rows nobody reads).
            row_valid = None
            if call.bias is None or call.bias[0] is not attention_mask or call.bias[1] != query.dtype:
                # one conversion per forward: the family builds the mask once and hands it to every layer
                call.bias = (attention_mask, query.dtype, bias_from_allowed(attention_mask, query.dtype)[0])
            bias = call.bias[2]
            if call.tokens is None and lq == lk:
                # the real tokens are the keys some query attends to (padding, causal or windowed masks alike)
                call.tokens = attention_mask.any(dim=-2)[:, 0]
        else:  # an additive float mask (a family that builds its own)
            bias, row_valid = attention_mask.to(query.dtype), None
    else:
        bias = mask_bias(None, lq, lk, query.dtype, causal and lq > 1, device=query.device)[0]
        row_valid = None
    masking = Mask(bias, row_valid, call.tokens, call.hidden.get(id(core)),
                   cache=None if call.cache is None else call.cache.layer(core.layer_index))
    head_mask = None if call.head_mask is None else call.head_mask[core.layer_index]
    if core.training:
        core.dropout.p = float(dropout)  # the family's attention dropout (it passes 0 in eval)
    ctx = _context_for(core, call, query.shape[0])
    return core.core(query, key, value, masking, head_mask, **ctx).contiguous(), None  # families .view() it


def _context_for(module, call: Call, batch: int) -> dict[str, torch.Tensor]:
    """The context inputs ``module`` (an attnx attention or fusion) takes, checked against its specs
    (batch-1 tensors shared by the batch)."""
    specs = module.context_inputs(module.config)
    if not specs:
        return {}
    missing = [s for s in specs if s.name not in call.context]
    if missing:
        raise ValueError("missing context input(s) " + ", ".join(s.describe() for s in missing)
                         + ": pass them to the model call (model(..., name=tensor)) or use "
                         "attnx.pretrained.context(name=tensor)")
    out = {s.name: call.context[s.name] for s in specs}
    if torch.compiler.is_exporting():
        return out
    dims = {"batch": batch}
    for spec in specs:
        value = out[spec.name]
        if isinstance(value, torch.Tensor) and spec.shape and spec.shape[0] == "batch":
            if value.dim() == len(spec.shape) and value.shape[0] == 1 and batch > 1:
                value = out[spec.name] = value.expand(batch, *value.shape[1:])
            elif spec.broadcast_batch and value.dim() == len(spec.shape) - 1:
                continue  # the module takes the unbatched form itself
        check_tensor(spec, value, dims)
    return out


def mask(*args, **kwargs):
    """transformers' ``sdpa_mask`` (boolean, True = attend), never skipped in favour of ``is_causal``."""
    from transformers.masking_utils import sdpa_mask

    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


def register(variant: str | None = None) -> str:
    """Register the backend (``attnx``, and ``attnx_<variant>``); returns the implementation's name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    name = NAME if variant is None else f"{NAME}_{variant}"
    for n in {NAME, name}:
        AttentionInterface.register(n, attention)
        AttentionMaskInterface.register(n, mask)
    return name
