"""MAW: slice-only inference, the efficient training formula vs the literal 5-D one, depth
selection, GRPO (aux_loss, by-hand value, gradients, a toy task that trains the policy),
and no rank-5 tensor on the inference path."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, str(Path(__file__).parent))
from test_models_support import D_MODEL, HEAD_DIM, N_HEADS, SMALL, gen, right_pad_mask  # noqa: E402

from attnx.models import build_encoder, build_variant  # noqa: E402
from attnx.models import maw as maw_module  # noqa: E402
from attnx.models import smal as smal_module  # noqa: E402
from attnx.models.hooks import run_with_cache  # noqa: E402
from attnx.models.maw import attention_rewards, maw_logits_5d  # noqa: E402

DEPTH = 4
SCALE = 1.0 / math.sqrt(HEAD_DIM)


def maw(seed=0, **options):
    return build_variant("maw", seed=seed, depth_dim=DEPTH, **SMALL, **options).eval()


def heads(mod, x):
    b, l, _ = x.shape
    return [lin(x).view(b, l, N_HEADS, HEAD_DIM).transpose(1, 2) for lin in (mod.W_Q, mod.W_K, mod.W_V)]


def steer_policy(mod):
    """policy_logits[t] = gelu(mean_x[t]) for t < depth: an input's mean picks its depth."""
    with torch.no_grad():
        first, last = mod.policy[0], mod.policy[2]
        first.weight.zero_()
        first.bias.zero_()
        first.weight[:D_MODEL].copy_(torch.eye(D_MODEL))
        last.weight.zero_()
        last.bias.zero_()
        for t in range(DEPTH):
            last.weight[t, t] = 1.0


def steered_inputs(depths, l=6, seed=0):
    g = gen(seed)
    x = 0.7 * torch.randn(len(depths), l, D_MODEL, generator=g)
    for b, t in enumerate(depths):
        x[b, :, t] += 3.0
    return x


def masked_softmax_by_hand(scores, mask):
    if mask is None:
        return scores.softmax(-1)
    allowed = mask.bool()[:, None, None, :]
    return torch.where(allowed, scores, float("-inf")).softmax(-1).nan_to_num(0.0)


def output_by_hand(mod, p, v):
    b, _, l, _ = v.shape
    return mod.W_O((p @ v).transpose(1, 2).reshape(b, l, D_MODEL))


# ----------------------------------------------------------------------------- inference


def test_inference_equals_attention_from_the_selected_slice_and_depths_differ():
    mod = maw()
    steer_policy(mod)
    with torch.no_grad():  # sharper per-depth patterns, so the depth visibly matters
        mod.U_q.mul_(4)
        mod.U_k.mul_(4)
    depths = [2, 0, 3, 1]
    x = steered_inputs(depths)
    mask = right_pad_mask([6, 4, 5, 2], 6)
    out, cache = run_with_cache(mod, x, mask)
    assert mod.last_depth.tolist() == depths, "different inputs must select different depths"
    q, k, v = heads(mod, x)
    p_all = []
    for b, t in enumerate(depths):
        q_t = q[b] @ mod.U_q[:, :, t:t + 1]  # [H, L, 1]: q' of depth t only
        k_t = k[b] @ mod.U_k[:, :, t:t + 1]
        p_all.append(masked_softmax_by_hand((q_t @ k_t.transpose(-1, -2) * SCALE)[None], mask[b:b + 1]))
    p = torch.cat(p_all)
    torch.testing.assert_close(cache["hook_pattern"], p, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(out, output_by_hand(mod, p, v), atol=1e-5, rtol=1e-5)
    # and each depth really gives a different function: forcing another depth changes the output
    other = maw()
    other.load_state_dict(mod.state_dict())
    with torch.no_grad():
        other.policy[2].bias[0] = 100.0  # always depth 0
    out0 = other(x, mask)
    assert other.last_depth.tolist() == [0, 0, 0, 0]
    assert (out0 - out)[0, :6].abs().max() > 1e-3
    torch.testing.assert_close((out0 - out)[1], torch.zeros(6, D_MODEL), atol=1e-6, rtol=0)


def test_policy_uses_masked_mean_of_the_input():
    mod = maw(seed=1)
    x = torch.randn(2, 5, D_MODEL, generator=gen(1))
    mask = right_pad_mask([5, 3], 5)
    pooled = torch.stack([x[0].mean(0), x[1, :3].mean(0)])
    torch.testing.assert_close(mod.policy_logits(x, mask), mod.policy(pooled), atol=1e-6, rtol=0)
    mod(x, mask)
    assert mod.last_depth.tolist() == mod.policy(pooled).argmax(-1).tolist()


def test_encoder_maw_depth_is_the_last_maw_layer_choice():
    enc = build_encoder("maw", seed=2, n_layers=2, depth_dim=DEPTH, **SMALL)
    steer_policy(enc.blocks[1].attn)
    x = torch.randn(3, 5, D_MODEL, generator=gen(2))
    out, extras = enc(x, None, return_extras=True)
    depth = extras["maw_depth"]
    assert depth.tolist() == enc.blocks[1].attn.last_depth.tolist()
    torch.testing.assert_close(out, enc(x, None), atol=0, rtol=0)


# ----------------------------------------------------------------------------- training formula


@pytest.fixture
def fixed_gumbel(monkeypatch):
    """Replace the Gumbel-softmax draw by chosen weights w [B, d]."""
    state = {}

    def fake(logits, tau=1.0, hard=False, **_):
        state["logits"] = logits
        return state["w"]

    monkeypatch.setattr(F, "gumbel_softmax", fake)
    return state


@pytest.mark.parametrize("kind", ["soft", "onehot"])
def test_training_formula_equals_literal_5d(fixed_gumbel, kind):
    mod = maw(seed=3).train()
    g = gen(3)
    x = torch.randn(3, 6, D_MODEL, generator=g)
    mask = right_pad_mask([6, 3, 5], 6)
    if kind == "soft":
        w = torch.randn(3, DEPTH, generator=g).softmax(-1)
    else:
        w = F.one_hot(torch.tensor([1, 3, 0]), DEPTH).float()
    fixed_gumbel["w"] = w
    out, cache = run_with_cache(mod, x, mask)
    q, k, v = heads(mod, x)
    qd = torch.einsum("bhld,hdt->bhlt", q, mod.U_q)
    kd = torch.einsum("bhld,hdt->bhlt", k, mod.U_k)
    a5 = maw_logits_5d(qd, kd, SCALE)
    assert a5.shape == (3, N_HEADS, 6, 6, DEPTH)
    # the literal 5-D formula, element by element for one entry
    torch.testing.assert_close(a5[1, 2, 3, 4, 2], qd[1, 2, 3, 2] * kd[1, 2, 4, 2] * SCALE)
    scores = (a5 * w[:, None, None, None, :]).sum(-1)
    torch.testing.assert_close(cache["hook_attn_scores"], scores, atol=1e-6, rtol=1e-5)
    p = masked_softmax_by_hand(scores, mask)
    torch.testing.assert_close(out, output_by_hand(mod, p, v), atol=1e-5, rtol=1e-5)
    # GRPO does not touch the forward output: the value net (only in aux_loss) gets no gradient from it
    assert mod.aux_loss is not None and mod.aux_loss.dim() == 0
    out[:, :3].sum().backward()
    assert all(p.grad is None for p in mod.value.parameters())
    if kind == "onehot":  # one-hot weights: training equals inference with that depth
        torch.testing.assert_close(scores[0], (qd[0, ..., 1:2] @ kd[0, ..., 1:2].transpose(-1, -2)) * SCALE)


def test_hard_gumbel_straight_through_is_one_hot():
    mod = maw(seed=4, hard=True).train()
    x = torch.randn(2, 5, D_MODEL, generator=gen(4))
    torch.manual_seed(0)
    _, cache = run_with_cache(mod, x, None)
    q, k, _ = heads(mod, x)
    qd = torch.einsum("bhld,hdt->bhlt", q, mod.U_q)
    kd = torch.einsum("bhld,hdt->bhlt", k, mod.U_k)
    w = F.one_hot(mod.last_depth, DEPTH).float()
    scores = (maw_logits_5d(qd, kd, SCALE) * w[:, None, None, None, :]).sum(-1)
    torch.testing.assert_close(cache["hook_attn_scores"], scores, atol=1e-6, rtol=1e-5)


# ----------------------------------------------------------------------------- GRPO


def _reward_rows(mask, causal=False):
    from attnx.models.attention import mask_bias

    l = mask.shape[1]
    bias, row_valid = mask_bias(mask, l, l, torch.float32, causal)
    return bias, row_valid & mask.bool()[:, None, :, None]  # as MawAttention passes them


def test_attention_rewards_by_hand():
    g = gen(5)
    scores = torch.randn(2, 3, 4, 4, generator=g) * 2
    bias, rows = _reward_rows(right_pad_mask([4, 2], 4))
    got = attention_rewards(scores, bias, rows, "neg_entropy")
    want = []
    for b, n in enumerate([4, 2]):
        p = scores[b, :, :n, :n].softmax(-1)  # real queries, real keys
        want.append((p * p.log()).sum(-1).mean())
    torch.testing.assert_close(got, torch.stack(want), atol=1e-6, rtol=1e-5)
    got_var = attention_rewards(scores, bias, rows, "neg_variance")
    want_var = torch.stack([-scores[b, :, :n, :n].softmax(-1).var(-1, unbiased=False).mean()
                            for b, n in enumerate([4, 2])])
    torch.testing.assert_close(got_var, want_var, atol=1e-7, rtol=1e-5)
    # causal + an all-padding example: empty rows are left out of the average, never NaN
    bias, rows = _reward_rows(right_pad_mask([3, 0], 4), causal=True)
    r = attention_rewards(scores, bias, rows, "neg_entropy")
    assert torch.isfinite(r).all() and r[1] == 0
    want0 = torch.stack([(p * p.log()).sum(-1) for p in
                         [scores[0, :, i, :i + 1].softmax(-1) for i in range(3)]]).mean()
    torch.testing.assert_close(r[0], want0, atol=1e-6, rtol=1e-5)


def test_aux_loss_is_padding_invariant():
    """An example's GRPO loss does not depend on how much right padding it carries."""
    mod = maw(seed=10).train().double()  # float64: the advantage normalisation amplifies fp32 rounding
    g = gen(10)
    x = torch.randn(1, 4, D_MODEL, generator=g, dtype=torch.float64)
    x_pad = torch.cat([x, 30 * torch.randn(1, 3, D_MODEL, generator=g, dtype=torch.float64)], dim=1)
    torch.manual_seed(5)
    mod(x, None)
    alone = mod.aux_loss
    torch.manual_seed(5)
    mod(x_pad, right_pad_mask([4], 7))
    torch.testing.assert_close(mod.aux_loss, alone, atol=1e-10, rtol=0)


def test_aux_loss_matches_grpo_by_hand():
    mod = maw(seed=6, group_size=6).train()
    x = torch.randn(3, 5, D_MODEL, generator=gen(6))
    mask = right_pad_mask([5, 4, 2], 5)
    torch.manual_seed(1234)
    mod(x, mask)
    aux = mod.aux_loss
    # replay the RNG: the Gumbel draw comes first, then the group samples
    torch.manual_seed(1234)
    logits = mod.policy_logits(x, mask)
    F.gumbel_softmax(logits, tau=mod.config.tau, hard=mod.config.hard)
    dist = torch.distributions.Categorical(logits=logits)
    samples = dist.sample((6,))  # [G, B]
    q, k, _ = heads(mod, x)
    qd = torch.einsum("bhld,hdt->bhlt", q, mod.U_q)
    kd = torch.einsum("bhld,hdt->bhlt", k, mod.U_k)
    rewards = torch.empty(6, 3)
    for gi in range(6):
        for b, n in enumerate([5, 4, 2]):
            t = samples[gi, b]
            p = (qd[b, :, :n, t, None] @ kd[b, :, :n, t, None].transpose(-1, -2) * SCALE).softmax(-1)
            rewards[gi, b] = (p * p.log()).sum(-1).mean()  # -entropy over heads and real query rows
    adv = (rewards - rewards.mean(0)) / (rewards.std(0) + 1e-6)
    policy_loss = -(adv * dist.log_prob(samples)).mean()
    value_loss = ((mod.value(torch.stack([x[b, :n].mean(0) for b, n in enumerate([5, 4, 2])])).squeeze(-1)
                   - rewards.mean(0)) ** 2).mean()
    torch.testing.assert_close(aux, policy_loss + mod.config.value_coef * value_loss, atol=1e-5, rtol=1e-4)


def test_aux_loss_trains_policy_and_value_only():
    enc = build_encoder("maw", seed=7, n_layers=2, depth_dim=DEPTH, **SMALL).train()
    x = torch.randn(4, 6, D_MODEL, generator=gen(7))
    mask = right_pad_mask([6, 5, 3, 6], 6)
    torch.manual_seed(0)
    enc(x, mask)
    aux = enc.aux_loss()
    torch.testing.assert_close(aux, enc.blocks[0].attn.aux_loss + enc.blocks[1].attn.aux_loss)
    enc.zero_grad()
    aux.backward()
    for block in enc.blocks:
        attn = block.attn
        for name, p in list(attn.policy.named_parameters()) + list(attn.value.named_parameters()):
            assert p.grad is not None and p.grad.abs().max() > 0, f"no gradient on {name}"
        assert attn.policy[2].weight.grad.abs().max() > 1e-5
    # rewards are computed without gradient: the last layer's attention weights get none from aux_loss
    # (earlier layers do, legitimately: they produce the next layer's policy input)
    last = enc.blocks[-1].attn
    for p in (last.W_Q.weight, last.W_K.weight, last.U_q, last.U_k):
        assert p.grad is None or p.grad.abs().max() == 0
    enc.eval()
    enc(x, mask)
    assert enc.aux_loss() is None and all(b.attn.aux_loss is None for b in enc.blocks)


def test_grpo_moves_policy_to_the_sharp_depth():
    """Depth 2 gives sharp (low-entropy) attention, the others uniform: GRPO on aux_loss alone
    must raise the policy's probability of depth 2 from ~1/4 to > 0.6."""
    torch.manual_seed(0)
    good = 2
    mod = maw(seed=8, group_size=8).train()
    with torch.no_grad():
        mod.U_q.zero_()
        mod.U_k.zero_()  # q' = k' = 0 on every depth but `good`: uniform attention, max entropy
        mod.U_q[:, :, good] = 3 * torch.randn(N_HEADS, HEAD_DIM)
        mod.U_k[:, :, good] = 3 * torch.randn(N_HEADS, HEAD_DIM)
    opt = torch.optim.Adam(mod.policy.parameters(), lr=3e-3)
    probe = torch.randn(64, 8, D_MODEL)

    def p_good():
        with torch.no_grad():
            return mod.policy_logits(probe, None).softmax(-1)[:, good].mean().item()

    start = p_good()
    assert 0.1 < start < 0.45
    for _ in range(100):
        mod(torch.randn(8, 8, D_MODEL), None)
        opt.zero_grad()
        mod.aux_loss.backward()
        opt.step()
    assert p_good() > 0.6, f"policy did not move toward the sharp depth: {start:.3f} -> {p_good():.3f}"
    mod.eval()
    mod(probe, None)
    assert (mod.last_depth == good).float().mean() > 0.9


# ----------------------------------------------------------------------------- no rank-5 tensors


class RankRecorder(TorchDispatchMode):
    """Record (op, rank) of every tensor produced, descending into the attnx custom ops."""

    _impls = {"attnx.maw_depth_gather.default": maw_module.maw_depth_gather._init_fn,
              "attnx.tta_distance.default": smal_module.tta_distance._init_fn}

    def __init__(self, seen=None):
        super().__init__()
        self.seen = [] if seen is None else seen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        impl = self._impls.get(str(func))
        if impl is not None:
            with RankRecorder(self.seen):  # look inside the custom op too
                out = impl(*args, **(kwargs or {}))
        else:
            out = func(*args, **(kwargs or {}))
        self.seen.extend((str(func), t.dim()) for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        return out


def test_rank_recorder_sees_a_5d_tensor():
    with RankRecorder() as rec:
        maw_logits_5d(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4), 0.5)
    assert max(r for _, r in rec.seen) == 5


@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
def test_no_rank5_tensor_is_allocated(training):
    enc = build_encoder("maw", seed=9, n_layers=2, depth_dim=DEPTH, **SMALL).train(training)
    x = torch.randn(2, 6, D_MODEL, generator=gen(9))
    mask = right_pad_mask([6, 4], 6)
    with RankRecorder() as rec:
        enc(x, mask)
    ops = {op for op, _ in rec.seen}
    if not training:
        assert "attnx.maw_depth_gather.default" in ops and "aten.gather.default" in ops
    five = [(op, r) for op, r in rec.seen if r >= 5]
    assert not five, f"rank-5 tensors produced: {five[:5]}"
