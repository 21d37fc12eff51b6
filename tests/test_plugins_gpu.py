"""The CUDA kernels through their C ABI (ctypes on the built library, PyTorch CUDA tensors) against
the PyTorch reference, fp32 and fp16, odd sizes, Lq != Lk, shared and per-head traces.

Needs an NVIDIA GPU and a CUDA build of PyTorch (skipped otherwise, with the reason). The checks
of the C ABI that need no GPU (argument validation, no crash without a driver) are at the end and
always run.
"""

from __future__ import annotations

import ctypes
import math

import pytest

from attnx.plugins import kernels

try:
    import torch

    _CUDA = torch.cuda.is_available()
    _WHY = "no CUDA device visible to PyTorch" if not _CUDA else ""
except ImportError:  # pragma: no cover - torch is a dependency
    torch = None
    _CUDA = False
    _WHY = "PyTorch is not installed"

gpu = pytest.mark.skipif(not _CUDA, reason=f"needs an NVIDIA GPU ({_WHY})")


@pytest.fixture(scope="module")
def lib(plugin_lib) -> kernels.KernelLibrary:
    return kernels.load(plugin_lib)


# ---------------------------------------------------------------------------------------- references


def maw_reference(q, k, policy, scale):
    """float64: t_b = argmax (first on ties), logits = scale * q[..., t_b] k[..., t_b]^T."""
    t = policy.double().argmax(dim=-1)  # torch.argmax returns the first maximal index
    idx_q = t.view(-1, 1, 1, 1).expand(q.shape[0], q.shape[1], q.shape[2], 1)
    idx_k = t.view(-1, 1, 1, 1).expand(k.shape[0], k.shape[1], k.shape[2], 1)
    qs = q.double().gather(-1, idx_q)  # [B, H, Lq, 1]
    ks = k.double().gather(-1, idx_k)  # [B, H, Lk, 1]
    return scale * qs @ ks.transpose(-1, -2), t


def tta_reference(q, k, trace):
    """float64, directly from the definition: (q_i - k_j)^T T (q_i - k_j)."""
    B, H = q.shape[:2]
    T = trace.double().expand(B, H, *trace.shape[2:])
    diff = q.double()[:, :, :, None, :] - k.double()[:, :, None, :, :]  # [B, H, Lq, Lk, Dh]
    return torch.einsum("bhijd,bhde,bhije->bhij", diff, T, diff)


def _rand(shape, dtype, scale=1.0, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(shape, generator=g, device="cuda", dtype=torch.float32) * scale).to(dtype)


DTYPES = [pytest.param("float32", id="fp32"), pytest.param("float16", id="fp16")]


# ---------------------------------------------------------------------------------------- MawDepthSelect

MAW_SHAPES = [  # B, H, Lq, Lk, D
    (1, 1, 1, 1, 1),
    (2, 4, 7, 9, 5),
    (3, 2, 65, 17, 3),
    (2, 3, 128, 130, 8),
    (1, 2, 17, 200, 1),
    (5, 1, 33, 64, 37),
]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", MAW_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_maw_depth_select_matches_reference(lib, shape, dtype):
    B, H, Lq, Lk, D = shape
    dt = getattr(torch, dtype)
    q = _rand((B, H, Lq, D), dt, seed=1)
    k = _rand((B, H, Lk, D), dt, seed=2)
    policy = _rand((B, D), dt, seed=3)
    scale = 1.0 / math.sqrt(16)
    logits, depth = kernels.maw_depth_select(q, k, policy, scale, library=lib)
    torch.cuda.synchronize()
    ref, t = maw_reference(q, k, policy, scale)
    assert logits.dtype == dt and tuple(logits.shape) == (B, H, Lq, Lk)
    assert depth.dtype == torch.int64 and torch.equal(depth, t)
    tol = 1e-6 if dtype == "float32" else 1e-3
    err = (logits.double() - ref).abs().max().item()
    assert err <= tol * (1.0 + ref.abs().max().item()), err


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_maw_ties_pick_the_first_depth(lib, dtype):
    dt = getattr(torch, dtype)
    policy = torch.tensor([[0.5, 2.0, 2.0, -1.0], [3.0, 3.0, 3.0, 3.0], [-5.0, -7.0, -5.0, -6.0]], device="cuda", dtype=dt)
    q = _rand((3, 2, 5, 4), dt, seed=4)
    k = _rand((3, 2, 6, 4), dt, seed=5)
    logits, depth = kernels.maw_depth_select(q, k, policy, 0.5, library=lib)
    torch.cuda.synchronize()
    assert depth.tolist() == [1, 0, 0]
    ref, _ = maw_reference(q, k, policy, 0.5)
    assert (logits.double() - ref).abs().max().item() <= 1e-3


@gpu
@pytest.mark.gpu
def test_maw_depth_is_written_when_logits_are_empty(lib):
    q = torch.empty((2, 3, 0, 4), device="cuda")
    k = torch.empty((2, 3, 5, 4), device="cuda")
    policy = torch.tensor([[0.0, 1.0, 9.0, 2.0], [7.0, 1.0, 0.0, 2.0]], device="cuda")
    logits, depth = kernels.maw_depth_select(q, k, policy, 1.0, library=lib)
    torch.cuda.synchronize()
    assert logits.numel() == 0 and depth.tolist() == [2, 0]


@gpu
@pytest.mark.gpu
def test_maw_runs_on_the_given_stream(lib):
    stream = torch.cuda.Stream()
    q = _rand((2, 2, 40, 5), torch.float32, seed=6)
    k = _rand((2, 2, 50, 5), torch.float32, seed=7)
    policy = _rand((2, 5), torch.float32, seed=8)
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        logits, depth = kernels.maw_depth_select(q, k, policy, 0.25, library=lib)
    stream.synchronize()
    ref, t = maw_reference(q, k, policy, 0.25)
    assert torch.equal(depth, t) and (logits.double() - ref).abs().max().item() <= 1e-5


# ---------------------------------------------------------------------------------------- TtaDistance

TTA_SHAPES = [  # B, H, Lq, Lk, Dh, Ht, Bt
    (1, 1, 1, 1, 1, 1, 1),
    (2, 4, 7, 9, 16, 1, 2),
    (2, 3, 65, 33, 17, 3, 2),
    (1, 2, 128, 64, 64, 1, 1),
    (3, 2, 70, 129, 33, 2, 3),
    (2, 2, 5, 300, 8, 1, 1),
    (1, 1, 64, 64, 128, 1, 1),
    (2, 1, 100, 3, 5, 1, 1),
]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", TTA_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_tta_distance_matches_reference(lib, shape, dtype):
    B, H, Lq, Lk, Dh, Ht, Bt = shape
    dt = getattr(torch, dtype)
    q = _rand((B, H, Lq, Dh), dt, seed=11)
    k = _rand((B, H, Lk, Dh), dt, seed=12)
    trace = _rand((Bt, Ht, Dh, Dh), dt, scale=1.0 / math.sqrt(Dh), seed=13)  # unit-scale distances
    dist = kernels.tta_distance(q, k, trace, library=lib)
    torch.cuda.synchronize()
    ref = tta_reference(q, k, trace)
    assert dist.dtype == dt and tuple(dist.shape) == (B, H, Lq, Lk)
    assert torch.isfinite(dist).all()
    scale = ref.abs().max().item() + 1e-6
    err = (dist.double() - ref).abs().max().item()
    tol = 1e-4 if dtype == "float32" else 2e-3
    assert err <= tol * scale, (err, scale)


@gpu
@pytest.mark.gpu
def test_tta_accepts_unbatched_and_per_example_traces(lib):
    q = _rand((2, 3, 11, 12), torch.float32, seed=21)
    k = _rand((2, 3, 13, 12), torch.float32, seed=22)
    t2 = _rand((12, 12), torch.float32, scale=0.3, seed=23)
    t3 = _rand((2, 12, 12), torch.float32, scale=0.3, seed=24)
    for trace, as4d in ((t2, t2[None, None]), (t3, t3[:, None])):
        dist = kernels.tta_distance(q, k, trace, library=lib)
        torch.cuda.synchronize()
        ref = tta_reference(q, k, as4d)
        assert (dist.double() - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()


@gpu
@pytest.mark.gpu
def test_tta_non_symmetric_trace_and_stream(lib):
    """T need not be symmetric (S = T + T^T); launches follow the caller's stream."""
    q = _rand((1, 2, 40, 24), torch.float32, seed=31)
    k = _rand((1, 2, 50, 24), torch.float32, seed=32)
    trace = torch.triu(_rand((1, 2, 24, 24), torch.float32, scale=0.2, seed=33))
    stream = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        dist = kernels.tta_distance(q, k, trace, library=lib)
    stream.synchronize()
    ref = tta_reference(q, k, trace)
    assert (dist.double() - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()


@gpu
@pytest.mark.gpu
def test_tta_rejects_a_short_workspace(lib):
    q = _rand((1, 1, 8, 8), torch.float32)
    out = torch.empty((1, 1, 8, 8), device="cuda")
    size = lib.tta_distance_workspace_size(1, 1, 1, 1, 8, 8, 8)
    ws = torch.empty((size,), dtype=torch.uint8, device="cuda")
    status = lib.tta_distance(kernels.DTYPE_FP32, q.data_ptr(), q.data_ptr(), q.data_ptr(), out.data_ptr(),
                              1, 1, 1, 1, 8, 8, 8, ws.data_ptr(), size - 1, None)
    assert status == 1  # cudaErrorInvalidValue, nothing launched


# ---------------------------------------------------------------------------------------- no GPU needed


def test_c_abi_validates_arguments_without_touching_the_gpu(lib):
    """Bad arguments are refused before any CUDA call (so this runs anywhere)."""
    assert ctypes.CDLL(str(lib.path)).attnx_kernels_abi_version() == kernels.ABI_VERSION
    invalid = 1  # cudaErrorInvalidValue
    assert lib.maw_depth_select(7, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1.0, None) == invalid  # unknown dtype
    assert lib.maw_depth_select(0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 0, 1.0, None) == invalid  # depth size 0
    assert lib.maw_depth_select(0, 0, 0, 0, 0, 0, -1, 1, 1, 1, 2, 1.0, None) == invalid
    assert lib.maw_depth_select(0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 2, 1.0, None) == 0  # empty batch: nothing to do
    assert lib.tta_distance_workspace_size(2, 4, 3, 1, 8, 8, 8) == 0  # trace batch must be 1 or B
    assert lib.tta_distance_workspace_size(2, 4, 2, 3, 8, 8, 8) == 0  # trace heads must be 1 or H
    size = lib.tta_distance_workspace_size(2, 4, 1, 4, 7, 9, 16)
    floats = 4 * 16 * 16 + 8 * 9 * 16 + 8 * 7 * 16 + 8 * 7 + 8 * 9  # S, kS, qS, qq, kk
    assert floats * 4 <= size <= floats * 4 + 5 * 256 and size % 256 == 0
    assert lib.tta_distance(5, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 0, None) == invalid  # unknown dtype
    assert lib.tta_distance(0, 0, 0, 0, 0, 2, 2, 2, 3, 4, 4, 4, 0, 0, None) == invalid  # bad trace heads
    assert lib.tta_distance(0, 0, 0, 0, 0, 2, 2, 1, 1, 0, 4, 4, 0, 0, None) == 0  # empty output
    assert lib.tta_distance(0, 0, 0, 0, 0, 1, 1, 1, 1, 4, 4, 4, 0, 0, None) == invalid  # no workspace


@pytest.mark.skipif(_CUDA, reason="checks the behaviour without a GPU")
def test_launch_without_a_driver_returns_an_error(lib):
    """No GPU/driver: a launch reports a CUDA error code instead of crashing."""
    status = lib.maw_depth_select(0, 0, 0, 0, 0, 0, 1, 1, 4, 4, 2, 1.0, None)
    assert status != 0
