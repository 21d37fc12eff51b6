"""MAW inference: the literal 5-D formulation vs the selected-slice path (CPU, one process).

Given the depth projections q', k' ``[B, H, L, d]``, the policy logits ``[B, d]`` and v:

- ``5-D``: ``A5 = maw_logits_5d(q', k', s)`` ``[B, H, L, L, d]``, weighted by ``one_hot(argmax)``
  and summed over d, then masked softmax and ``@ V`` (what the seed's code does at inference);
- ``slice``: what ``MawAttention`` runs in eval mode: ``attnx::maw_depth_select`` reads only the
  chosen depth (``s q'[..., t] k'[..., t]^T``), then the same softmax and ``@ V``.

Columns: the logits stage alone (where the two differ) and the whole attention core. Time: best of a
few runs in this process. Memory: peak bytes of tensors allocated during the call (inputs excluded),
tracked per aten op by a TorchDispatchMode that also records the largest tensor rank produced
(the slice path must never produce a rank-5 tensor; the script fails if it does).

    .venv/bin/python benchmarks/bench_maw_inference.py [--lengths 128 256 512 1024] [--quick]
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _common, also when run from elsewhere

import torch
import torch.nn.functional as F
from _common import TensorTracker, measure, parse_lengths, print_table

from attnx.models import build_variant
from attnx.models.maw import maw_depth_gather, maw_logits_5d

B, H, DH, DEPTH = 4, 12, 64, 5
D_MODEL = H * DH
SCALE = 1.0 / math.sqrt(DH)


# ----------------------------------------------------------------------------- the two paths


def logits_5d(qd, kd, policy_logits):
    w = F.one_hot(policy_logits.argmax(-1), qd.shape[-1]).to(qd.dtype)  # [B, d]
    return (maw_logits_5d(qd, kd, SCALE) * w[:, None, None, None, :]).sum(-1)


def logits_slice(qd, kd, policy_logits):
    q_sel, k_sel, _ = maw_depth_gather(qd, kd, policy_logits)  # [B, H, L, 1]
    return (q_sel * SCALE) @ k_sel.transpose(-1, -2)


def attention_5d(qd, kd, policy_logits, v):
    return logits_5d(qd, kd, policy_logits).softmax(-1) @ v


def attention_slice(qd, kd, policy_logits, v):
    return logits_slice(qd, kd, policy_logits).softmax(-1) @ v


# ----------------------------------------------------------------------------- measuring


def inputs(l: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    qd = torch.randn(B, H, l, DEPTH, generator=g)
    kd = torch.randn(B, H, l, DEPTH, generator=g)
    logits = torch.tensor([[0.0, 2.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 3.0, 0.0],
                           [1.0, 0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 4.0]])  # depths 1, 3, 0, 4
    v = torch.randn(B, H, l, DH, generator=g)
    return qd, kd, logits, v



def check_module() -> float:
    """The eval module produces no rank-5 tensor and equals the 5-D formulation."""
    mod = build_variant("maw", seed=0, d_model=D_MODEL, n_heads=H, depth_dim=DEPTH).eval()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 32, D_MODEL, generator=g)
    with TensorTracker() as tracker:
        out = mod(x, None)
    assert tracker.max_rank <= 4, f"the eval module produced rank-5 tensors: {tracker.state['rank5_ops'][:3]}"
    q, k, v = (split.transpose(1, 2) for split in (lin(x).view(2, 32, H, DH) for lin in (mod.W_Q, mod.W_K, mod.W_V)))
    qd, kd = mod.depth_projections(q, k)
    z = attention_5d(qd, kd, mod.policy_logits(x, None), v)
    want = mod.W_O(z.transpose(1, 2).reshape(2, 32, D_MODEL))
    err = (out - want).abs().max().item()
    assert err < 1e-4, err
    return err


def main() -> None:
    lengths = parse_lengths(__doc__.split("\n")[0])
    torch.set_grad_enabled(False)
    err = check_module()
    print(f"MAW inference, B={B} H={H} Dh={DH} depth={DEPTH}, fp32, CPU threads={torch.get_num_threads()}")
    print(f"eval module == 5-D formulation: max |diff| = {err:.1e}; eval module max tensor rank: 4")
    rows = []
    for l in lengths:
        a = inputs(l)
        t5l, tr5l, out5l = measure(logits_5d, a[:3])
        tsl, trsl, outsl = measure(logits_slice, a[:3])
        t5, tr5, out5 = measure(attention_5d, a)
        ts, trs, outs = measure(attention_slice, a)
        assert trsl.max_rank <= 4 and trs.max_rank <= 4, (trsl.state["rank5_ops"], trs.state["rank5_ops"])
        assert tr5l.max_rank == 5  # the tracker does see the 5-D tensor when there is one
        diff = max((out5l - outsl).abs().max().item(), (out5 - outs).abs().max().item())
        rows.append([str(l), f"{t5l * 1e3:,.1f}", f"{tsl * 1e3:,.1f}", f"{t5l / tsl:,.1f}x",
                     f"{t5 * 1e3:,.1f}", f"{ts * 1e3:,.1f}", f"{t5 / ts:,.1f}x",
                     f"{tr5.peak / 2**20:,.1f}", f"{trs.peak / 2**20:,.1f}", f"{tr5.max_rank}/{trs.max_rank}",
                     f"{diff:.1e}"])
        print(f"  L={l} done", flush=True)
    header = ["L", "5-D logits ms", "slice logits ms", "logits speedup", "5-D attn ms", "slice attn ms",
              "attn speedup", "5-D peak MB", "slice peak MB", "max rank 5-D/slice", "max|diff|"]
    print_table(header, rows)
    print()
    print("logits = the [B, H, L, L] selected-depth logits only; attn = logits + softmax + @ V. "
          "Peak MB = tensors allocated during the call. The slice path never produced a rank-5 tensor.")


if __name__ == "__main__":
    main()
