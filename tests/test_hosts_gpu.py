"""Variants placed in transformers-hosted families, run by PyTorch on a GPU in fp16 and bf16, against
the same model in fp32 on the CPU along the reference path (variants.md's literal formulas).

What this catches that the CPU suite cannot: the fused kernels SDPA picks on CUDA (flash, memory-
efficient) with attnx's masks and folded q/k columns (smal's padded head width), GQA through
``enable_gqa``, and the half-precision paths. Needs an NVIDIA GPU (skipped otherwise, with the reason);
run on the GPU machine by ``tools/gpu_checks.sh``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from hf_folders import make_folder, move_off_neutral, placed_feeds  # noqa: E402

pytestmark = pytest.mark.gpu

VARIANTS = ["mha", "cultural", "metaphor", "maw", "smal"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hosts-gpu")
    return {f: make_folder(f, root) for f in ("llama", "modernbert")}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("family", ["llama", "modernbert"])
def test_placed_variant_on_cuda_equals_the_fp32_reference(folders, family, variant, dtype):
    from attnx import pretrained
    from attnx.models import reference

    model = pretrained.load(folders[family], variant).eval()
    move_off_neutral(model, seed=len(variant))
    feeds = placed_feeds(model, batch=4, seq=40)
    with torch.inference_mode(), reference():
        want = model.forward_named(feeds)
    gpu = model.to(device="cuda", dtype=getattr(torch, dtype))
    cast = {k: (v.to("cuda", getattr(torch, dtype)) if v.is_floating_point() else v.to("cuda"))
            for k, v in feeds.items()}
    with torch.inference_mode():
        got = gpu.forward_named(cast)
    rows = feeds["attention_mask"].bool()
    for name, ref in want.items():
        out = got[name].float().cpu()
        if ref.dim() >= 2 and ref.shape[:2] == rows.shape:  # per token: padded positions are not compared
            ref, out = ref[rows], out[rows]
        if not ref.is_floating_point():  # maw's selected depth: the same decision
            assert torch.equal(out.to(ref.dtype), ref), name
            continue
        scale = ref.abs().max().item()
        err = (out - ref).abs().max().item()
        # half precision through two layers and a head; bf16 keeps 3 fewer mantissa bits than fp16
        # (the same models in bf16 on the CPU: at most 6% of the largest value)
        assert err <= (2e-2 if dtype == "float16" else 1e-1) * scale, (name, err, scale)
