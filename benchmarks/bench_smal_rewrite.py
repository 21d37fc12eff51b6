"""SMAL attention core: the reference distance formula vs the exact rewrite (CPU, one process).

Three implementations of the same ``z = softmax(q k^T / sqrt(Dh) - gamma beta D) V``
(``D_ij = (q_i - k_j)^T T (q_i - k_j)``), given q, k, v ``[B, H, L, Dh]`` and T ``[B, 1, Dh, Dh]``:

- ``reference``: what ``SelfModulatedAttention`` runs on the reference path (``attnx.models.reference()``):
  ``attnx::tta_distance`` (the literal formula, chunked over query rows so that its
  ``[B, H, rows, Lk, Dh]`` temporaries stay below 2**25 elements), scores, softmax, ``@ V``;
- ``literal``: the same formula unchunked (``q_i - k_j`` for all pairs at once, ``[B, H, L, L, Dh]``
  three times over); skipped, with its estimated size, where that would exceed ~8 GB;
- ``rewrite``: what the default (fast) path runs: queries ``q M``, a per-key bias ``-gamma beta k^T T k``
  and one fused ``scaled_dot_product_attention`` call.

Time: best of a few runs (one run where a run takes more than a few seconds), all in this process.
Memory: peak bytes of the tensors allocated during the call (inputs excluded), tracked per aten op
with a TorchDispatchMode (storages counted once, freed when their last tensor dies). Scratch memory a
kernel allocates internally without an aten op (e.g. the fused attention kernel's per-thread blocks)
is not seen; everything the formulas themselves allocate is.

    .venv/bin/python benchmarks/bench_smal_rewrite.py [--lengths 128 256 512 1024] [--quick]
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _common, also when run from elsewhere

import torch
import torch.nn.functional as F
from _common import measure, parse_lengths, print_table, self_check_tracker

from attnx.models import build_variant
from attnx.models.smal import tta_distance
from attnx.models.hooks import run_with_cache

B, H, DH = 4, 12, 64
D_MODEL = H * DH
LITERAL_LIMIT_BYTES = 8e9


# ----------------------------------------------------------------------------- the three paths


def reference(q, k, v, trace, gb):
    """SelfModulatedAttention's reference branch (no mask): tta_distance -> scores -> softmax -> V."""
    dist = tta_distance(q, k, trace)
    scores = q @ k.transpose(-1, -2) * (1.0 / math.sqrt(DH)) - gb * dist
    return scores.softmax(-1) @ v


def literal(q, k, v, trace, gb):
    """The same formula without chunking: all (q_i - k_j) at once."""
    diff = q[:, :, :, None, :] - k[:, :, None, :, :]  # [B, H, L, L, Dh]
    t_diff = torch.einsum("bhijd,bhed->bhije", diff, trace.expand(-1, q.shape[1], -1, -1))
    dist = (diff * t_diff).sum(-1)
    scores = q @ k.transpose(-1, -2) * (1.0 / math.sqrt(DH)) - gb * dist
    return scores.softmax(-1) @ v


def rewrite(q, k, v, trace, gb):
    """SelfModulatedAttention's fast path (no mask)."""
    b, h, l, dh = q.shape
    t_sym = trace + trace.transpose(-1, -2)
    m = torch.eye(dh, dtype=q.dtype) * (1.0 / math.sqrt(dh)) + gb * t_sym  # [B, 1, Dh, Dh]
    k_t_k = ((k @ trace) * k).sum(-1)[:, :, None, :]  # [B, H, 1, Lk]
    return F.scaled_dot_product_attention(q @ m, k, v, attn_mask=(-gb * k_t_k).expand(b, h, l, l), scale=1.0)


def literal_bytes(l: int) -> float:
    return 3 * B * H * l * l * DH * 4  # diff, T diff, diff * T diff


# ----------------------------------------------------------------------------- measuring


def inputs(l: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, l, DH, generator=g) for _ in range(3))
    trace = 0.05 * torch.randn(B, 1, DH, DH, generator=g)
    gb = torch.rand(B, 1, 1, 1, generator=g)
    return q, k, v, trace, gb



def _timed(fn, args):
    """(best seconds, peak tracked bytes, output): :func:`_common.measure`."""
    seconds, tracker, out = measure(fn, args)
    return seconds, tracker.peak, out


def check_against_module() -> float:
    """The benchmark's paths compute what the module computes (explicit reference path)."""
    mod = build_variant("smal", seed=0, d_model=D_MODEL, n_heads=H, d_self=16).eval()
    g = torch.Generator().manual_seed(1)
    x, s = torch.randn(2, 24, D_MODEL, generator=g), torch.randn(2, 16, generator=g)
    trace = 0.05 * torch.randn(2, DH, DH, generator=g)
    _, cache = run_with_cache(mod, x, None, self_state=s, trace=trace)
    q, k, v = (cache[f"hook_{n}"].transpose(1, 2) for n in "qkv")
    gb = (mod.gamma * torch.sigmoid(mod.self_gate(s))).view(2, 1, 1, 1)
    z = cache["hook_z"].transpose(1, 2)
    err = 0.0
    for fn in (reference, literal, rewrite):
        err = max(err, (fn(q, k, v, trace[:, None], gb) - z).abs().max().item())
    assert err < 1e-4, err
    return err


def fmt_mb(nbytes: float) -> str:
    return f"{nbytes / 2**20:,.1f}"


def main() -> None:
    lengths = parse_lengths(__doc__.split("\n")[0])
    torch.set_grad_enabled(False)
    self_check_tracker()
    err = check_against_module()
    print(f"SMAL attention core, B={B} H={H} Dh={DH} (d_model={D_MODEL}), fp32, CPU threads={torch.get_num_threads()}")
    print(f"paths agree with the module's reference output: max |diff| = {err:.1e}")
    rows = []
    for l in lengths:
        a = inputs(l)
        t_rw, m_rw, z_rw = _timed(rewrite, a)
        t_ref, m_ref, z_ref = _timed(reference, a)
        diff = (z_ref - z_rw).abs().max().item()
        if literal_bytes(l) <= LITERAL_LIMIT_BYTES:
            t_lit, m_lit, z_lit = _timed(literal, a)
            diff = max(diff, (z_lit - z_rw).abs().max().item())
            lit = (f"{t_lit * 1e3:,.1f}", fmt_mb(m_lit), f"{t_lit / t_rw:,.0f}x")
        else:
            lit = ("skipped", f"~{literal_bytes(l) / 1e9:.1f} GB est.", "-")
        rows.append((l, f"{t_ref * 1e3:,.1f}", lit[0], f"{t_rw * 1e3:,.1f}", f"{t_ref / t_rw:,.0f}x", lit[2],
                     fmt_mb(m_ref), lit[1], fmt_mb(m_rw), m_rw, f"{diff:.1e}"))
        print(f"  L={l} done", flush=True)

    header = ("L", "reference ms", "literal ms", "rewrite ms", "ref/rewrite", "literal/rewrite",
              "ref peak MB", "literal peak MB", "rewrite peak MB", "max|z diff|")
    table = [[str(c) for c in (r[:9] + (r[10],))] for r in rows]
    print_table(header, table)
    # memory growth of the rewrite between successive lengths (O(L) -> ~2x per doubling)
    growth = [f"{rows[i][0]}->{rows[i + 1][0]}: x{rows[i + 1][9] / rows[i][9]:.2f}" for i in range(len(rows) - 1)]
    print()
    print("rewrite peak-memory growth per step of L: " + ", ".join(growth))
    print("reference = chunked attnx::tta_distance (the module's reference path); literal = unchunked "
          "formula (skipped above ~8 GB); rewrite = the default fast path (fused SDPA, no padding mask). "
          "Peak MB = tensors allocated during the call.")


if __name__ == "__main__":
    main()
