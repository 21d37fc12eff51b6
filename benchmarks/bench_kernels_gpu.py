"""GPU timings of the attnx plugin kernels (through their C ABI) against PyTorch on the same GPU.

- MawDepthSelect vs PyTorch eager (argmax, gather the selected depth slice, outer product).
- TtaDistance vs PyTorch eager (the same expansion: two small matmuls, the cross GEMM, sums)
  and vs one cuBLAS GEMM (``torch.matmul``) of the same Lq x Lk x Dh, the floor for any
  GEMM-shaped kernel: "x GEMM" is our time over that GEMM's.

Prints a table of milliseconds and ratios (ratio < 1: the kernel is faster). Skips cleanly
(exit status 0) without a CUDA GPU. Run: ``python benchmarks/bench_kernels_gpu.py [--quick]``.
"""

from __future__ import annotations

import argparse
import math
import sys


def _cuda_or_skip():
    try:
        import torch
    except ImportError:
        print("bench_kernels_gpu: skipped (PyTorch is not installed)")
        return None
    if not torch.cuda.is_available():
        print("bench_kernels_gpu: skipped (no CUDA GPU visible to PyTorch)")
        return None
    return torch


def _time(torch, fn, *, warmup: int = 5, iters: int = 30) -> float:
    """Median milliseconds per call, CUDA events on the current stream."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes and iterations")
    args = parser.parse_args(argv)
    torch = _cuda_or_skip()
    if torch is None:
        return 0

    from attnx import plugins
    from attnx.plugins import kernels

    path = plugins.library_path()
    if path is None:
        print("building the plugin library first (attnx plugins build)...")
        path = plugins.build()
    lib = kernels.load(path)
    iters = 10 if args.quick else 30
    props = torch.cuda.get_device_properties(0)
    print(f"GPU: {props.name} (sm{props.major}{props.minor}), torch {torch.__version__}, library {path}")
    torch.backends.cuda.matmul.allow_tf32 = False  # compare fp32 with fp32 (our kernels do not use TF32)

    # ------------------------------------------------------------------ MawDepthSelect
    maw_shapes = [(8, 8, 128, 128, 5), (8, 8, 512, 512, 5), (4, 16, 1024, 1024, 5), (2, 16, 2048, 2048, 8)]
    if args.quick:
        maw_shapes = maw_shapes[:2]
    print("\nMawDepthSelect (B, H, Lq, Lk, d)           dtype   plugin ms  eager ms  plugin/eager")
    for B, H, Lq, Lk, D in maw_shapes:
        for dtype in (torch.float32, torch.float16):
            q = torch.randn(B, H, Lq, D, device="cuda", dtype=dtype)
            k = torch.randn(B, H, Lk, D, device="cuda", dtype=dtype)
            p = torch.randn(B, D, device="cuda", dtype=dtype)
            out = torch.empty(B, H, Lq, Lk, device="cuda", dtype=dtype)
            depth = torch.empty(B, device="cuda", dtype=torch.int64)
            scale = 1.0 / math.sqrt(64)

            def plugin():
                kernels.maw_depth_select(q, k, p, scale, out=out, depth=depth, library=lib)

            def eager():
                t = p.float().argmax(-1)
                qs = q.gather(-1, t.view(-1, 1, 1, 1).expand(B, H, Lq, 1)).float()
                ks = k.gather(-1, t.view(-1, 1, 1, 1).expand(B, H, Lk, 1)).float()
                return ((scale * qs) @ ks.transpose(-1, -2)).to(dtype), t

            a, b = _time(torch, plugin, iters=iters), _time(torch, eager, iters=iters)
            name = str(dtype).split(".")[-1]
            print(f"  {str((B, H, Lq, Lk, D)):40s} {name:7s} {a:9.3f} {b:9.3f} {a / b:12.2f}")

    # ------------------------------------------------------------------ TtaDistance
    tta_shapes = [(8, 8, 128, 128, 64), (8, 8, 512, 512, 64), (4, 16, 1024, 1024, 64), (2, 16, 2048, 2048, 64),
                  (4, 8, 1024, 1024, 128), (8, 8, 512, 512, 32)]
    if args.quick:
        tta_shapes = tta_shapes[:2]
    print("\nTtaDistance (B, H, Lq, Lk, Dh)            dtype   plugin ms  eager ms  GEMM ms  plugin/eager  x GEMM")
    for B, H, Lq, Lk, Dh in tta_shapes:
        for dtype in (torch.float32, torch.float16):
            q = torch.randn(B, H, Lq, Dh, device="cuda", dtype=dtype)
            k = torch.randn(B, H, Lk, Dh, device="cuda", dtype=dtype)
            trace = (torch.randn(B, 1, Dh, Dh, device="cuda") / math.sqrt(Dh)).to(dtype)
            out = torch.empty(B, H, Lq, Lk, device="cuda", dtype=dtype)

            def plugin():
                kernels.tta_distance(q, k, trace, out=out, library=lib)

            def eager():  # the ONNX function body's expansion, in PyTorch
                q32, k32, t32 = q.float(), k.float(), trace.float()
                qq = ((q32 @ t32) * q32).sum(-1, keepdim=True)
                kk = ((k32 @ t32) * k32).sum(-1).unsqueeze(-2)
                cross = q32 @ (k32 @ (t32 + t32.transpose(-1, -2))).transpose(-1, -2)
                return (qq + kk - cross).to(dtype)

            kt = k.transpose(-1, -2).contiguous()

            def gemm():  # cuBLAS: [B*H, Lq, Dh] @ [B*H, Dh, Lk], the same output size
                return torch.matmul(q, kt)

            a, b, c = (_time(torch, f, iters=iters) for f in (plugin, eager, gemm))
            name = str(dtype).split(".")[-1]
            print(f"  {str((B, H, Lq, Lk, Dh)):40s} {name:7s} {a:9.3f} {b:9.3f} {c:8.3f} {a / b:12.2f} {a / c:7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
