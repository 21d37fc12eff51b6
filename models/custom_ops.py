"""PyTorch custom ops mirroring the ONNX ``attnx`` ops (export/ops.py).

The reference modules call these, so ``torch.export`` sees one node per op and the
exporter can translate it to ``attnx::MawDepthSelect`` / ``attnx::TtaDistance``
(plugin lowering) or to standard ONNX ops (rewrite lowering). The eager
implementations here *are* the reference definitions.
"""

from __future__ import annotations

import torch
from torch import Tensor

# Bound the naive distance's [chunk, Lk, Dh] temporary (elements) so the reference runs at long L.
_TTA_CHUNK_ELEMENTS = 1 << 25


@torch.library.custom_op("attnx::maw_depth_select", mutates_args=())
def maw_depth_select(q_depth: Tensor, k_depth: Tensor, policy_logits: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Selected-depth logits ``[B, H, Lq, Lk]`` and the depth ``[B]`` (argmax, first on ties).

    Reads only the chosen slice: ``logits = scale * q_depth[..., t] k_depth[..., t]^T``.
    """
    depth = policy_logits.argmax(dim=-1)  # [B]
    idx = depth[:, None, None, None]
    q_sel = q_depth.gather(-1, idx.expand(*q_depth.shape[:3], 1))  # [B, H, Lq, 1]
    k_sel = k_depth.gather(-1, idx.expand(*k_depth.shape[:3], 1))  # [B, H, Lk, 1]
    return (q_sel * scale) @ k_sel.transpose(-1, -2), depth


@maw_depth_select.register_fake
def _(q_depth, k_depth, policy_logits, scale):
    b, h, lq, _ = q_depth.shape
    return q_depth.new_empty(b, h, lq, k_depth.shape[2]), policy_logits.new_empty(b, dtype=torch.int64)


def _maw_depth_select_setup(ctx, inputs, output):
    q_depth, k_depth, _, scale = inputs
    ctx.save_for_backward(q_depth, k_depth, output[1])
    ctx.scale = scale


def _maw_depth_select_backward(ctx, grad_logits, _grad_depth):
    # Gradient flows into the selected slice only; the argmax (policy logits) has none.
    q_depth, k_depth, depth = ctx.saved_tensors
    idx = depth[:, None, None, None]
    q_idx, k_idx = idx.expand(*q_depth.shape[:3], 1), idx.expand(*k_depth.shape[:3], 1)
    q_sel, k_sel = q_depth.gather(-1, q_idx), k_depth.gather(-1, k_idx)
    grad_q = torch.zeros_like(q_depth).scatter(-1, q_idx, (grad_logits @ k_sel) * ctx.scale)
    grad_k = torch.zeros_like(k_depth).scatter(-1, k_idx, (grad_logits.transpose(-1, -2) @ q_sel) * ctx.scale)
    return grad_q, grad_k, None, None


maw_depth_select.register_autograd(_maw_depth_select_backward, setup_context=_maw_depth_select_setup)


@torch.library.custom_op("attnx::tta_distance", mutates_args=())
def tta_distance(q: Tensor, k: Tensor, trace: Tensor) -> Tensor:
    """``dist[b,h,i,j] = (q_i - k_j)^T T (q_i - k_j)``; trace ``[B, 1|H, Dh, Dh]``.

    The literal formula (the reference): it forms ``q_i - k_j``, chunked over
    query rows so memory stays bounded; fast paths use the expansion instead.
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


def _tta_distance_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _tta_distance_backward(ctx, grad):
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


tta_distance.register_autograd(_tta_distance_backward, setup_context=_tta_distance_setup)


def tta_distance_expanded(q: Tensor, k: Tensor, trace: Tensor) -> Tensor:
    """The same distance via ``q^T T q + k^T T k - q^T (T + T^T) k``: O(L Dh) extra memory."""
    qq = ((q @ trace) * q).sum(-1, keepdim=True)  # [B, H, Lq, 1]
    kk = ((k @ trace) * k).sum(-1)[:, :, None, :]  # [B, H, 1, Lk]
    cross = q @ (k @ (trace + trace.transpose(-1, -2))).transpose(-1, -2)  # [B, H, Lq, Lk]
    return qq + kk - cross
