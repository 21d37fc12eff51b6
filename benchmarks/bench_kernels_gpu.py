"""GPU speed of the attnx plugin kernels (through their C ABI) against the hardware's own ceilings,
measured in the same process:

- TtaDistance vs one cuBLAS GEMM of the same output (``torch.matmul`` of [B*H, Lq, Dh] x
  [B*H, Dh, Lk], same dtype; fp32 without TF32): "x GEMM" = our time / the GEMM's (goal <= 2).
- MawDepthSelect and MawDepthGather vs the device-to-device copy bandwidth: bytes the kernel
  must move (its output, plus the selected elements it reads; for the gather the 32-byte sectors
  the strided reads touch) over its time, against a copy of the same number of bytes (half read,
  half written) over the copy's time: "of copy" = copy time / kernel time (goal >= 0.5).

Timing: each contender's burst of back-to-back calls (sized to ~2 ms) is captured in a CUDA graph
and its replays are timed with CUDA events (no host overhead in the figures), rounds interleaved
across contenders in rotating order, median over rounds; outputs rotate over enough buffers to
exceed the L2 cache. Prints one table per op and a summary; ``--json PATH`` writes every figure.
Skips cleanly (exit status 0) without a CUDA GPU.

Run: ``python benchmarks/bench_kernels_gpu.py [--quick] [--lengths 512 1024 ...] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
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


class Timer:
    """Median per-call milliseconds of several contenders, interleaved rounds.

    Each contender's calls are captured in a CUDA graph (a burst of back-to-back launches) and
    the graph's replays are timed with CUDA events, so host-side overhead (Python, ctypes) does
    not hide the kernels' own time; every contender is measured the same way."""

    def __init__(self, torch, rounds: int, target_ms: float = 2.0):
        self.torch, self.rounds, self.target_ms = torch, rounds, target_ms

    def _graph(self, fn, reps: int):
        torch = self.torch
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the capture (lazy init, cuBLAS handles)
            for i in range(3):
                fn(i)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(reps):
                fn(i)
        return graph

    def _replay(self, graph, reps: int) -> float:
        torch = self.torch
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / reps

    def run(self, contenders: dict) -> dict[str, float]:
        graphs = {}
        for name, fn in contenders.items():  # size each burst to ~target_ms
            probe = self._graph(fn, 10)
            probe.replay()
            one = self._replay(probe, 10)
            del probe
            reps = max(10, min(500, int(self.target_ms / max(one, 1e-4))))
            graphs[name] = (self._graph(fn, reps), reps)
            graphs[name][0].replay()
        self.torch.cuda.synchronize()
        samples: dict[str, list[float]] = {name: [] for name in contenders}
        names = list(contenders)
        for r in range(self.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                samples[name].append(self._replay(*graphs[name]))
        del graphs
        return {name: statistics.median(v) for name, v in samples.items()}


def _buffers(torch, shape, dtype, l2_bytes: int, fill: bool = False) -> list:
    """Enough output buffers that cycling through them spills the L2 cache (at most 8)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    count = max(1, min(8, math.ceil(3 * l2_bytes / max(nbytes, 1))))
    make = torch.randn if fill else torch.empty
    return [make(shape, device="cuda", dtype=dtype) for _ in range(count)]


def _copy_contender(torch, nbytes: int, l2_bytes: int):
    """A device-to-device copy moving ``nbytes`` in total (nbytes/2 read, nbytes/2 written)."""
    half = max(1, nbytes // 2)
    srcs = _buffers(torch, (half,), torch.uint8, l2_bytes)
    dsts = _buffers(torch, (half,), torch.uint8, l2_bytes)
    return lambda i: dsts[i % len(dsts)].copy_(srcs[i % len(srcs)]), 2 * half


def bench_maw(torch, kernels, lib, lengths, dtypes, timer, l2, B, H, D) -> list[dict]:
    rows = []
    for L in lengths:
        for dtype in dtypes:
            es = torch.empty((), dtype=dtype).element_size()
            q = torch.randn(B, H, L, D, device="cuda", dtype=dtype)
            k = torch.randn(B, H, L, D, device="cuda", dtype=dtype)
            p = torch.randn(B, D, device="cuda", dtype=dtype)
            outs = _buffers(torch, (B, H, L, L), dtype, l2)
            sels = [(torch.empty(B, H, L, 1, device="cuda", dtype=dtype), torch.empty(B, H, L, 1, device="cuda", dtype=dtype))
                    for _ in range(len(outs))]
            depth = torch.empty(B, device="cuda", dtype=torch.int64)
            scale = 1.0 / math.sqrt(64)
            rows_qk = 2 * B * H * L
            select_bytes = B * H * L * L * es + rows_qk * es + B * D * es + B * 8
            gather_bytes = rows_qk * min(D * es, 32) + rows_qk * es + B * D * es + B * 8
            copy_sel, select_bytes = _copy_contender(torch, select_bytes, l2)
            copy_gat, gather_bytes = _copy_contender(torch, gather_bytes, l2)

            def select(i):
                kernels.maw_depth_select(q, k, p, scale, out=outs[i % len(outs)], depth=depth, library=lib)

            def gather(i):
                qs, ks = sels[i % len(sels)]
                kernels.maw_depth_gather(q, k, p, q_sel=qs, k_sel=ks, depth=depth, library=lib)

            t = timer.run({"select": select, "copy_select": copy_sel, "gather": gather, "copy_gather": copy_gat})
            name = str(dtype).split(".")[-1]
            rows.append({"op": "MawDepthSelect", "B": B, "H": H, "L": L, "d": D, "dtype": name, "ms": t["select"],
                         "copy_ms": t["copy_select"], "bytes": select_bytes,
                         "GBps": select_bytes / t["select"] / 1e6, "copy_GBps": select_bytes / t["copy_select"] / 1e6,
                         "of_copy": t["copy_select"] / t["select"]})
            rows.append({"op": "MawDepthGather", "B": B, "H": H, "L": L, "d": D, "dtype": name, "ms": t["gather"],
                         "copy_ms": t["copy_gather"], "bytes": gather_bytes,
                         "GBps": gather_bytes / t["gather"] / 1e6, "copy_GBps": gather_bytes / t["copy_gather"] / 1e6,
                         "of_copy": t["copy_gather"] / t["gather"]})
            q = k = outs = sels = None  # free before the next length (the closures share these cells)
            torch.cuda.empty_cache()
    return rows


def bench_tta(torch, kernels, lib, lengths, dtypes, timer, l2, B, H, Dh) -> list[dict]:
    rows = []
    for L in lengths:
        for dtype in dtypes:
            es = torch.empty((), dtype=dtype).element_size()
            q = torch.randn(B, H, L, Dh, device="cuda", dtype=dtype)
            k = torch.randn(B, H, L, Dh, device="cuda", dtype=dtype)
            trace = (torch.randn(1, H, Dh, Dh, device="cuda") / math.sqrt(Dh)).to(dtype)
            outs = _buffers(torch, (B, H, L, L), dtype, l2)
            q3 = q.reshape(B * H, L, Dh)
            kt = k.reshape(B * H, L, Dh).transpose(-1, -2).contiguous()  # [B*H, Dh, Lk]
            gouts = [o.view(B * H, L, L) for o in _buffers(torch, (B, H, L, L), dtype, l2)]

            def tta(i):
                kernels.tta_distance(q, k, trace, out=outs[i % len(outs)], library=lib)

            def gemm(i):  # cuBLAS, the same output shape and dtype
                torch.matmul(q3, kt, out=gouts[i % len(gouts)])

            t = timer.run({"tta": tta, "gemm": gemm})
            out_bytes = B * H * L * L * es
            name = str(dtype).split(".")[-1]
            rows.append({"op": "TtaDistance", "B": B, "H": H, "L": L, "Dh": Dh, "dtype": name, "ms": t["tta"],
                         "gemm_ms": t["gemm"], "x_gemm": t["tta"] / t["gemm"],
                         "out_GBps": out_bytes / t["tta"] / 1e6, "gemm_out_GBps": out_bytes / t["gemm"] / 1e6,
                         "gemm_TFLOPs": 2.0 * B * H * L * L * Dh / t["gemm"] / 1e9})
            q = k = outs = gouts = kt = q3 = None  # free before the next length
            torch.cuda.empty_cache()
    return rows


def breakdown(torch, kernels, lib, lengths, dtypes, B, H, Dh) -> None:
    """Each CUDA kernel's mean time inside TtaDistance calls (torch.profiler), per L and dtype."""
    from torch.profiler import ProfilerActivity, profile

    print("\nTtaDistance kernels (torch.profiler, mean of 10 calls)")
    for L in lengths:
        for dtype in dtypes:
            q = torch.randn(B, H, L, Dh, device="cuda", dtype=dtype)
            k = torch.randn(B, H, L, Dh, device="cuda", dtype=dtype)
            trace = (torch.randn(1, H, Dh, Dh, device="cuda") / math.sqrt(Dh)).to(dtype)
            out = torch.empty(B, H, L, L, device="cuda", dtype=dtype)
            for _ in range(3):
                kernels.tta_distance(q, k, trace, out=out, library=lib)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    kernels.tta_distance(q, k, trace, out=out, library=lib)
                torch.cuda.synchronize()
            for e in prof.key_averages():
                us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
                if e.count and us:
                    print(f"  L={L:5d} {str(dtype).split('.')[-1]:8s} {e.key[:60]:60s} {us / e.count:9.1f} us x{e.count}")
            del q, k, out
            torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="L = 512 and 2048 only, fewer rounds")
    parser.add_argument("--lengths", type=int, nargs="*", default=None, help="sequence lengths (default 512 ... 8192)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 9; --quick 3)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--ops", nargs="*", choices=["maw", "tta"], default=["maw", "tta"])
    parser.add_argument("--breakdown", action="store_true",
                        help="also print each CUDA kernel's time inside one TtaDistance call (torch.profiler)")
    parser.add_argument("--json", default=None, help="write every figure to this JSON file")
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
    lengths = args.lengths or ([512, 2048] if args.quick else [512, 1024, 2048, 4096, 8192])
    timer = Timer(torch, args.rounds or (3 if args.quick else 9))
    props = torch.cuda.get_device_properties(0)
    l2 = int(getattr(props, "L2_cache_size", 50 << 20))
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 GEMM in fp32 (our fp32 path is 3xTF32, fp32-accurate)
    dtypes = (torch.float16, torch.float32)
    print(f"GPU: {props.name} (sm{props.major}{props.minor}, {props.multi_processor_count} SMs, L2 {l2 >> 20} MiB), "
          f"torch {torch.__version__}, CUDA {torch.version.cuda}, library {path}")

    maw, tta = [], []
    if "maw" in args.ops:
        maw = bench_maw(torch, kernels, lib, lengths, dtypes, timer, l2, args.batch, args.heads, 5)
        print(f"\nMAW kernels vs device-to-device copy of the same bytes (B={args.batch}, H={args.heads}, d=5, Lq=Lk=L)")
        print(f"  {'op':15s} {'L':>5s} {'dtype':8s} {'ms':>9s} {'GB/s':>8s} {'copy ms':>9s} {'copy GB/s':>9s} {'of copy':>8s}")
        for r in maw:
            print(f"  {r['op']:15s} {r['L']:5d} {r['dtype']:8s} {r['ms']:9.4f} {r['GBps']:8.0f} {r['copy_ms']:9.4f} "
                  f"{r['copy_GBps']:9.0f} {r['of_copy']:8.2f}")
    if "tta" in args.ops:
        tta = bench_tta(torch, kernels, lib, lengths, dtypes, timer, l2, args.batch, args.heads, 64)
        print(f"\nTtaDistance vs cuBLAS GEMM of the same output (B={args.batch}, H={args.heads}, Dh=64, Lq=Lk=L)")
        print(f"  {'L':>5s} {'dtype':8s} {'ms':>9s} {'GEMM ms':>9s} {'x GEMM':>7s} {'out GB/s':>9s} {'GEMM TFLOP/s':>12s}")
        for r in tta:
            print(f"  {r['L']:5d} {r['dtype']:8s} {r['ms']:9.4f} {r['gemm_ms']:9.4f} {r['x_gemm']:7.2f} "
                  f"{r['out_GBps']:9.0f} {r['gemm_TFLOPs']:12.1f}")
        if args.breakdown:
            breakdown(torch, kernels, lib, lengths, dtypes, args.batch, args.heads, 64)
    parts = []
    if maw:
        parts.append(f"MawDepthSelect >= {min(r['of_copy'] for r in maw if r['op'] == 'MawDepthSelect'):.2f} of copy "
                     f"bandwidth (goal 0.50); MawDepthGather >= "
                     f"{min(r['of_copy'] for r in maw if r['op'] == 'MawDepthGather'):.2f}")
    if tta:
        parts.append(f"TtaDistance <= {max(r['x_gemm'] for r in tta):.2f}x the GEMM (goal 2.00)")
    print("\nsummary: " + "; ".join(parts))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": props.name, "torch": torch.__version__, "cuda": torch.version.cuda,
                       "lengths": lengths, "maw": maw, "tta": tta}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
