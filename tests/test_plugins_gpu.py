"""The CUDA kernels through their C ABI (ctypes on the built library, PyTorch CUDA tensors) against
the PyTorch reference (float64), fp32 and fp16: MawDepthSelect, MawDepthGather, TtaDistance;
odd sequence lengths (1, 7, 129, 1000), batch 1 and 16, Lq != Lk, shared / per-head / per-example
traces, ties and NaN in the policy, empty outputs, streams, non-contiguous inputs.

Every output is poisoned (NaN, or -7 for depth) before the launch so an element the kernel does
not write fails the comparison; inputs are fresh random draws (never zeros).

Needs an NVIDIA GPU and a CUDA build of PyTorch (skipped otherwise, with the reason). The
``sanitizer`` cases are small shapes covering every code path (vector and scalar stores, tile
tails, several Dh slices); they are what runs under compute-sanitizer (see docs/gpu.md). The
checks of the C ABI that need no GPU are at the end and always run.
"""

from __future__ import annotations

import ctypes
import math

import pytest

from attnx.plugins import kernels
from support import probes

import torch


@pytest.fixture(scope="module")
def lib(plugin_lib) -> kernels.KernelLibrary:
    return kernels.load(plugin_lib)


# ---------------------------------------------------------------------------------------- references


def _selected(q, k, policy):
    """float64 columns of the argmax depth (torch.argmax: first maximum, NaN wins)."""
    t = policy.double().argmax(dim=-1)
    qs = q.double().gather(-1, t.view(-1, 1, 1, 1).expand(q.shape[0], q.shape[1], q.shape[2], 1))
    ks = k.double().gather(-1, t.view(-1, 1, 1, 1).expand(k.shape[0], k.shape[1], k.shape[2], 1))
    return qs, ks, t


def maw_reference(q, k, policy, scale):
    """float64: t_b = argmax (first on ties), logits = scale * q[..., t_b] k[..., t_b]^T."""
    qs, ks, t = _selected(q, k, policy)
    return scale * qs @ ks.transpose(-1, -2), t


def tta_reference(q, k, trace):
    """float64 (q_i - k_j)^T T (q_i - k_j): from the definition for small shapes, else the expansion
    qq + kk - q (T + T^T) k^T in float64 (exact to ~1e-15 relative, independent of the kernel's fp32)."""
    B, H = q.shape[:2]
    T = trace.double().expand(B, H, *trace.shape[2:])
    q64, k64 = q.double(), k.double()
    if q.shape[2] * k.shape[2] * q.shape[3] * B * H <= 2e7:
        diff = q64[:, :, :, None, :] - k64[:, :, None, :, :]  # [B, H, Lq, Lk, Dh]
        return torch.einsum("bhijd,bhde,bhije->bhij", diff, T, diff)
    qq = ((q64 @ T) * q64).sum(-1, keepdim=True)
    kk = ((k64 @ T) * k64).sum(-1).unsqueeze(-2)
    return qq + kk - q64 @ (T + T.transpose(-1, -2)) @ k64.transpose(-1, -2)


_SEED = [1000]


def _rand(shape, dtype, scale=1.0):
    """Fresh normal draws (a new seed per call, reproducible per run order)."""
    _SEED[0] += 1
    g = torch.Generator(device="cuda").manual_seed(_SEED[0])
    return (torch.randn(shape, generator=g, device="cuda", dtype=torch.float32) * scale).to(dtype)


def _poisoned(shape, dtype):
    return torch.full(shape, float("nan"), device="cuda", dtype=dtype)


def _poisoned_depth(B):
    return torch.full((B,), -7, device="cuda", dtype=torch.int64)


def _rel_err(out, ref) -> float:
    """max |out - ref| / (max |ref| + tiny); NaN (an unwritten or broken element) -> inf."""
    diff = (out.double() - ref).abs()
    if not torch.isfinite(diff).all():
        return math.inf
    return diff.max().item() / (ref.abs().max().item() + 1e-30) if diff.numel() else 0.0


DTYPES = [pytest.param("float32", id="fp32"), pytest.param("float16", id="fp16")]
TOL = {"float32": 1e-5, "float16": 2e-3}  # of max |ref|; fp16 I/O rounds at 2^-11 relative
TTA_TOL = {"float32": 1e-4, "float16": 2e-3}


# ---------------------------------------------------------------------------------------- MawDepthSelect

MAW_SHAPES = [  # B, H, Lq, Lk, D
    (1, 1, 1, 1, 1),
    (1, 2, 7, 7, 5),
    (16, 2, 7, 129, 5),
    (2, 4, 129, 7, 3),
    (1, 3, 1000, 1000, 5),
    (16, 1, 129, 1000, 8),
    (3, 2, 65, 17, 37),
    (2, 3, 128, 256, 8),  # multiples of the vector width: 16-byte stores
    (1, 2, 1000, 1, 1),
]


def _check_maw_select(lib, shape, dtype, scale=0.25):
    B, H, Lq, Lk, D = shape
    dt = getattr(torch, dtype)
    q, k, policy = _rand((B, H, Lq, D), dt), _rand((B, H, Lk, D), dt), _rand((B, D), dt)
    out, depth = _poisoned((B, H, Lq, Lk), dt), _poisoned_depth(B)
    logits, depth = kernels.maw_depth_select(q, k, policy, scale, out=out, depth=depth, library=lib)
    torch.cuda.synchronize()
    ref, t = maw_reference(q, k, policy, scale)
    assert logits.dtype == dt and tuple(logits.shape) == (B, H, Lq, Lk)
    assert depth.dtype == torch.int64 and torch.equal(depth, t)
    err = _rel_err(logits, ref)
    assert err <= TOL[dtype], err


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", MAW_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_maw_depth_select_matches_reference(lib, shape, dtype):
    _check_maw_select(lib, shape, dtype, scale=1.0 / math.sqrt(16))


def _tie_policy(dt):
    return torch.tensor([[0.5, 2.0, 2.0, -1.0], [3.0, 3.0, 3.0, 3.0], [-5.0, -7.0, -5.0, -6.0],
                         [1.0, float("nan"), 9.0, float("nan")]], device="cuda", dtype=dt)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_maw_ties_pick_the_first_depth_and_nan_wins(lib, dtype):
    dt = getattr(torch, dtype)
    policy = _tie_policy(dt)
    q, k = _rand((4, 2, 5, 4), dt), _rand((4, 2, 6, 4), dt)
    logits, depth = kernels.maw_depth_select(q, k, policy, 0.5, library=lib)
    torch.cuda.synchronize()
    assert depth.tolist() == [1, 0, 0, 1] == policy.argmax(-1).tolist()
    ref, _ = maw_reference(q, k, policy, 0.5)
    assert _rel_err(logits, ref) <= 1e-3


@pytest.mark.gpu
def test_maw_depth_is_written_when_logits_are_empty(lib):
    q = torch.empty((2, 3, 0, 4), device="cuda")
    k = _rand((2, 3, 5, 4), torch.float32)
    policy = torch.tensor([[0.0, 1.0, 9.0, 2.0], [7.0, 1.0, 0.0, 2.0]], device="cuda")
    logits, depth = kernels.maw_depth_select(q, k, policy, 1.0, depth=_poisoned_depth(2), library=lib)
    torch.cuda.synchronize()
    assert logits.numel() == 0 and depth.tolist() == [2, 0]


@pytest.mark.gpu
def test_maw_runs_on_the_given_stream(lib):
    stream = torch.cuda.Stream()
    q, k, policy = _rand((2, 2, 40, 5), torch.float32), _rand((2, 2, 50, 5), torch.float32), _rand((2, 5), torch.float32)
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        logits, depth = kernels.maw_depth_select(q, k, policy, 0.25, library=lib)
    stream.synchronize()
    ref, t = maw_reference(q, k, policy, 0.25)
    assert torch.equal(depth, t) and _rel_err(logits, ref) <= 1e-6


# ---------------------------------------------------------------------------------------- MawDepthGather


def _check_maw_gather(lib, shape, dtype):
    B, H, Lq, Lk, D = shape
    dt = getattr(torch, dtype)
    q, k, policy = _rand((B, H, Lq, D), dt), _rand((B, H, Lk, D), dt), _rand((B, D), dt)
    q_sel, k_sel, depth = kernels.maw_depth_gather(
        q, k, policy, q_sel=_poisoned((B, H, Lq, 1), dt), k_sel=_poisoned((B, H, Lk, 1), dt),
        depth=_poisoned_depth(B), library=lib)
    torch.cuda.synchronize()
    qs, ks, t = _selected(q, k, policy)
    assert q_sel.dtype == dt and k_sel.dtype == dt and depth.dtype == torch.int64
    assert tuple(q_sel.shape) == (B, H, Lq, 1) and tuple(k_sel.shape) == (B, H, Lk, 1)
    assert torch.equal(depth, t)
    # A gather is exact: the selected elements, bit for bit.
    assert torch.equal(q_sel.double(), qs) and torch.equal(k_sel.double(), ks)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", MAW_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_maw_depth_gather_matches_reference(lib, shape, dtype):
    _check_maw_gather(lib, shape, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_ties_nan_and_its_product_is_the_select_logits(lib, dtype):
    dt = getattr(torch, dtype)
    policy = _tie_policy(dt)
    q, k = _rand((4, 3, 9, 4), dt), _rand((4, 3, 11, 4), dt)
    q_sel, k_sel, depth = kernels.maw_depth_gather(q, k, policy, library=lib)
    logits, depth2 = kernels.maw_depth_select(q, k, policy, 1.0, library=lib)
    torch.cuda.synchronize()
    assert depth.tolist() == depth2.tolist() == [1, 0, 0, 1]
    # The rank-one contract: q_sel k_sel^T is MawDepthSelect's (unscaled) logits.
    assert _rel_err(logits, q_sel.double() @ k_sel.double().transpose(-1, -2)) <= TOL[dtype]


@pytest.mark.gpu
def test_gather_depth_is_written_when_outputs_are_empty(lib):
    policy = torch.tensor([[0.0, 1.0, 9.0], [7.0, 1.0, 0.0], [0.0, 0.0, 1.0]], device="cuda")
    q = torch.empty((3, 2, 0, 3), device="cuda")
    k = torch.empty((3, 2, 0, 3), device="cuda")
    q_sel, k_sel, depth = kernels.maw_depth_gather(q, k, policy, depth=_poisoned_depth(3), library=lib)
    torch.cuda.synchronize()
    assert q_sel.numel() == 0 and k_sel.numel() == 0 and depth.tolist() == [2, 0, 2]


@pytest.mark.gpu
def test_gather_many_examples(lib):
    """More examples than one grid row: the kernel strides over the batch."""
    _check_maw_gather(lib, (70000, 1, 2, 3, 4), "float32")


# ---------------------------------------------------------------------------------------- TtaDistance

TTA_SHAPES = [  # B, H, Lq, Lk, Dh, Ht, Bt
    (1, 1, 1, 1, 1, 1, 1),
    (2, 4, 7, 9, 16, 1, 2),        # shared over heads, per example
    (2, 3, 65, 33, 17, 3, 2),      # per head and example
    (1, 2, 128, 64, 64, 1, 1),
    (3, 2, 70, 129, 33, 2, 3),
    (16, 2, 7, 129, 16, 2, 1),     # batch 16, per-head trace shared over the batch
    (16, 1, 129, 7, 8, 1, 16),
    (1, 2, 1000, 1000, 64, 2, 1),
    (1, 1, 1000, 129, 64, 1, 1),
    (2, 2, 5, 300, 8, 1, 1),
    (1, 1, 64, 64, 128, 1, 1),     # two prep column chunks, four Dh slices
    (2, 1, 100, 3, 5, 1, 1),
    (1, 2, 129, 1000, 96, 1, 1),
    (8, 4, 256, 2050, 16, 4, 1),   # fp16 fast path: several k tiles per block, partial last chunk, scalar stores
    (8, 2, 300, 2048, 64, 1, 8),   # ... and 16-byte stores
    (2, 3, 130, 77, 24, 3, 2),     # fp16 one-trip prep with Dh < 64: zero-padded x and T, row tails
]


def _check_tta(lib, shape, dtype, trace_scale=None):
    B, H, Lq, Lk, Dh, Ht, Bt = shape
    dt = getattr(torch, dtype)
    q, k = _rand((B, H, Lq, Dh), dt), _rand((B, H, Lk, Dh), dt)
    trace = _rand((Bt, Ht, Dh, Dh), dt, scale=trace_scale or 1.0 / math.sqrt(Dh))  # unit-scale distances
    dist = kernels.tta_distance(q, k, trace, out=_poisoned((B, H, Lq, Lk), dt), library=lib)
    torch.cuda.synchronize()
    ref = tta_reference(q, k, trace)
    assert dist.dtype == dt and tuple(dist.shape) == (B, H, Lq, Lk)
    err = _rel_err(dist, ref)
    assert err <= TTA_TOL[dtype], err


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", TTA_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_tta_distance_matches_reference(lib, shape, dtype):
    _check_tta(lib, shape, dtype)


@pytest.mark.gpu
def test_tta_accepts_unbatched_and_per_example_traces(lib):
    q, k = _rand((2, 3, 11, 12), torch.float32), _rand((2, 3, 13, 12), torch.float32)
    t2, t3 = _rand((12, 12), torch.float32, scale=0.3), _rand((2, 12, 12), torch.float32, scale=0.3)
    for trace, as4d in ((t2, t2[None, None]), (t3, t3[:, None])):
        dist = kernels.tta_distance(q, k, trace, library=lib)
        torch.cuda.synchronize()
        assert _rel_err(dist, tta_reference(q, k, as4d)) <= 1e-5


@pytest.mark.gpu
def test_tta_non_symmetric_trace_and_stream(lib):
    """T need not be symmetric (S = T + T^T); launches follow the caller's stream."""
    q, k = _rand((1, 2, 40, 24), torch.float32), _rand((1, 2, 50, 24), torch.float32)
    trace = torch.triu(_rand((1, 2, 24, 24), torch.float32, scale=0.2))
    stream = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        dist = kernels.tta_distance(q, k, trace, library=lib)
    stream.synchronize()
    assert _rel_err(dist, tta_reference(q, k, trace)) <= 1e-5


@pytest.mark.gpu
def test_tta_fp32_is_not_tf32_accurate_only(lib):
    """3xTF32: fp32 results within ~1e-6 of float64, far below plain TF32's ~1e-3."""
    q, k = _rand((1, 2, 200, 64), torch.float32), _rand((1, 2, 300, 64), torch.float32)
    trace = _rand((1, 2, 64, 64), torch.float32, scale=0.125)
    dist = kernels.tta_distance(q, k, trace, library=lib)
    torch.cuda.synchronize()
    assert _rel_err(dist, tta_reference(q, k, trace)) <= 2e-6


@pytest.mark.gpu
def test_tta_rejects_a_short_workspace(lib):
    q = _rand((1, 1, 8, 8), torch.float32)
    out = torch.empty((1, 1, 8, 8), device="cuda")
    size = lib.tta_distance_workspace_size(1, 1, 1, 1, 8, 8, 8)
    ws = torch.empty((size,), dtype=torch.uint8, device="cuda")
    status = lib.tta_distance(kernels.DTYPE_FP32, q.data_ptr(), q.data_ptr(), q.data_ptr(), out.data_ptr(),
                              1, 1, 1, 1, 8, 8, 8, ws.data_ptr(), size - 1, None)
    assert status == 1  # cudaErrorInvalidValue, nothing launched


@pytest.mark.gpu
@pytest.mark.parametrize("offset", ["k", "trace", "q"])
def test_tta_fp16_unaligned_inputs_take_the_general_kernels(lib, offset):
    """fp16 inputs 2 bytes off a 16-byte boundary (slices of larger buffers): k or trace moves the
    prep to the general kernel (the distance pass stays on the fast path), q both launches."""
    B, H, Lq, Lk, D = 2, 2, 70, 136, 32
    shapes = {"q": (B, H, Lq, D), "k": (B, H, Lk, D), "trace": (1, H, D, D)}
    t = {}
    for name, shape in shapes.items():
        n = math.prod(shape)
        buf = _rand((n + 1,), torch.float16, scale=1.0 / math.sqrt(D) if name == "trace" else 1.0)
        t[name] = (buf[1:] if name == offset else buf[:n]).view(shape)
    assert t[offset].data_ptr() % 16 != 0
    dist = kernels.tta_distance(t["q"], t["k"], t["trace"], out=_poisoned((B, H, Lq, Lk), torch.float16), library=lib)
    torch.cuda.synchronize()
    assert _rel_err(dist, tta_reference(t["q"], t["k"], t["trace"])) <= TTA_TOL["float16"]


# ---------------------------------------------------------------------------------------- layouts


@pytest.mark.gpu
def test_non_contiguous_inputs_are_refused_by_name_and_their_dense_copies_work(lib):
    """The plugins get dense linear tensors from TensorRT; the bindings refuse a strided view with a
    message naming it, and its .contiguous() copy gives the reference result."""
    B, L, H, D = 2, 33, 3, 5
    qv = _rand((B, L, H, D), torch.float32).transpose(1, 2)  # [B, H, L, D] view, not contiguous
    kv = _rand((B, L, H, D), torch.float32).transpose(1, 2)
    policy = _rand((B, D), torch.float32)
    with pytest.raises(ValueError, match=r"q_depth must be contiguous .* q_depth\.contiguous\(\)"):
        kernels.maw_depth_select(qv, kv, policy, 1.0, library=lib)
    with pytest.raises(ValueError, match="k_depth must be contiguous"):
        kernels.maw_depth_gather(qv.contiguous(), kv, policy, library=lib)
    with pytest.raises(ValueError, match="q must be contiguous"):
        kernels.tta_distance(qv, kv.contiguous(), _rand((D, D), torch.float32), library=lib)
    q, k = qv.contiguous(), kv.contiguous()
    logits, _ = kernels.maw_depth_select(q, k, policy, 1.0, library=lib)
    q_sel, k_sel, _ = kernels.maw_depth_gather(q, k, policy, library=lib)
    trace = _rand((1, 1, D, D), torch.float32).transpose(-1, -2)  # a transposed trace is copied by the binding
    dist = kernels.tta_distance(q, k, trace, library=lib)
    torch.cuda.synchronize()
    assert _rel_err(logits, maw_reference(qv, kv, policy, 1.0)[0]) <= 1e-6
    assert torch.equal(q_sel.double(), _selected(qv, kv, policy)[0])
    assert _rel_err(dist, tta_reference(qv, kv, trace)) <= 1e-5


@pytest.mark.gpu
def test_unaligned_outputs_take_the_scalar_path(lib):
    """An output that starts off a 16-byte boundary (a slice of a larger buffer) is still right."""
    q, k, policy = _rand((1, 2, 9, 3), torch.float16), _rand((1, 2, 16, 3), torch.float16), _rand((1, 3), torch.float16)
    buf = _poisoned((1 * 2 * 9 * 16 + 1,), torch.float16)
    out = buf[1:].view(1, 2, 9, 16)  # 2-byte offset
    logits, _ = kernels.maw_depth_select(q, k, policy, 0.5, out=out, library=lib)
    qt, kt = _rand((1, 2, 9, 8), torch.float16), _rand((1, 2, 16, 8), torch.float16)
    dist = kernels.tta_distance(qt, kt, _rand((8, 8), torch.float16, scale=0.3),
                                out=_poisoned((1 * 2 * 9 * 16 + 1,), torch.float16)[1:].view(1, 2, 9, 16), library=lib)
    torch.cuda.synchronize()
    assert _rel_err(logits, maw_reference(q, k, policy, 0.5)[0]) <= 2e-3
    assert torch.isfinite(dist).all()


# ---------------------------------------------------------------------------------------- sanitizer set

SANITIZER_CASES = [  # (op, shape) small shapes that reach every branch: tails, vector/scalar, Dh slices
    ("select", (1, 1, 1, 1, 1)), ("select", (2, 3, 67, 130, 5)), ("select", (2, 2, 65, 256, 3)),
    ("gather", (1, 1, 1, 1, 1)), ("gather", (3, 2, 129, 7, 5)), ("gather", (2, 1, 0, 9, 4)),
    ("tta", (1, 1, 1, 1, 1, 1, 1)), ("tta", (2, 2, 129, 65, 33, 2, 1)), ("tta", (1, 2, 130, 64, 72, 1, 1)),
    ("tta", (2, 1, 7, 9, 5, 1, 2)), ("tta", (2, 2, 33, 70, 64, 2, 1)), ("tta", (8, 4, 256, 2048, 16, 1, 8)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", SANITIZER_CASES, ids=lambda c: c[0] + "-" + "x".join(map(str, c[1])))
def test_sanitizer_cases(lib, case, dtype):
    op, shape = case
    if op == "select":
        _check_maw_select(lib, shape, dtype)
    elif op == "gather":
        if 0 in shape:
            B, H, Lq, Lk, D = shape
            dt = getattr(torch, dtype)
            q, k, policy = torch.empty((B, H, Lq, D), device="cuda", dtype=dt), _rand((B, H, Lk, D), dt), _rand((B, D), dt)
            _, k_sel, depth = kernels.maw_depth_gather(q, k, policy, library=lib)
            torch.cuda.synchronize()
            assert torch.equal(depth, policy.argmax(-1)) and torch.equal(k_sel.double(), _selected(q, k, policy)[1])
        else:
            _check_maw_gather(lib, shape, dtype)
    else:
        _check_tta(lib, shape, dtype)


# ---------------------------------------------------------------------------------------- no GPU needed


def test_c_abi_validates_arguments_without_touching_the_gpu(lib):
    """Bad arguments are refused before any CUDA call (so this runs anywhere)."""
    assert ctypes.CDLL(str(lib.path)).attnx_kernels_abi_version() == kernels.ABI_VERSION == 2
    invalid = 1  # cudaErrorInvalidValue
    assert lib.maw_depth_select(7, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1.0, None) == invalid  # unknown dtype
    assert lib.maw_depth_select(0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 0, 1.0, None) == invalid  # depth size 0
    assert lib.maw_depth_select(0, 0, 0, 0, 0, 0, -1, 1, 1, 1, 2, 1.0, None) == invalid
    assert lib.maw_depth_select(0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 2, 1.0, None) == 0  # empty batch: nothing to do
    assert lib.maw_depth_gather(7, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, None) == invalid  # unknown dtype
    assert lib.maw_depth_gather(0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 0, None) == invalid  # depth size 0
    assert lib.maw_depth_gather(1, 0, 0, 0, 0, 0, 0, 1, -1, 1, 1, 2, None) == invalid
    assert lib.maw_depth_gather(1, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 2, None) == 0  # empty batch
    assert lib.tta_distance_workspace_size(2, 4, 3, 1, 8, 8, 8) == 0  # trace batch must be 1 or B
    assert lib.tta_distance_workspace_size(2, 4, 2, 3, 8, 8, 8) == 0  # trace heads must be 1 or H
    size = lib.tta_distance_workspace_size(2, 4, 1, 4, 7, 9, 16)
    floats = 8 * 9 * 16 + 8 * 7 + 8 * 9  # kS (fp32, or fp16 hi + lo), qq, kk
    assert floats * 4 <= size <= floats * 4 + 4 * 256 and size % 256 == 0
    assert lib.tta_distance(5, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 0, None) == invalid  # unknown dtype
    assert lib.tta_distance(0, 0, 0, 0, 0, 2, 2, 2, 3, 4, 4, 4, 0, 0, None) == invalid  # bad trace heads
    assert lib.tta_distance(0, 0, 0, 0, 0, 2, 2, 1, 1, 0, 4, 4, 0, 0, None) == 0  # empty output
    assert lib.tta_distance(0, 0, 0, 0, 0, 1, 1, 1, 1, 4, 4, 4, 0, 0, None) == invalid  # no workspace


@pytest.mark.skipif(probes.gpu() is None, reason="a GPU is present: this checks the behaviour without one")
def test_launch_without_a_driver_returns_an_error(lib):
    """No GPU/driver: a launch reports a CUDA error code instead of crashing."""
    assert lib.maw_depth_select(0, 0, 0, 0, 0, 0, 1, 1, 4, 4, 2, 1.0, None) != 0
    assert lib.maw_depth_gather(0, 0, 0, 0, 0, 0, 0, 1, 1, 4, 4, 2, None) != 0
