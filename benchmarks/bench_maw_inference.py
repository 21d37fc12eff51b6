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

import argparse
import math
import time
import weakref

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from attnx.models import build_variant, custom_ops
from attnx.models.custom_ops import maw_depth_select
from attnx.models.maw import maw_logits_5d

B, H, DH, DEPTH = 4, 12, 64, 5
D_MODEL = H * DH
SCALE = 1.0 / math.sqrt(DH)


class TensorTracker(TorchDispatchMode):
    """Peak bytes of live tensors produced inside the block and the largest rank produced
    (descends into the attnx custom ops)."""

    _impls = {"attnx.tta_distance.default": custom_ops.tta_distance._init_fn,
              "attnx.maw_depth_select.default": custom_ops.maw_depth_select._init_fn}

    def __init__(self, state=None):
        super().__init__()
        self.state = state if state is not None else {"live": {}, "current": 0, "peak": 0, "max_rank": 0,
                                                      "rank5_ops": []}

    @property
    def peak(self) -> int:
        return self.state["peak"]

    @property
    def max_rank(self) -> int:
        return self.state["max_rank"]

    def _release(self, key):
        live = self.state["live"]
        nbytes, count = live[key]
        if count > 1:
            live[key] = (nbytes, count - 1)
        else:
            del live[key]
            self.state["current"] -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        impl = self._impls.get(str(func))
        if impl is not None:
            with TensorTracker(self.state):
                out = impl(*args, **(kwargs or {}))
        else:
            out = func(*args, **(kwargs or {}))
        st, live = self.state, self.state["live"]
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            st["max_rank"] = max(st["max_rank"], t.dim())
            if t.dim() >= 5:
                st["rank5_ops"].append(str(func))
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key == 0:
                continue
            if key in live:
                live[key] = (live[key][0], live[key][1] + 1)
            else:
                live[key] = (storage.nbytes(), 1)
                st["current"] += storage.nbytes()
                st["peak"] = max(st["peak"], st["current"])
            weakref.finalize(t, self._release, key)
        return out


# ----------------------------------------------------------------------------- the two paths


def logits_5d(qd, kd, policy_logits):
    w = F.one_hot(policy_logits.argmax(-1), qd.shape[-1]).to(qd.dtype)  # [B, d]
    return (maw_logits_5d(qd, kd, SCALE) * w[:, None, None, None, :]).sum(-1)


def logits_slice(qd, kd, policy_logits):
    return maw_depth_select(qd, kd, policy_logits, SCALE)[0]


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



SLOW_S = 3.0


def _repeat(fn, args, first: float, slow_s: float) -> list[float]:
    """More timed runs: none for a slow call, two for a medium one, and for a fast one as many as fit
    in ~1.5 s (at most 30); the minimum is reported (the machine may be shared)."""
    times = [first]
    if first > slow_s:
        return times
    budget, limit = (1.5, 30) if first < 0.3 else (0.0, 2)
    spent = 0.0
    while len(times) <= limit and (spent < budget or len(times) <= 2):
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
        spent += times[-1]
    return times


def measure(fn, args):
    with TensorTracker() as tracker:
        t0 = time.perf_counter()
        out = fn(*args)
        first = time.perf_counter() - t0
    times = _repeat(fn, args, first, SLOW_S)
    return min(times), tracker, out


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
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 256, 512, 1024])
    ap.add_argument("--quick", action="store_true", help="L = 64, 128 only (smoke test)")
    args = ap.parse_args()
    lengths = [64, 128] if args.quick else args.lengths
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
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print()
    print("  ".join(h.rjust(w) for h, w in zip(header, widths)))
    for r in rows:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
    print()
    print("logits = the [B, H, L, L] selected-depth logits only; attn = logits + softmax + @ V. "
          "Peak MB = tensors allocated during the call. The slice path never produced a rank-5 tensor.")


if __name__ == "__main__":
    main()
