"""Latency and peak memory of every attention variant's inference path (PyTorch, eval mode) against
``mha`` (plain attention, SDPA), one encoder layer, in the same process.

For each sequence length and dtype, every variant's forward is timed in interleaved rounds
(rotating order, CUDA events around a burst of calls, median over rounds), so clock and
thermal drift hit every variant alike; "x mha" is the variant's median over mha's. Peak memory
is ``torch.cuda.max_memory_allocated`` during one forward, minus what was allocated before it
(weights and inputs): the forward's own working memory. An out-of-memory forward is reported as
OOM, not as a crash. With a folder (``--pretrained``, ``--family``) the first row, ``transformers``,
is the folder as transformers itself runs it (its SDPA attention, nothing placed).

Defaults: CUDA, fp16 and bf16, d_model 768, 12 heads, batch 1, L = 512 ... 8192. On a machine
without a GPU it runs on the CPU (float32, and meant for tiny sizes: a smoke test), e.g.
``python benchmarks/bench_variants_gpu.py --device cpu --d-model 64 --heads 4 --lengths 16 32 --rounds 2``.

With ``--pretrained DIR`` the models are a real Hugging Face folder (e.g. all-MiniLM-L6-v2) with
each variant placed in it as ``attnx.pretrained.load(DIR, variant)`` places it (every layer, or
MAW appended), fed token ids with padding (row lengths L, 3L/4, L/2, L/4, ...), compared with the
plain model (``mha``).

Run: ``python benchmarks/bench_variants_gpu.py [--quick] [--lengths ...] [--variants ...] [--json out.json]``
or ``python benchmarks/bench_variants_gpu.py --pretrained DIR --batch 32 --lengths 128 256 512``.

``--family llama|qwen2|modernbert`` does the same on a random-weight folder of that family at a
published model's shape (SmolLM-135M, Qwen2.5-0.5B, ModernBERT-base), saved with transformers'
``save_pretrained`` into a temporary folder: the hosts transformers runs, with nothing downloaded.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def _token_inputs(torch, model, batch: int, seq: int, dtype, device) -> dict:
    """Token ids (random in the vocabulary), a padded mask, segment ids 0 and the context inputs."""
    g = torch.Generator(device="cpu").manual_seed(0)
    feeds = {}
    for spec in model.input_specs():
        shape = [batch if d == "batch" else seq if d == "seq" else int(d) for d in spec.shape]
        if spec.role == "attention_mask":
            lengths = torch.tensor([max(1, seq * (4 - i % 4) // 4) for i in range(batch)])
            feeds[spec.name] = (torch.arange(seq)[None] < lengths[:, None]).long().to(device)
        elif spec.dtype == "float":
            feeds[spec.name] = torch.randn(*shape, generator=g).to(device=device, dtype=dtype)
        else:
            low, high = spec.range or (0, 16)
            high = 1 if spec.role == "token_type_ids" else high
            feeds[spec.name] = torch.randint(low, high, shape, generator=g).to(device)
    return feeds


def _inputs(torch, model, batch: int, seq: int, d_model: int, dtype, device) -> tuple:
    """hidden_states [B, L, d] (dtype), attention_mask [B, L] int64 (all tokens), and the model's
    context inputs: float ones random in dtype, integer ids in [0, 16) (or the spec's range)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    hidden = torch.randn(batch, seq, d_model, generator=g).to(device=device, dtype=dtype)
    mask = torch.ones(batch, seq, dtype=torch.int64, device=device)
    context = {}
    for spec in model.context_inputs():
        shape = [batch if d == "batch" else seq if d == "seq" else int(d) for d in spec.shape]
        if spec.dtype == "float":
            context[spec.name] = torch.randn(*shape, generator=g).to(device=device, dtype=dtype)
        elif spec.dtype == "mask":
            context[spec.name] = torch.ones(*shape, dtype=torch.int64, device=device)
        else:  # "int64" / "int": ids
            low, high = getattr(spec, "range", None) or (0, 16)
            context[spec.name] = torch.randint(low, high, shape, generator=g).to(device)
    return hidden, mask, context


#: Published shapes (config fields only; weights are random): what a user's checkpoint looks like.
FAMILY_SHAPES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(  # SmolLM-135M
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, tie_word_embeddings=True)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(  # Qwen2.5-0.5B
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, tie_word_embeddings=True)),
    "modernbert": ("ModernBertConfig", "ModernBertModel", dict(  # ModernBERT-base
        hidden_size=768, intermediate_size=1152, num_hidden_layers=22, num_attention_heads=12,
        vocab_size=50368, max_position_embeddings=8192, global_attn_every_n_layers=3, local_attention=128,
        pad_token_id=50283, bos_token_id=50281, eos_token_id=50282, cls_token_id=50281, sep_token_id=50282)),
}


def family_folder(name: str, root: str) -> str:
    """A random-weight folder of ``name`` at its published shape, saved in fp16 under ``root``."""
    import torch
    import transformers

    config_cls, model_cls, fields = FAMILY_SHAPES[name]
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**fields)).half()
    folder = f"{root}/{name}"
    model.save_pretrained(folder)
    return folder


class _Clock:
    """Per-call milliseconds of ``fn`` over a burst: CUDA events on a GPU, perf_counter on the CPU."""

    def __init__(self, torch, device):
        self.torch, self.cuda = torch, device.type == "cuda"

    def burst(self, fn, reps: int) -> float:
        torch = self.torch
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / reps
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) * 1e3 / reps


def _peak_mib(torch, fn, device) -> float | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def _oom_types(torch) -> tuple:
    types = [RuntimeError]  # CPU allocation failures
    if hasattr(torch.cuda, "OutOfMemoryError"):
        types.insert(0, torch.cuda.OutOfMemoryError)
    return tuple(types)


def run(args) -> list[dict]:
    import torch

    from attnx.models import VARIANTS, build_encoder

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtypes = args.dtypes or (["float16", "bfloat16"] if device.type == "cuda" else ["float32"])
    variants = args.variants or list(VARIANTS)
    if "mha" not in variants:
        variants = ["mha", *variants]
    lengths = args.lengths or ([512, 2048] if args.quick else [512, 1024, 2048, 4096, 8192])
    rounds = args.rounds or (2 if args.quick else 5)
    clock = _Clock(torch, device)
    oom = _oom_types(torch)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        print(f"device: {props.name}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    else:
        print(f"device: CPU ({torch.get_num_threads()} threads), torch {torch.__version__}")
    shape = (f"placed in {args.pretrained}" if args.pretrained
             else f"d_model {args.d_model}, {args.heads} heads, 1 layer")
    print(f"variants {', '.join(variants)}; {shape}, batch {args.batch}; {rounds} interleaved rounds")

    rows: list[dict] = []
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        models = {}
        if args.pretrained:  # the folder as transformers runs it (its SDPA attention), beside attnx's mha
            from attnx import pretrained

            models["transformers"] = pretrained.load(args.pretrained, "mha").to(device=device, dtype=dtype).eval()
            models["transformers"].hf.set_attn_implementation("sdpa")
        for v in variants:
            if args.pretrained:
                models[v] = pretrained.load(args.pretrained, v).to(device=device, dtype=dtype).eval()
            else:
                models[v] = build_encoder(v, d_model=args.d_model, n_heads=args.heads, n_layers=1).to(
                    device=device, dtype=dtype).eval()
        # torch.compile in "reduce-overhead" mode (CUDA graphs): what removes the per-kernel launch cost
        # that dominates these models at small batches (section 4 of docs/gpu.md)
        compiled = {v: torch.compile(m.forward_named, mode="reduce-overhead", dynamic=False)
                    for v, m in models.items()} if args.compile else {}
        for L in lengths:
            calls, peaks, failed = {}, {}, {}
            for v, model in models.items():
                try:
                    if args.pretrained:
                        feeds = _token_inputs(torch, model, args.batch, L, dtype, device)

                        run = compiled[v] if args.compile else model.forward_named

                        def forward(run=run, feeds=feeds):
                            with torch.inference_mode():
                                return run(feeds)
                    else:
                        hidden, mask, context = _inputs(torch, model, args.batch, L, args.d_model, dtype, device)

                        def forward(model=model, hidden=hidden, mask=mask, context=context):
                            with torch.inference_mode():
                                return model(hidden, mask, **context)

                    for _ in range(3 if args.compile else 1):  # warm-up (kernel selection; compile, graph capture)
                        forward()
                    peaks[v] = _peak_mib(torch, forward, device)
                    calls[v] = forward
                except oom as e:
                    if "out of memory" not in str(e).lower() and not isinstance(e, getattr(torch.cuda, "OutOfMemoryError", ())):
                        raise
                    failed[v] = "OOM"
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
            reps = {}
            for v, fn in calls.items():
                one = clock.burst(fn, 1)
                reps[v] = max(1, min(50, int(args.target_ms / max(one, 1e-3))))
            samples: dict[str, list[float]] = {v: [] for v in calls}
            names = list(calls)
            for r in range(rounds):
                for v in names[r % len(names):] + names[:r % len(names)]:
                    samples[v].append(clock.burst(calls[v], reps[v]))
            ms = {v: statistics.median(s) for v, s in samples.items()}
            base_ms, base_mem = ms.get("mha"), peaks.get("mha")
            for v in models:
                row = {"variant": v, "L": L, "dtype": dtype_name, "batch": args.batch, "d_model": args.d_model,
                       "heads": args.heads, "ms": ms.get(v), "peak_MiB": peaks.get(v), "error": failed.get(v)}
                row["x_mha_ms"] = ms[v] / base_ms if v in ms and base_ms else None
                row["x_mha_mem"] = peaks[v] / base_mem if peaks.get(v) is not None and base_mem else None
                rows.append(row)
            del calls
            if device.type == "cuda":
                torch.cuda.empty_cache()
        del models
    return rows


def _fmt(value, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="L = 512 and 2048, 2 rounds")
    parser.add_argument("--lengths", type=int, nargs="*", default=None)
    parser.add_argument("--variants", nargs="*", default=None, help="default: every registered variant (mha always)")
    parser.add_argument("--dtypes", nargs="*", default=None, help="default: float16 bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 5; --quick 2)")
    parser.add_argument("--target-ms", type=float, default=20.0, help="length of one timed burst")
    parser.add_argument("--json", default=None, help="write every figure to this JSON file")
    parser.add_argument("--pretrained", default=None, help="a Hugging Face folder to place each variant in")
    parser.add_argument("--compile", action="store_true",
                        help="with a folder: each model's forward through torch.compile(mode='reduce-overhead')")
    parser.add_argument("--family", default=None, choices=sorted(FAMILY_SHAPES),
                        help="a random folder of this family at a published shape, instead of --pretrained")
    args = parser.parse_args(argv)
    try:
        import torch  # noqa: F401
    except ImportError:
        print("bench_variants_gpu: skipped (PyTorch is not installed)")
        return 0
    if args.family:
        import tempfile

        tmp = tempfile.TemporaryDirectory()
        args.pretrained = family_folder(args.family, tmp.name)
        print(f"{args.family}: random weights at {FAMILY_SHAPES[args.family][1]}'s published shape")
    rows = run(args)
    print(f"\n  {'variant':12s} {'L':>6s} {'dtype':9s} {'ms':>10s} {'x mha':>7s} {'peak MiB':>10s} {'x mha':>7s}")
    for r in rows:
        ms = r["error"] or _fmt(r["ms"], ".3f")
        print(f"  {r['variant']:12s} {r['L']:6d} {r['dtype']:9s} {ms:>10s} {_fmt(r['x_mha_ms'], '.2f'):>7s} "
              f"{_fmt(r['peak_MiB'], '.1f'):>10s} {_fmt(r['x_mha_mem'], '.2f'):>7s}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
