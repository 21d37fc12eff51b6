"""``smal``: Self-Modulated Attention with Trace Tensor Attention (seed 004).

Inputs: ``self_state`` s ``[B, d_self]``; ``trace`` T ``[B, Dh, Dh]`` (shared by heads)
or ``[B, H, Dh, Dh]`` (``per_head_trace=True``); unbatched ``[Dh, Dh]`` / ``[H, Dh, Dh]``
broadcast over the batch.

    beta   = sigmoid(w_beta . s + b_beta)                       # [B]
    D_ij   = (q_i - k_j)^T T (q_i - k_j)                        # [B, H, Lq, Lk]
    S_ij   = q_i . k_j / sqrt(Dh) - gamma * beta * D_ij         # mode="smal"
    S_ij   = -D_ij                                              # mode="tta" (the seed's pure form)
    out    = softmax(S + mask) V W_O

``gamma`` is a learned scalar (``gamma_init``, default 1.0); ``gamma = 0`` makes the module
exactly ``mha`` with the same weights (the neutral value when placed in a pretrained model).

Paths (:func:`attnx.models.attention.attention_path`):

- ``fast`` (the default, what inference runs): the exact rewrite. The ``q_i^T T q_i`` term of D
  is constant across j, so ``softmax_j(S_ij) = softmax_j(q_i M k_j^T - gamma beta (k_j^T T k_j))``
  with ``M = I/sqrt(Dh) + gamma beta (T + T^T)`` (tta: ``M = T + T^T``, bias ``-k^T T k``):
  ordinary fused attention with queries ``Q M``, scale 1 and a per-key bias, O(L) memory.
- ``reference``: the literal distance (``attnx::tta_distance``, chunked so it runs at long L).
- ``plugin``: one custom op for the whole attention, ``attnx::SmalAttention``. Its function body
  (what ONNX Runtime runs, wherever the file goes) is the fast rewrite above; its TensorRT form,
  which ``attnx build-engine`` inlines before parsing, is the distance plugin ``attnx::TtaDistance``
  and an explicit softmax. (An op for the distance alone leaves ``[B, H, L, L]`` scores and their
  softmax outside it, which ONNX Runtime then runs explicitly: 1.3-1.7x mha at L = 512-2048.) Where
  the scores must be formed anyway (a hook observes them), the export has ``TtaDistance`` nodes.

Decoding with a KV cache (``attnx export --with-past``): each layer also caches the key term
``k_j^T T k_j`` of every cached key (``past_key_values.{i}.key_term [batch, heads, past]``), computed
when key j enters, under that step's trace, so a decoding step costs no pass of ``k T`` over the
whole cache. With one trace for the whole sequence (what ``attnx generate`` and the server feed:
the context inputs are per request) a cached step equals re-running the full sequence exactly; a
trace changed mid-sequence would apply to the new keys (and every query) only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnx.models.attention import AttentionBase, AttentionConfig, Mask, current_path
from attnx.models.cache import PAST, CacheEntry
from attnx.models.signature import InputSpec, check_choice
from attnx.models.spec import CustomOp, Placement, VariantSpec, register

# Bound the literal distance's [chunk, Lk, Dh] temporary (elements) so the reference runs at long L.
_TTA_CHUNK_ELEMENTS = 1 << 25


@dataclass
class SmalConfig(AttentionConfig):
    d_self: int = 32
    per_head_trace: bool = False
    gamma_init: float = 1.0
    mode: str = "smal"  # smal | tta
    use_rewrite: bool = False  # kept so attnx 0.1 files load: the rewrite is now the default fast path

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("mode", self.mode, ("smal", "tta"))
        if self.d_self <= 0:
            raise ValueError(f"d_self must be positive, got {self.d_self}")


# --------------------------------------------------------------------------- the distance (torch op)

@torch.library.custom_op("attnx::tta_distance", mutates_args=())
def tta_distance(q: Tensor, k: Tensor, trace: Tensor) -> Tensor:
    """``dist[b,h,i,j] = (q_i - k_j)^T T (q_i - k_j)``; trace ``[B, 1|H, Dh, Dh]``.

    The literal formula (the reference): it forms ``q_i - k_j``, chunked over query rows so
    memory stays bounded; fast paths use the expansion instead.
    """
    b, h, lq, dh = q.shape
    lk = k.shape[2]
    trace = trace.expand(b, h, dh, dh)
    rows = max(1, _TTA_CHUNK_ELEMENTS // max(1, b * h * lk * dh))
    out = []
    for start in range(0, lq, rows):
        diff = q[:, :, start:start + rows, None, :] - k[:, :, None, :, :]  # [B, H, r, Lk, Dh]
        t_diff = torch.einsum("bhrkd,bhed->bhrke", diff, trace)  # T (q - k)
        out.append((diff * t_diff).sum(-1))  # [B, H, r, Lk]
    return torch.cat(out, dim=2)


@tta_distance.register_fake
def _(q, k, trace):
    return q.new_empty(q.shape[0], q.shape[1], q.shape[2], k.shape[2])


def _tta_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _tta_backward(ctx, grad):
    # With d_ij = q_i - k_j and S = T + T^T:  dD/dq_i = d_ij S,  dD/dk_j = -d_ij S,  dD/dT = d_ij d_ij^T.
    # Written with row/column sums so nothing of size [Lq, Lk, Dh] is formed.
    q, k, trace = ctx.saved_tensors
    b, h, _, dh = q.shape
    t_full = trace.expand(b, h, dh, dh)
    sym = t_full + t_full.transpose(-1, -2)
    rows, cols = grad.sum(-1, keepdim=True), grad.sum(-2)[..., None]  # [B, H, Lq, 1], [B, H, Lk, 1]
    g_k, g_t_q = grad @ k, grad.transpose(-1, -2) @ q  # [B, H, Lq, Dh], [B, H, Lk, Dh]
    grad_q = (rows * q - g_k) @ sym
    grad_k = (cols * k - g_t_q) @ sym
    grad_t = ((q * rows).transpose(-1, -2) @ q + (k * cols).transpose(-1, -2) @ k
              - q.transpose(-1, -2) @ g_k - k.transpose(-1, -2) @ g_t_q)  # [B, H, Dh, Dh]
    return grad_q, grad_k, grad_t.sum_to_size(trace.shape)


tta_distance.register_autograd(_tta_backward, setup_context=_tta_setup)


def tta_distance_expanded(q: Tensor, k: Tensor, trace: Tensor) -> Tensor:
    """The same distance via ``q^T T q + k^T T k - q^T (T + T^T) k``: O(L Dh) extra memory."""
    qq = ((q @ trace) * q).sum(-1, keepdim=True)  # [B, H, Lq, 1]
    kk = ((k @ trace) * k).sum(-1)[:, :, None, :]  # [B, H, 1, Lk]
    cross = q @ (k @ (trace + trace.transpose(-1, -2))).transpose(-1, -2)  # [B, H, Lq, Lk]
    return qq + kk - cross


@torch.library.custom_op("attnx::smal_attention", mutates_args=())
def smal_attention(q: Tensor, k: Tensor, v: Tensor, trace: Tensor, gb: Tensor, bias: Tensor, scale: float) -> Tensor:
    """``softmax(scale q k^T - gb D + bias) v``, D the trace distance; tta mode is ``scale = 0, gb = 1``.
    ``gb [B|1, 1, 1, 1]``, additive ``bias [B|1, 1, Lq|1, Lk]``. Computed by the exact rewrite: softmax
    drops the row constant ``gb q^T T q``, which leaves queries ``q M`` with ``M = scale I + gb (T + T^T)``
    and the per-key bias ``-gb k^T T k``."""
    eye = torch.eye(q.shape[-1], dtype=q.dtype, device=q.device)
    m = eye * scale + gb * (trace + trace.transpose(-1, -2))  # [B, 1|H, Dh, Dh]
    key_bias = -gb * ((k @ trace) * k).sum(-1)[:, :, None, :]  # [B, H, 1, Lk]
    mask = bias + key_bias
    if mask.dtype == torch.float16:  # dtype-min plus a negative bias is -inf in fp16
        mask = mask.clamp_min(torch.finfo(mask.dtype).min)
    return F.scaled_dot_product_attention(q @ m, k, v, attn_mask=mask, scale=1.0)


@smal_attention.register_fake
def _(q, k, v, trace, gb, bias, scale):
    return q.new_empty(*q.shape[:3], v.shape[-1])


# --------------------------------------------------------------------------- the module

class SelfModulatedAttention(AttentionBase):
    def __init__(self, config: SmalConfig):
        super().__init__(config)
        self.self_gate = nn.Linear(config.d_self, 1)  # w_beta, b_beta
        self.gamma = nn.Parameter(torch.tensor(float(config.gamma_init)))

    @staticmethod
    def context_inputs(config: SmalConfig) -> list[InputSpec]:
        dh = config.head_dim
        trace_shape = ("batch", config.n_heads, dh, dh) if config.per_head_trace else ("batch", dh, dh)
        return [InputSpec("self_state", ("batch", config.d_self), "float", "context", "self state s", default="zeros"),
                InputSpec("trace", trace_shape, "float", "context", "trace tensor T (zeros: no distance term)",
                          broadcast_batch=True, default="zeros")]

    @staticmethod
    def cache_state(config: SmalConfig) -> list[CacheEntry]:
        return [CacheEntry("key_term", ("batch", config.n_heads, PAST),
                           "k^T T k of each cached key, under the trace given when the key entered")]

    def trace_heads(self, trace: Tensor, batch: int) -> Tensor:
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

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Mask, *, self_state: Tensor, trace: Tensor) -> Tensor:
        b = q.shape[0]
        T = self.trace_heads(trace, b).to(q.dtype)  # [B, 1|H, Dh, Dh]
        beta = torch.sigmoid(self.self_gate(self_state)).view(b, 1, 1, 1)  # [B, 1, 1, 1]
        gb = self.gamma * beta
        tta = self.config.mode == "tta"
        key_term = None
        if mask.cache is not None:  # a decoder's cached step: the new keys' term joins the cached ones
            new = k[:, :, k.shape[2] - q.shape[2]:]
            key_term = mask.cache.append("key_term", ((new @ T) * new).sum(-1), axis=2)  # [B, H, Lk]

        if self.explicit:
            D = tta_distance(q, k, T)  # [B, H, Lq, Lk]
            scores = -D if tta else q @ k.transpose(-1, -2) * self.scale - gb * D
            return self.attend_explicit(scores, v, mask)
        # one attnx::SmalAttention node (module doc); a cached step takes the cached key term below instead
        # (standard ops, which TensorRT builds too): the op would pass k T over every cached key each step
        if current_path() == "plugin" and key_term is None:
            bias = mask.bias if mask.bias is not None else q.new_zeros(1, 1, 1, k.shape[2])
            z = smal_attention(q, k, v, T, torch.ones_like(gb) if tta else gb, bias, 0.0 if tta else self.scale)
            return z if mask.row_valid is None else z * mask.row_valid.to(z.dtype)
        T_sym = T + T.transpose(-1, -2)
        eye = torch.eye(self.head_dim, dtype=q.dtype, device=q.device)
        M = T_sym if tta else eye * self.scale + gb * T_sym  # [B, 1|H, Dh, Dh]
        if key_term is not None:
            # Cached: the per-key bias from the cache (no pass over every key's k T). An exported file and
            # a decoding step (one query) add it as a [B, H, Lq, Lk] mask: no copy of the whole cache
            # into wider q/k/v; an eager prefill folds it (no [B, H, Lq, Lk] tensor for a long prompt).
            key_bias = (-key_term if tta else -gb.view(b, 1, 1) * key_term)[..., None]  # [B, H, Lk, 1]
            if torch.compiler.is_exporting() or q.shape[2] == 1:
                return self.attend_fused(q @ M, k, v, mask, extra_bias=key_bias.transpose(-1, -2), scale=1.0)
            return self._folded(q @ M, k, v, key_bias, mask, False)
        kTk = ((k @ T) * k).sum(-1, keepdim=True)  # [B, H, Lk, 1]
        key_bias = -kTk if tta else -gb * kTk
        exporting = torch.compiler.is_exporting()
        if exporting or (mask.bias is not None and mask.bias.shape[-2] > 1):
            return self._folded(q @ M, k, v, key_bias, mask, exporting)
        # a key-padding mask [B, 1, 1, Lk] plus the per-key bias stays [B, H, 1, Lk], broadcast inside SDPA
        return self.attend_fused(q @ M, k, v, mask, extra_bias=key_bias.transpose(-1, -2), scale=1.0)

    def _folded(self, q_m: Tensor, k: Tensor, v: Tensor, key_bias: Tensor, mask: Mask, exporting: bool) -> Tensor:
        """softmax(q_m k^T + key_bias^T + mask) v with the per-key bias ``[B, H, Lk, 1]`` folded into one
        more q/k column, [q M, 1] . [k, bias] = q M k^T + bias: ONNX Runtime's Attention takes no
        broadcast per-key bias, and in PyTorch a per-query mask (causal, windowed: [B, 1, Lq, Lk]) plus
        it would be a [B, H, Lq, Lk] tensor. V gets zero columns too (TensorRT's attention and SDPA's
        fused kernels want equal head sizes), dropped from the result; in PyTorch the widths are padded
        to a multiple of 8 so SDPA keeps its fused kernels."""
        extra = 1 if exporting else 8 - self.head_dim % 8
        q_aug = F.pad(torch.cat([q_m, torch.ones_like(q_m[..., :1])], dim=-1), (0, extra - 1))
        k_aug = F.pad(torch.cat([k, key_bias], dim=-1), (0, extra - 1))
        v_aug = F.pad(v, (0, extra))
        return self.attend_fused(q_aug, k_aug, v_aug, mask, scale=1.0)[..., :self.head_dim]


def _neutral(attn: SelfModulatedAttention) -> None:
    """gamma = 0: exactly the plain attention it replaces (mode smal)."""
    with torch.no_grad():
        attn.gamma.zero_()


# --------------------------------------------------------------------------- ONNX: the custom op

def _tta_schema():
    from attnx.models import onnx_ops as ops

    def infer(ctx):
        q, k, _ = ops.rank4_inputs(ctx, 0, 1, 2)
        elem = ctx.get_input_type(0).tensor_type.elem_type
        ctx.set_output_type(0, ops.tensor_type(elem, q[:3] + k[2:3] if q and k else None))

    return ops.schema(
        "TtaDistance", "Trace-tensor distance dist_ij = (q_i - k_j)^T T (q_i - k_j) per head.",
        inputs=[("q", "T", "[B, H, Lq, Dh] queries"), ("k", "T", "[B, H, Lk, Dh] keys"),
                ("trace", "T", "[B, 1|H, Dh, Dh] trace tensor")],
        outputs=[("dist", "T", "[B, H, Lq, Lk] distances")], infer=infer)


def _tta_function(opset: int):
    """The body via the expansion q^T T q + k^T T k - q^T (T + T^T) k (no [Lq, Lk, Dh] tensor), in fp32."""
    from onnx import TensorProto, helper

    from attnx.models import onnx_ops as ops

    n = helper.make_node
    nodes = [
        n("Cast", ["q"], ["q32"], to=TensorProto.FLOAT), n("Cast", ["k"], ["k32"], to=TensorProto.FLOAT),
        n("Cast", ["trace"], ["t32"], to=TensorProto.FLOAT),
        n("Constant", [], ["last"], value_ints=[-1]),
        n("MatMul", ["q32", "t32"], ["qT"]), n("Mul", ["qT", "q32"], ["qTq_terms"]),
        n("ReduceSum", ["qTq_terms", "last"], ["qq"], keepdims=1),  # [B, H, Lq, 1]
        n("MatMul", ["k32", "t32"], ["kT"]), n("Mul", ["kT", "k32"], ["kTk_terms"]),
        n("ReduceSum", ["kTk_terms", "last"], ["kk_col"], keepdims=1),  # [B, H, Lk, 1]
        n("Transpose", ["kk_col"], ["kk"], perm=[0, 1, 3, 2]),  # [B, H, 1, Lk]
        n("Transpose", ["t32"], ["t_t"], perm=[0, 1, 3, 2]), n("Add", ["t32", "t_t"], ["t_sym"]),  # T + T^T
        n("MatMul", ["k32", "t_sym"], ["k_sym"]), n("Transpose", ["k_sym"], ["k_sym_t"], perm=[0, 1, 3, 2]),
        n("MatMul", ["q32", "k_sym_t"], ["cross"]),  # [B, H, Lq, Lk]
        n("Add", ["qq", "kk"], ["qq_kk"]), n("Sub", ["qq_kk", "cross"], ["dist32"]),
        n("CastLike", ["dist32", "q"], ["dist"]),
    ]
    return ops.function("TtaDistance", ["q", "k", "trace"], ["dist"], nodes, opset)


def _tta_plugin():
    from attnx.contract import PLUGIN_ATTRIBUTES
    from attnx.models import onnx_ops as ops

    attnx_ops = ops.opset()

    def plugin(q, k, trace):
        return attnx_ops.TtaDistance(q, k, trace, **PLUGIN_ATTRIBUTES)

    return plugin


_SMAL_INPUTS = ["q", "k", "v", "trace", "gb", "bias"]


def _smal_schema():
    from onnx.defs import OpSchema

    from attnx.models import onnx_ops as ops

    def infer(ctx):
        q, _k, v = ops.rank4_inputs(ctx, 0, 1, 2)
        elem = ctx.get_input_type(0).tensor_type.elem_type
        ctx.set_output_type(0, ops.tensor_type(elem, q[:3] + v[3:] if q and v else None))

    return ops.schema(
        "SmalAttention", "softmax(scale q k^T - gb D + bias) v with the trace distance D_ij = (q_i - k_j)^T T (q_i - k_j).",
        inputs=[("q", "T", "[B, H, Lq, Dh] queries"), ("k", "T", "[B, H, Lk, Dh] keys"), ("v", "T", "[B, H, Lk, Dv]"),
                ("trace", "T", "[B, 1|H, Dh, Dh] trace tensor"), ("gb", "T", "[B|1, 1, 1, 1] gamma * beta"),
                ("bias", "T", "[B|1, 1, Lq|1, Lk] additive mask")],
        outputs=[("z", "T", "[B, H, Lq, Dv]")], infer=infer,
        attributes=[OpSchema.Attribute("scale", OpSchema.AttrType.FLOAT, "q.k scale (0 in tta mode)", required=True)])


def _smal_function(opset: int):
    """What ONNX Runtime runs: the fast rewrite (module doc) as one fused ``Attention`` in fp32, the per-key
    bias folded into one more q/k column (ONNX Runtime's Attention takes no per-head broadcast bias). V keeps
    its head size: ONNX Runtime's Attention takes q/k and v head sizes that differ, and a zero column on V
    (what the torch fast path exports, for TensorRT) cost ~10% more there (its product with the pattern is
    L x (Dh + 1)). Before opset 23: the same columns, explicit."""
    from onnx import TensorProto, helper

    from attnx.models import onnx_ops as ops

    n = helper.make_node
    f32 = TensorProto.FLOAT
    ints = lambda name, v: n("Constant", [], [name], value_ints=v)  # noqa: E731
    nodes = [*(n("Cast", [x], [f"{x}32"], to=f32) for x in _SMAL_INPUTS),
             ints("last", [-1]), ints("one", [1]),
             ops.attribute_ref(n("Constant", [], ["scale"]), "value_float", "scale"),
             n("Shape", ["q"], ["dh"], start=3), n("Concat", ["dh", "dh"], ["dd"], axis=0),
             n("ConstantOfShape", ["dd"], ["dd0"], value=helper.make_tensor("v", f32, [1], [0.0])),
             n("EyeLike", ["dd0"], ["eye"]), n("Mul", ["eye", "scale"], ["eye_s"]),
             n("Transpose", ["trace32"], ["t_t"], perm=[0, 1, 3, 2]), n("Add", ["trace32", "t_t"], ["t_sym"]),
             n("Mul", ["gb32", "t_sym"], ["gb_t"]), n("Add", ["eye_s", "gb_t"], ["m"]),  # M = scale I + gb (T + T^T)
             n("MatMul", ["q32", "m"], ["q_m"]),
             n("MatMul", ["k32", "trace32"], ["k_t"]), n("Mul", ["k_t", "k32"], ["k_tk"]),
             n("ReduceSum", ["k_tk", "last"], ["k_term"], keepdims=1), n("Mul", ["gb32", "k_term"], ["gb_k"]),
             n("Neg", ["gb_k"], ["key_bias"]),  # [B, H, Lk, 1]
             n("Shape", ["q"], ["q_bhl"], start=0, end=3), n("Concat", ["q_bhl", "one"], ["q_col"], axis=0),
             n("ConstantOfShape", ["q_col"], ["ones"], value=helper.make_tensor("v", f32, [1], [1.0])),
             n("Concat", ["q_m", "ones"], ["q_aug"], axis=-1), n("Concat", ["k32", "key_bias"], ["k_aug"], axis=-1)]
    if opset >= 23:
        nodes += [  # ONNX Runtime's Attention refuses a broadcast query axis: the mask is [B, 1, Lq, Lk]
            n("Shape", ["q"], ["b"], start=0, end=1), n("Shape", ["q"], ["lq"], start=2, end=3),
            n("Shape", ["k"], ["lk"], start=2, end=3), n("Concat", ["b", "one", "lq", "lk"], ["mask_shape"], axis=0),
            n("Expand", ["bias32", "mask_shape"], ["mask"]),
            n("Attention", ["q_aug", "k_aug", "v32", "mask"], ["z32"], scale=1.0)]
    else:
        nodes += [n("Transpose", ["k_aug"], ["k_aug_t"], perm=[0, 1, 3, 2]), n("MatMul", ["q_aug", "k_aug_t"], ["s"]),
                  n("Add", ["s", "bias32"], ["s_masked"]), n("Softmax", ["s_masked"], ["p"], axis=-1),
                  n("MatMul", ["p", "v32"], ["z32"])]
    nodes.append(n("CastLike", ["z32", "q"], ["z"]))
    return ops.function("SmalAttention", _SMAL_INPUTS, ["z"], nodes, opset, attributes=["scale"])


def _smal_engine_function(opset: int):
    """What TensorRT builds (``attnx build-engine`` inlines it in place of the op): the distance plugin and an
    explicit softmax, in fp32 from the scores on (as :func:`attnx.export.to_fp16` keeps softmax)."""
    from onnx import TensorProto, helper

    from attnx.contract import PLUGIN_ATTRIBUTES, DOMAIN
    from attnx.models import onnx_ops as ops

    n = helper.make_node
    nodes = [n("TtaDistance", ["q", "k", "trace"], ["dist"], name="tta_distance", domain=DOMAIN, **PLUGIN_ATTRIBUTES),
             ops.attribute_ref(n("Constant", [], ["scale32"]), "value_float", "scale"),
             n("CastLike", ["scale32", "q"], ["scale"]),
             n("Transpose", ["k"], ["k_t"], perm=[0, 1, 3, 2]), n("MatMul", ["q", "k_t"], ["qk"]),
             n("Mul", ["qk", "scale"], ["qk_s"]), n("Mul", ["gb", "dist"], ["gb_d"]), n("Sub", ["qk_s", "gb_d"], ["s"]),
             n("Cast", ["s"], ["s32"], to=TensorProto.FLOAT), n("Cast", ["bias"], ["bias32"], to=TensorProto.FLOAT),
             n("Add", ["s32", "bias32"], ["s_masked"]), n("Softmax", ["s_masked"], ["p32"], axis=-1),
             n("CastLike", ["p32", "v"], ["p"]), n("MatMul", ["p", "v"], ["z"])]
    return ops.function("SmalAttention", _SMAL_INPUTS, ["z"], nodes, opset, attributes=["scale"])


def _smal_plugin():
    from attnx.contract import PLUGIN_ATTRIBUTES
    from attnx.models import onnx_ops as ops

    attnx_ops = ops.opset()

    def plugin(q, k, v, trace, gb, bias, scale: float):
        return attnx_ops.SmalAttention(q, k, v, trace, gb, bias, scale=scale, **PLUGIN_ATTRIBUTES)

    return plugin


# --------------------------------------------------------------------------- the spec

SPEC = register(VariantSpec(
    name="smal",
    summary="self-modulated attention with a trace-tensor distance (exact O(L) rewrite at inference)",
    config=SmalConfig,
    attention=SelfModulatedAttention,
    custom_ops=(CustomOp("TtaDistance", _tta_schema, _tta_function, torch_op=torch.ops.attnx.tta_distance.default,
                         plugin=_tta_plugin, doc="the trace-tensor distance"),
                CustomOp("SmalAttention", _smal_schema, _smal_function,
                         torch_op=torch.ops.attnx.smal_attention.default, plugin=_smal_plugin,
                         engine_function=_smal_engine_function, doc="the whole attention (fast on ONNX Runtime)")),
    # fp16: the distance logits grow with L, so elements drift further than plain attention's
    # (measured worst 2.8e-2 at d_model 256, L 512; mean 7.9e-4).
    tolerances={"fp16": {"output": (5e-2, 5e-2, 2e-3)}},
    placement=Placement(neutral=_neutral),
    cache_note="a cached step equals re-running the sequence when the trace stays the same over the sequence "
               "(a key's term is computed under the trace of the step it entered)",
))
