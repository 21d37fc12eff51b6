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
- ``plugin``: the same custom op, exported as ``attnx::TtaDistance`` (a TensorRT plugin).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from attnx.models.attention import AttentionBase, AttentionConfig, Mask, current_path
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

        if self.explicit or current_path() == "plugin":
            D = tta_distance(q, k, T)  # [B, H, Lq, Lk]
            scores = -D if tta else q @ k.transpose(-1, -2) * self.scale - gb * D
            return self.attend_explicit(scores, v, mask)
        T_sym = T + T.transpose(-1, -2)
        eye = torch.eye(self.head_dim, dtype=q.dtype, device=q.device)
        M = T_sym if tta else eye * self.scale + gb * T_sym  # [B, 1|H, Dh, Dh]
        kTk = ((k @ T) * k).sum(-1, keepdim=True)  # [B, H, Lk, 1]
        key_bias = -kTk if tta else -gb * kTk
        if torch.compiler.is_exporting():
            # ONNX Runtime's Attention takes no broadcast per-key bias: fold it into one more q/k
            # column, [q M, 1] . [k, bias] = q M k^T + bias; V gets a zero column too (TensorRT's
            # attention wants equal head sizes), dropped from the result.
            q_aug = torch.cat([q @ M, torch.ones_like(q[..., :1])], dim=-1)
            k_aug = torch.cat([k, key_bias], dim=-1)
            v_aug = torch.cat([v, torch.zeros_like(v[..., :1])], dim=-1)
            return self.attend_fused(q_aug, k_aug, v_aug, mask, scale=1.0)[..., :-1]
        # the per-key bias stays [B, H, 1, Lk], broadcast inside SDPA
        return self.attend_fused(q @ M, k, v, mask, extra_bias=key_bias.transpose(-1, -2), scale=1.0)


def _neutral(attn: SelfModulatedAttention) -> None:
    """gamma = 0: exactly the plain attention it replaces (mode smal)."""
    with torch.no_grad():
        attn.gamma.zero_()


# --------------------------------------------------------------------------- ONNX: the custom op

def _tta_schema():
    from attnx.export import ops

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

    from attnx.export import ops

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
    from attnx.export import ops

    attnx_ops = ops.opset()

    def plugin(q, k, trace):
        return attnx_ops.TtaDistance(q, k, trace, **PLUGIN_ATTRIBUTES)

    return plugin


# --------------------------------------------------------------------------- the spec

SPEC = register(VariantSpec(
    name="smal",
    summary="self-modulated attention with a trace-tensor distance (exact O(L) rewrite at inference)",
    config=SmalConfig,
    attention=SelfModulatedAttention,
    custom_ops=(CustomOp("TtaDistance", _tta_schema, _tta_function, torch_op=torch.ops.attnx.tta_distance.default,
                         plugin=_tta_plugin, doc="the trace-tensor distance"),),
    # fp16: the distance logits grow with L, so elements drift further than plain attention's
    # (measured worst 2.8e-2 at d_model 256, L 512; mean 7.9e-4).
    tolerances={"fp16": {"output": (5e-2, 5e-2, 2e-3)}},
    placement=Placement(neutral=_neutral),
))
