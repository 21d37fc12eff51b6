"""Dynamic batching vs no batching (--max-batch 1), 32 concurrent clients, the default maw model, CPU.

Measured in one process on the same loaded model, batched and unbatched runs
interleaved in rounds (A B A B ...) so that background load hits both alike:

- in-process: 32 client threads calling the DynamicBatcher directly (the runtime itself);
- http: 32 tritonclient.http clients against an InferenceServer on loopback
  (the whole serving path, clients sharing the same CPUs).

Scenarios: the `attnx bench` default length mix 16/64/128, and short sequences
(4/8), where a run's fixed cost dominates and batching can amortize it.

Prints a table with throughput, p50/p95/p99 latency, mean batch formed, and the
throughput ratio of each batched run over its --max-batch 1 twin.

    .venv/bin/python benchmarks/bench_batching.py [--duration 10] [--rounds 5] [--via inprocess|http|both]
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


def _merge(parts: list, label: str):
    from attnx.deploy.loadtest import merge_results

    return merge_results(parts, label)


class InProcess:
    """Clients call a DynamicBatcher directly."""

    name = "in-process"

    def __init__(self, session, config):
        from attnx.runtime import DynamicBatcher

        self.batcher = DynamicBatcher(session, config)
        self.factory = lambda: self.batcher.infer

    def close(self):
        self.batcher.close()


class OverHttp:
    """Clients are tritonclient.http against an InferenceServer on loopback (same CPUs)."""

    name = "http"

    def __init__(self, session, config):
        from attnx.runtime import InferenceServer
        from attnx.runtime.config import ServingConfig
        from attnx.deploy.loadtest import HttpTarget

        self.server = InferenceServer({"maw": session}, ServingConfig.from_parts(batching=config, port=0)).start()
        self.batcher = self.server.models["maw"].batcher
        self.factory = HttpTarget(self.server.url, "maw").factory

    def close(self):
        self.server.stop()


def measure(target_cls, session, pool, config, args, label):
    from attnx.deploy.loadtest import run_load

    target = target_cls(session, config)
    try:
        before = (target.batcher.stats.batches, target.batcher.stats.rows)
        result = run_load(target.factory, pool, concurrency=args.concurrency, duration_s=args.duration / args.rounds,
                          label=label)
        batches = target.batcher.stats.batches - before[0]
        result.mean_batch_rows = (target.batcher.stats.rows - before[1]) / batches if batches else None
    finally:
        target.close()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per configuration (all rounds)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (evens out a noisy machine)")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--scenarios", default="16,64,128;4,8",
                        help="';'-separated sequence-length mixes (default: the bench mix, then short sequences)")
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--max-delay-ms", type=float, default=2.0)
    parser.add_argument("--via", choices=["inprocess", "http", "both"], default="both")
    parser.add_argument("--model", type=Path, help="an existing .onnx instead of exporting maw")
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    args = parser.parse_args(argv)

    from attnx.runtime import BatcherConfig, load
    from attnx.deploy.loadtest import render, request_pool, run_load
    from attnx.runtime.core.backends.onnxrt import default_threads

    console = Console(width=200)
    scenarios = [[int(v) for v in mix.split(",")] for mix in args.scenarios.split(";") if mix]
    targets = {"inprocess": [InProcess], "http": [OverHttp], "both": [InProcess, OverHttp]}[args.via]
    batched_cfg = BatcherConfig(max_batch_size=args.max_batch, max_queue_delay_ms=args.max_delay_ms, timeout_ms=None)
    single_cfg = BatcherConfig(max_batch_size=1, max_queue_delay_ms=args.max_delay_ms, timeout_ms=None)
    with tempfile.TemporaryDirectory() as tmp:
        if args.model:
            path, what = args.model, str(args.model)
        else:
            t0 = time.perf_counter()
            path, what = export_default_maw(Path(tmp))
            console.print(f"[dim]exported {what} in {time.perf_counter() - t0:.1f} s[/dim]")
        session = load(path, device="cpu")
        pairs = []
        for lengths in scenarios:
            pool = request_pool(session.inputs, lengths, per_length=8)
            for target_cls in targets:
                warm = target_cls(session, batched_cfg)
                run_load(warm.factory, pool, concurrency=args.concurrency, duration_s=1.0)
                warm.close()
                batched_parts, single_parts = [], []
                for _ in range(args.rounds):  # A/B interleaved so background load hits both alike
                    batched_parts.append(measure(target_cls, session, pool, batched_cfg, args, ""))
                    single_parts.append(measure(target_cls, session, pool, single_cfg, args, ""))
                mix = "/".join(map(str, lengths))
                batched = _merge(batched_parts, f"seq {mix}, {target_cls.name}, max batch {args.max_batch}")
                single = _merge(single_parts, f"seq {mix}, {target_cls.name}, max batch 1")
                pairs.append((mix, target_cls.name, batched, single))

    title = (f"Dynamic batching vs --max-batch 1: {what}; {args.concurrency} clients, "
             f"{args.duration:.0f} s per configuration in {args.rounds} interleaved rounds; "
             f"CPU ({default_threads()} cores), ONNX Runtime")
    results = [r for _, _, batched, single in pairs for r in (batched, single)]
    console.print(render(results, title=title))
    summary = []
    for mix, mode, batched, single in pairs:
        ratio = batched.requests_per_s / single.requests_per_s if single.requests_per_s else float("nan")
        console.print(f"seq {mix}, {mode}: throughput x{ratio:.2f} with batching; p99 "
                      f"{batched.percentile_ms(99):.1f} ms batched vs {single.percentile_ms(99):.1f} ms at max batch 1")
        summary.append({"seq": mix, "mode": mode, "ratio": ratio, "batched": batched.summary(),
                        "single": single.summary()})
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    errors = sum(sum(r.errors.values()) for r in results)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
