"""``maw``: Multi-Attention-Weight attention with GRPO depth selection (seed 003).

Depth ``d`` (``depth_dim``). Per head, learned depth projections ``U_q, U_k [H, Dh, d]``:

    q' = Q U_q,  k' = K U_k                                   # [B, H, L, d]
    A5[b,h,i,j,t] = q'[b,h,i,t] * k'[b,h,j,t] * s,  s = 1/sqrt(Dh)   # [B, H, Lq, Lk, d]
    policy_logits = Linear(D, 2D) -> GELU -> Linear(2D, d) of masked-mean(x)   # [B, d]
    w = gumbel_softmax(policy_logits, tau[, hard])    (training)
      = one_hot(argmax(policy_logits))                (inference)
    A = sum_t w_t A5[..., t];  out = softmax(A + mask) V W_O

``A5`` is never built: ``sum_t w_t A5[..., t] = s (q' * w) k'^T`` in training. At inference the
selected depth's logits are rank one, ``A_ij = q'_i[t] k'_j[t] s``: attention with a query/key
head size of 1 and the value head size unchanged. ``attnx::maw_depth_gather`` selects the depth
columns ``q'[..., t]``, ``k'[..., t]`` and a fused attention does the rest (the columns zero-padded
to the value head size, which TensorRT's attention requires), so no ``[B, H, L, L]`` tensor is
built (ONNX: the custom op ``MawDepthGather`` + the ``Attention`` op; TensorRT: the plugin + the
builder's attention). :func:`maw_logits_5d` builds the literal 5-D
tensor for tests and benchmarks.

GRPO (training only; never changes the forward output): for each example draw a group of ``G``
depths from ``Categorical(softmax(policy_logits))``; the reward of a depth is the negative
entropy (or negative variance) of its masked attention rows, averaged over heads and valid query
rows, computed without gradient; ``advantage = (r - mean_group(r)) / (std_group(r) + eps)``;
``policy_loss = -mean(advantage * log pi(t))``; ``value_loss = MSE(value(x), mean_group(r))``.
``aux_loss = policy_loss + value_coef * value_loss`` is exposed on the module after a training
forward (the encoder sums them); an EMA (0.95) reward baseline is kept for logging.

Placement in a pretrained model: a MAW layer cannot compute a full-rank attention, so no
parameter values make it equal the attention it would replace. Its natural form is the seed's:
MAW layers appended after the encoder as residual branches, output projection starting at zero.

Decoding with a KV cache (``attnx export --with-past``). The policy pools the whole sequence, so a
decoder's step needs more than k and v; each maw layer caches (``past_key_values.{i}.<name>``)
``key_depth`` (``k'`` of every cached key, ``[batch, heads, past, d]``: the depth may change at any
step, so every depth's column is kept) and the running sum and count of the pooled sequence
(``pool_sum [batch, D]``, ``pool_count [batch, 1]``). A step's depth is the policy's choice on the
mean of every real token so far, as re-running the whole sequence chooses it for its last token.

- Appended after the last layer (maw's own form, the default) or placed in the last layer, the
  cached step is exact: greedy generation with the cache equals re-running the full sequence.
- Placed in an earlier layer it is not, and cannot be with any cache: re-running the sequence
  lets a depth chosen later change the past tokens' outputs of this layer, hence the keys and
  values later layers hold for them. The cache keeps what each token had when it was generated
  (a decoder's usual causality); the two agree whenever the chosen depth stays the same.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnx.models.attention import AttentionBase, AttentionConfig, Mask, masked_mean, masked_softmax
from attnx.models.cache import PAST, CacheEntry
from attnx.models.signature import check_choice
from attnx.models.spec import CustomOp, ExtraOutput, Placement, VariantSpec, register


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
        if self.depth_dim < 1 or self.group_size < 2 or not 0 < self.tau < math.inf:
            raise ValueError("need depth_dim >= 1, group_size >= 2 and 0 < tau < inf")


def maw_logits_5d(q_depth: Tensor, k_depth: Tensor, scale: float) -> Tensor:
    """The literal 5-D logits ``[B, H, Lq, Lk, d]`` (for tests and benchmarks only)."""
    return q_depth[:, :, :, None, :] * k_depth[:, :, None, :, :] * scale


def attention_rewards(scores: Tensor, bias, row_valid, kind: str) -> Tensor:
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


# --------------------------------------------------------------------------- the depth gather (torch op)

@torch.library.custom_op("attnx::maw_depth_gather", mutates_args=())
def maw_depth_gather(q_depth: Tensor, k_depth: Tensor, policy_logits: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The selected depth's columns ``q_sel [B, H, Lq, 1]``, ``k_sel [B, H, Lk, 1]`` and the depth
    ``[B]`` (argmax of the policy logits, first on ties). Reads nothing but the chosen column."""
    depth = policy_logits.argmax(dim=-1)  # [B]
    idx = depth[:, None, None, None]
    q_sel = q_depth.gather(-1, idx.expand(*q_depth.shape[:3], 1))
    k_sel = k_depth.gather(-1, idx.expand(*k_depth.shape[:3], 1))
    return q_sel, k_sel, depth


@maw_depth_gather.register_fake
def _(q_depth, k_depth, policy_logits):
    b, h, lq, _ = q_depth.shape
    return (q_depth.new_empty(b, h, lq, 1), k_depth.new_empty(b, h, k_depth.shape[2], 1),
            policy_logits.new_empty(b, dtype=torch.int64))


def _gather_setup(ctx, inputs, output):
    ctx.save_for_backward(output[2])
    ctx.q_shape, ctx.k_shape = inputs[0].shape, inputs[1].shape


def _gather_backward(ctx, grad_q_sel, grad_k_sel, _grad_depth):
    # The gradient goes to the selected column only; the argmax (policy logits) has none.
    (depth,) = ctx.saved_tensors
    idx = depth[:, None, None, None]
    grad_q = grad_q_sel.new_zeros(ctx.q_shape).scatter(-1, idx.expand(*ctx.q_shape[:3], 1), grad_q_sel)
    grad_k = grad_k_sel.new_zeros(ctx.k_shape).scatter(-1, idx.expand(*ctx.k_shape[:3], 1), grad_k_sel)
    return grad_q, grad_k, None


maw_depth_gather.register_autograd(_gather_backward, setup_context=_gather_setup)


# --------------------------------------------------------------------------- the module

class MawAttention(AttentionBase):
    def __init__(self, config: MawConfig):
        super().__init__(config)
        h, dh, d, dm = config.n_heads, config.head_dim, config.depth_dim, config.d_model
        self.U_q = nn.Parameter(torch.randn(h, dh, d) / math.sqrt(dh))
        self.U_k = nn.Parameter(torch.randn(h, dh, d) / math.sqrt(dh))
        self.policy = nn.Sequential(nn.Linear(dm, 2 * dm), nn.GELU(), nn.Linear(2 * dm, d))
        self.value = nn.Sequential(nn.Linear(dm, 2 * dm), nn.GELU(), nn.Linear(2 * dm, 1))
        self.register_buffer("reward_baseline", torch.zeros(()), persistent=False)
        self.aux_loss: Tensor | None = None
        self.last_depth: Tensor | None = None  # [B] depth chosen by the last forward
        self.last_policy_logits: Tensor | None = None  # [B, d] (inference), for near-tie reports

    @staticmethod
    def cache_state(config: MawConfig) -> list[CacheEntry]:
        return [CacheEntry("key_depth", ("batch", config.n_heads, PAST, config.depth_dim),
                           "per-depth keys k U_k of every cached key"),
                CacheEntry("pool_sum", ("batch", config.d_model), "sum of the pooled sequence so far (real tokens)"),
                CacheEntry("pool_count", ("batch", 1), "real tokens so far")]

    def depth_projections(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """q, k ``[B, H, L, Dh]`` -> q', k' ``[B, H, L, d]``."""
        return q @ self.U_q, k @ self.U_k  # U [H, Dh, d] broadcasts over the batch

    def policy_logits(self, x: Tensor, attention_mask: Tensor | None) -> Tensor:
        return self.policy(masked_mean(x, attention_mask))  # [B, d]

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Mask) -> Tensor:
        if mask.hidden is None:
            raise ValueError("maw pools the attention's input sequence for its policy: the host must pass it "
                             "(Mask.hidden)")
        if mask.cache is not None:
            q_depth, k_depth, pooled = self._cached(q, k, mask)
        else:
            q_depth, k_depth = self.depth_projections(q, k)  # [B, H, L, d]
            pooled = masked_mean(mask.hidden, mask.tokens)  # [B, D]
        logits_pi = self.policy(pooled)  # [B, d]

        if self.training:
            w = F.gumbel_softmax(logits_pi, tau=self.config.tau, hard=self.config.hard)  # [B, d]
            scores = ((q_depth * w[:, None, None, :]) @ k_depth.transpose(-1, -2)) * self.scale  # = sum_t w_t A5_t
            self.last_depth = w.argmax(-1)
            # Rewards average over real query tokens only (padded query rows carry no meaning).
            reward_rows = mask.row_valid
            if mask.tokens is not None:
                real = mask.tokens.bool()[:, None, -q.shape[2]:, None]  # [B, 1, Lq, 1]
                reward_rows = real if reward_rows is None else reward_rows & real
            self.aux_loss = self.grpo_loss(logits_pi, pooled, q_depth, k_depth, mask.bias, reward_rows)
            return self.attend_explicit(scores, v, mask)

        q_sel, k_sel, depth = maw_depth_gather(q_depth, k_depth, logits_pi)  # [B, H, L, 1], [B]
        self.last_depth, self.aux_loss = depth, None  # read as the maw_depth output (in exported graphs too)
        if not torch.compiler.is_exporting():
            self.last_policy_logits = logits_pi.detach()
        if self.explicit:
            return self.attend_explicit((q_sel * self.scale) @ k_sel.transpose(-1, -2), v, mask)
        # Attention over the selected columns with the scale of Dh. They are zero-padded to V's head
        # size (exact: the zeros add nothing to q.k) because TensorRT's attention and torch's fused
        # CPU kernel both want equal q/k/v head sizes.
        pad = (0, self.head_dim - 1)
        return self.attend_fused(F.pad(q_sel, pad), F.pad(k_sel, pad), v, mask)

    def _cached(self, q: Tensor, k: Tensor, mask: Mask) -> tuple[Tensor, Tensor, Tensor]:
        """A decoder's cached step (module docstring): the new keys' k' join the cached ones, the new
        tokens join the running pool; ``mask.tokens`` covers past and new tokens, ``mask.hidden`` the new."""
        if self.training:
            raise ValueError("maw trains on whole sequences: a cached (decoding) forward runs in eval mode only")
        lq = q.shape[2]
        new_keys = k[:, :, k.shape[2] - lq:]
        k_depth = mask.cache.append("key_depth", new_keys @ self.U_k, axis=2)
        x = mask.hidden
        w = (torch.ones(x.shape[:2], dtype=x.dtype, device=x.device) if mask.tokens is None
             else mask.tokens[:, mask.tokens.shape[1] - lq:].to(x.dtype))[..., None]  # [B, Lq, 1]
        total = mask.cache.carry("pool_sum", (x * w).sum(dim=1))
        count = mask.cache.carry("pool_count", w.sum(dim=1))
        return q @ self.U_q, k_depth, total / count.clamp(min=1.0)

    def grpo_loss(self, logits_pi, pooled, q_depth, k_depth, bias, row_valid) -> Tensor:
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


def _policy_margin(attn: MawAttention) -> Tensor:
    """Top-1 minus top-2 policy logit per row of the last forward (how clear the depth choice was)."""
    top = torch.topk(attn.last_policy_logits.float(), k=min(2, attn.last_policy_logits.shape[-1]), dim=-1).values
    return top[..., 0] - top[..., 1] if top.shape[-1] > 1 else torch.full_like(top[..., 0], math.inf)


# --------------------------------------------------------------------------- ONNX: custom ops

def _gather_schema():
    from onnx import TensorProto

    from attnx.models import onnx_ops as ops

    def infer(ctx):
        q, k = ops.rank4_inputs(ctx, 0, 1)
        elem = ctx.get_input_type(0).tensor_type.elem_type
        ctx.set_output_type(0, ops.tensor_type(elem, q[:3] + [1] if q else None))
        ctx.set_output_type(1, ops.tensor_type(elem, k[:3] + [1] if k else None))
        ctx.set_output_type(2, ops.tensor_type(TensorProto.INT64, q[:1] if q else None))

    return ops.schema(
        "MawDepthGather", "MAW inference: per example the argmax depth t of the policy logits and that depth's "
        "query/key columns (attention over them is rank one: a fused attention with head size 1 does the rest).",
        inputs=[("q_depth", "T", "[B, H, Lq, d] per-depth query scalars"),
                ("k_depth", "T", "[B, H, Lk, d] per-depth key scalars"),
                ("policy_logits", "T", "[B, d] policy logits over depths")],
        outputs=[("q_sel", "T", "[B, H, Lq, 1] q_depth[..., t]"), ("k_sel", "T", "[B, H, Lk, 1] k_depth[..., t]"),
                 ("depth", "tensor(int64)", "[B] selected depth (first maximum on ties)")],
        infer=infer)


def _gather_function(opset: int):
    from onnx import TensorProto, helper

    from attnx.models import onnx_ops as ops

    n = helper.make_node
    ints = lambda name, v: n("Constant", [], [name], value_ints=v)  # noqa: E731
    nodes = [
        n("Cast", ["policy_logits"], ["p32"], to=TensorProto.FLOAT),
        n("ArgMax", ["p32"], ["depth"], axis=1, keepdims=0),  # [B], first maximum on ties
        ints("index_shape", [-1, 1, 1, 1]), n("Reshape", ["depth", "index_shape"], ["index"]),  # [B, 1, 1, 1]
        ints("one", [1]),
        n("Shape", ["q_depth"], ["q_bhl"], start=0, end=3), n("Concat", ["q_bhl", "one"], ["q_shape"], axis=0),
        n("Expand", ["index", "q_shape"], ["q_index"]),
        n("GatherElements", ["q_depth", "q_index"], ["q_sel"], axis=3),  # [B, H, Lq, 1]
        n("Shape", ["k_depth"], ["k_bhl"], start=0, end=3), n("Concat", ["k_bhl", "one"], ["k_shape"], axis=0),
        n("Expand", ["index", "k_shape"], ["k_index"]),
        n("GatherElements", ["k_depth", "k_index"], ["k_sel"], axis=3),  # [B, H, Lk, 1]
    ]
    return ops.function("MawDepthGather", ["q_depth", "k_depth", "policy_logits"], ["q_sel", "k_sel", "depth"],
                        nodes, opset)


def _gather_plugin():
    from attnx.contract import PLUGIN_ATTRIBUTES
    from attnx.models import onnx_ops as ops

    attnx_ops = ops.opset()

    def plugin(q_depth, k_depth, policy_logits):
        return attnx_ops.MawDepthGather(q_depth, k_depth, policy_logits, **PLUGIN_ATTRIBUTES)

    return plugin


def _select_schema():
    from onnx import TensorProto

    from attnx.models import onnx_ops as ops
    from onnx.defs import OpSchema

    def infer(ctx):
        q, k = ops.rank4_inputs(ctx, 0, 1)
        elem = ctx.get_input_type(0).tensor_type.elem_type
        ctx.set_output_type(0, ops.tensor_type(elem, q[:3] + k[2:3] if q and k else None))
        ctx.set_output_type(1, ops.tensor_type(TensorProto.INT64, q[:1] if q else None))

    return ops.schema(
        "MawDepthSelect", "MAW inference (attnx 0.1 files): argmax depth per example and that depth's attention "
        "logits scale * q_depth[..., t] k_depth[..., t]^T.",
        inputs=[("q_depth", "T", "[B, H, Lq, d]"), ("k_depth", "T", "[B, H, Lk, d]"),
                ("policy_logits", "T", "[B, d]")],
        outputs=[("logits", "T", "[B, H, Lq, Lk] selected-depth logits"), ("depth", "tensor(int64)", "[B]")],
        infer=infer,
        attributes=[OpSchema.Attribute("scale", OpSchema.AttrType.FLOAT, "logit scale, 1/sqrt(Dh)", required=True)])


def _select_function(opset: int):
    from onnx import TensorProto, helper

    from attnx.models import onnx_ops as ops

    n = helper.make_node
    nodes = [
        n("Cast", ["q_depth"], ["q32"], to=TensorProto.FLOAT), n("Cast", ["k_depth"], ["k32"], to=TensorProto.FLOAT),
        n("Cast", ["policy_logits"], ["p32"], to=TensorProto.FLOAT),
        n("ArgMax", ["p32"], ["depth"], axis=1, keepdims=0),
        n("Shape", ["p32"], ["n_depth"], start=1, end=2),
        n("Constant", [], ["off_on"], value=helper.make_tensor("v", TensorProto.FLOAT, [2], [0.0, 1.0])),
        n("OneHot", ["depth", "n_depth", "off_on"], ["one_hot"], axis=-1),  # [B, d]
        n("Constant", [], ["bh_axes"], value_ints=[1, 2]), n("Unsqueeze", ["one_hot", "bh_axes"], ["w"]),
        n("Mul", ["q32", "w"], ["q_sel"]), n("Transpose", ["k32"], ["k_t"], perm=[0, 1, 3, 2]),
        n("MatMul", ["q_sel", "k_t"], ["raw"]),
        ops.attribute_ref(n("Constant", [], ["scale"]), "value_float", "scale"),
        n("Mul", ["raw", "scale"], ["logits32"]), n("CastLike", ["logits32", "q_depth"], ["logits"]),
    ]
    return ops.function("MawDepthSelect", ["q_depth", "k_depth", "policy_logits"], ["logits", "depth"], nodes,
                        opset, attributes=["scale"])


# --------------------------------------------------------------------------- the spec

SPEC = register(VariantSpec(
    name="maw",
    summary="5-D multi-perspective attention, GRPO depth selection; at inference a fused attention over the "
            "selected depth",
    config=MawConfig,
    attention=MawAttention,
    extra_outputs=(ExtraOutput("maw_depth", ("batch",), "int64", read=lambda attn: attn.last_depth,
                               doc="depth chosen by the last maw layer", margin=_policy_margin,
                               tie_margin={"fp32": 1e-4, "fp16": 2e-2, "int8": 1e-1}),),
    custom_ops=(
        CustomOp("MawDepthGather", _gather_schema, _gather_function, torch_op=torch.ops.attnx.maw_depth_gather.default,
                 plugin=_gather_plugin, doc="the selected depth's query/key columns"),
        CustomOp("MawDepthSelect", _select_schema, _select_function,
                 doc="the selected depth's logits (files exported by attnx 0.1; still built and served)"),
    ),
    placement=Placement(replace=True, exact=False, append=True, default="append"),
    cache_note="the depth of each step is chosen on the mean of every token so far: exact when appended (maw's "
               "own form) or in the last layer; in an earlier layer past tokens keep the keys and values of the "
               "depth chosen when they were generated (re-running the sequence would recompute them)",
))
