"""Dynamic batching vs no batching (--max-batch 1), 32 concurrent clients, the default maw model, CPU.

Measured in one process, one after the other, on the same loaded model:

- in-process: 32 client threads calling the DynamicBatcher directly (the runtime itself);
- http: 32 tritonclient.http clients against an InferenceServer on loopback
  (the whole serving path, clients sharing the same CPUs).

Prints a table with throughput, p50/p95/p99 latency, mean batch formed and the
throughput ratio of each batched run over its --max-batch 1 twin.

    .venv/bin/python benchmarks/bench_batching.py [--duration 10] [--via inprocess|http|both]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console


def export_default_maw(folder: Path) -> tuple[Path, str]:
    """The maw model exactly as ``attnx export --variant maw`` makes it (default config)."""
    from attnx.export import export_variant

    path = folder / "maw.onnx"
    result = export_variant("maw", str(path))
    return Path(result.path), "maw (default export config)"


def run_inprocess(session, pool, max_batch: int, args) -> "LoadResult":  # noqa: F821
    from attnx.runtime import BatcherConfig, DynamicBatcher
    from attnx.runtime.bench import run_load

    config = BatcherConfig(max_batch_size=max_batch, max_queue_delay_ms=args.max_delay_ms, timeout_ms=None)
    with DynamicBatcher(session, config) as batcher:
        run_load(lambda: batcher.infer, pool, concurrency=args.concurrency, duration_s=1.0)  # warm-up
        before = (batcher.stats.batches, batcher.stats.rows)
        result = run_load(
            lambda: batcher.infer, pool, concurrency=args.concurrency, duration_s=args.duration,
            label=f"in-process, max batch {max_batch}",
        )
        batches = batcher.stats.batches - before[0]
        result.mean_batch_rows = (batcher.stats.rows - before[1]) / batches if batches else None
    return result


def run_http(session, pool, max_batch: int, args) -> "LoadResult":  # noqa: F821
    from attnx.runtime import BatcherConfig, InferenceServer
    from attnx.runtime.bench import HttpTarget, run_load

    config = BatcherConfig(max_batch_size=max_batch, max_queue_delay_ms=args.max_delay_ms, timeout_ms=None)
    with InferenceServer({"maw": session}, port=0, batching=config) as server:
        target = HttpTarget(server.url, "maw")
        run_load(target.factory, pool, concurrency=args.concurrency, duration_s=1.0)  # warm-up
        batcher = server.models["maw"].batcher
        before = (batcher.stats.batches, batcher.stats.rows)
        result = run_load(
            target.factory, pool, concurrency=args.concurrency, duration_s=args.duration,
            label=f"http (tritonclient), max batch {max_batch}",
        )
        batches = batcher.stats.batches - before[0]
        result.mean_batch_rows = (batcher.stats.rows - before[1]) / batches if batches else None
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per run")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--seq", default="16,64,128", help="sequence-length mix")
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--max-delay-ms", type=float, default=2.0)
    parser.add_argument("--via", choices=["inprocess", "http", "both"], default="both")
    parser.add_argument("--model", type=Path, help="an existing .onnx instead of exporting maw")
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    args = parser.parse_args(argv)

    from attnx.runtime import load
    from attnx.runtime.bench import render, request_pool
    from attnx.runtime.session import default_threads

    console = Console()
    lengths = [int(v) for v in args.seq.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        if args.model:
            path, what = args.model, str(args.model)
        else:
            t0 = time.perf_counter()
            path, what = export_default_maw(Path(tmp))
            console.print(f"[dim]exported {what} in {time.perf_counter() - t0:.1f} s[/dim]")
        session = load(path, device="cpu")
        pool = request_pool(session.inputs, lengths, per_length=8)
        modes = ["inprocess", "http"] if args.via == "both" else [args.via]
        rows = []
        for mode in modes:
            runner = run_inprocess if mode == "inprocess" else run_http
            batched = runner(session, pool, args.max_batch, args)
            single = runner(session, pool, 1, args)
            rows.append((mode, batched, single))

    title = (
        f"Dynamic batching vs --max-batch 1: {what}; {args.concurrency} clients, seq mix {lengths}, "
        f"{args.duration:.0f} s per run, CPU ({default_threads()} cores), ONNX Runtime"
    )
    results = []
    for _, batched, single in rows:
        results += [batched, single]
    table = render(results, title=title)
    console.print(table)
    summary = []
    for mode, batched, single in rows:
        ratio = batched.requests_per_s / single.requests_per_s if single.requests_per_s else float("nan")
        console.print(
            f"{mode}: throughput x{ratio:.2f} with batching "
            f"(p99 {batched.percentile_ms(99):.1f} ms batched vs {single.percentile_ms(99):.1f} ms at max batch 1)"
        )
        summary.append({"mode": mode, "ratio": ratio, "batched": batched.summary(), "single": single.summary()})
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    errors = sum(sum(r.errors.values()) for r in results)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
