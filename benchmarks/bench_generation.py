"""Decoding with the KV cache (issue 23): attnx's with-past exports against transformers' ``generate`` and
onnxruntime-genai, step-level batching, and each variant's decode cost against mha.

Models: random-weight folders saved with ``save_pretrained`` (no tokenizer; the loops run on token ids):
``llama`` (hidden 512, 8 layers, 8 heads, 4 key/value heads, FFN 1376, vocab 16000: SmolLM's width) and
``gpt2`` (n_embd 512, 8 layers, 8 heads, vocab 16000). A 32-token prompt, then greedy decoding.

- ``decode``: ms per generated token after the first (``(t(65 tokens) - t(1 token)) / 64`` per contender,
  the prompt's prefill cancels out), for attnx (``attnx.runtime.core.decoding.Decoder`` on ONNX Runtime, a
  greedy loop), transformers' ``generate`` (torch, ``do_sample=False``, its own cache, sdpa) and
  onnxruntime-genai on the same ``model.onnx`` (its ``genai_config.json``); every contender with the same
  intra-op threads, interleaved rounds, medians; ratios printed (> 1: attnx faster).
- ``concurrency``: aggregate tokens/s of 8 concurrent generations against one, through the step-level
  scheduler (``attnx.runtime.core.scheduler``) in process and through ``attnx serve`` over HTTP (streamed
  ``/v1/completions``, one client thread each); interleaved rounds.
- ``variants``: decode ms/token of each variant placed in every layer of the llama (maw: appended, its own
  form) against mha, per lowering; interleaved rounds.

    .venv/bin/python benchmarks/bench_generation.py [--what decode concurrency variants] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

console = Console(width=140)
CONFIGS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(vocab_size=16000, hidden_size=512, num_hidden_layers=8,
                                                      num_attention_heads=8, num_key_value_heads=4,
                                                      intermediate_size=1376, max_position_embeddings=1024,
                                                      tie_word_embeddings=True)),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(vocab_size=16000, n_embd=512, n_layer=8, n_head=8, n_positions=1024)),
}
PROMPT, NEW = 32, 64


def log(msg: str) -> None:
    console.print(f"[dim]{msg}[/dim]", highlight=False)


def folder(root: Path, name: str) -> Path:
    import transformers

    out = root / name
    if not (out / "config.json").is_file():
        config_cls, model_cls, kw = CONFIGS[name]
        config = getattr(transformers, config_cls)(**kw, bos_token_id=0, eos_token_id=1)
        config.architectures = [model_cls]
        torch.manual_seed(0)
        getattr(transformers, model_cls)(config).save_pretrained(out)
    return out


def export(root: Path, name: str, variant: str = "mha", lowering: str = "plugin") -> Path:
    from attnx.export.pretrained import export_pretrained

    out = root / "exports" / f"{name}-{variant}-{lowering}" / "model.onnx"
    if not out.is_file():
        log(f"exporting {name} with {variant} ({lowering}) and its cache...")
        export_pretrained(folder(root, name), out, variant=variant, lowering=lowering, with_past=True)
    return out


def prompt_ids(vocab: int = 16000) -> list[int]:
    return np.random.default_rng(0).integers(5, vocab, PROMPT).tolist()


# ----------------------------------------------------------------------------- contenders: n new tokens


def attnx_contender(path: Path, threads: int, **options):
    from attnx.runtime import load
    from attnx.runtime.core.decoding import Decoder

    decoder = Decoder(load(path, device="cpu", threads=threads, **options))
    ids = prompt_ids()

    def run(n: int) -> list[int]:
        logits, state = decoder.start(ids)
        out = [int(np.argmax(logits))]
        for _ in range(n - 1):
            logits, state = decoder.step(state, out[-1:])
            out.append(int(np.argmax(logits[0])))
        return out

    return run


def torch_contender(source: Path):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    ids = torch.tensor([prompt_ids()])

    def run(n: int) -> list[int]:
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, pad_token_id=0)
        return out[0, ids.shape[1]:].tolist()

    return run


def genai_contender(path: Path, threads: int, root: Path):
    import onnxruntime_genai as og

    # a copy of the export's folder whose config gives onnxruntime-genai the same intra-op threads
    folder = root / "genai" / path.parent.name
    if not folder.is_dir():
        folder.mkdir(parents=True)
        for f in path.parent.iterdir():
            if f.is_file():
                os.symlink(f.resolve(), folder / f.name)
    config = json.loads((path.parent / "genai_config.json").read_text())
    config["model"]["decoder"]["session_options"].update(intra_op_num_threads=threads, inter_op_num_threads=1)
    (folder / "genai_config.json").unlink(missing_ok=True)
    (folder / "genai_config.json").write_text(json.dumps(config))
    model = og.Model(str(folder))
    ids = np.asarray(prompt_ids(), dtype=np.int32)

    def run(n: int) -> list[int]:
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(ids) + n, min_length=len(ids) + n, do_sample=False)
        gen = og.Generator(model, params)
        gen.append_tokens(ids)
        out = []
        while not gen.is_done():
            gen.generate_next_token()
            out.append(int(gen.get_next_tokens()[0]))
        return out

    return run


def decode_rounds(contenders: dict, rounds: int) -> dict[str, list[float]]:
    """ms per token after the first, per interleaved round: (t(NEW + 1) - t(1)) / NEW."""
    for fn in contenders.values():  # warm-up
        fn(4)
    per: dict[str, list[float]] = {k: [] for k in contenders}
    for _ in range(rounds):
        for name, fn in contenders.items():
            t = time.perf_counter()
            fn(1)
            one = time.perf_counter() - t
            t = time.perf_counter()
            fn(NEW + 1)
            full = time.perf_counter() - t
            per[name].append((full - one) / NEW * 1000)
    return per


def decode_ms(contenders: dict, rounds: int) -> dict[str, float]:
    """Median ms per token after the first over interleaved rounds."""
    return {k: statistics.median(v) for k, v in decode_rounds(contenders, rounds).items()}


def ratio(per: dict[str, list[float]], name: str, base: str) -> float:
    """The median over rounds of ``name``'s time over ``base``'s in the same round (a shared machine's load
    moves between rounds; within one round both see the same)."""
    return statistics.median(a / b for a, b in zip(per[name], per[base]))


def bench_decode(root: Path, rounds: int, threads: int) -> list[dict]:
    rows = []
    for name in ("llama", "gpt2"):
        path = export(root, name)
        contenders = {"attnx": attnx_contender(path, threads), "transformers": torch_contender(folder(root, name)),
                      "onnxruntime-genai": genai_contender(path, threads, root)}
        tokens = {k: fn(12) for k, fn in contenders.items()}
        same = len({tuple(t) for t in tokens.values()}) == 1
        per = decode_rounds(contenders, rounds)
        ms = {k: statistics.median(v) for k, v in per.items()}
        rows.append({"model": name, **{k: round(v, 3) for k, v in ms.items()}, "same_tokens": same,
                     "vs_transformers": round(ratio(per, "transformers", "attnx"), 2),
                     "vs_genai": round(ratio(per, "onnxruntime-genai", "attnx"), 2)})
    table = Table("model", "attnx ms/token", "transformers", "onnxruntime-genai", "transformers / attnx",
                  "genai / attnx", "same greedy tokens", title=f"decode, {threads} threads, prompt {PROMPT}, "
                  f"{NEW} tokens, {rounds} interleaved rounds (median)", title_justify="left")
    for r in rows:
        table.add_row(r["model"], f"{r['attnx']:.2f}", f"{r['transformers']:.2f}", f"{r['onnxruntime-genai']:.2f}",
                      f"{r['vs_transformers']:.2f}x", f"{r['vs_genai']:.2f}x", str(r["same_tokens"]))
    console.print(table)
    return rows


# ----------------------------------------------------------------------------- concurrency


def bench_concurrency(root: Path, rounds: int, threads: int, streams: int = 8) -> list[dict]:
    import httpx

    from attnx.runtime import load
    from attnx.runtime.config import ServingConfig
    from attnx.runtime.core.decoding import Decoder
    from attnx.runtime.core.sampling import SamplingParams
    from attnx.runtime.core.scheduler import GenerationScheduler
    from attnx.runtime.server import InferenceServer

    path = export(root, "llama")
    decoder = Decoder(load(path, device="cpu", threads=threads))

    class _NoText:
        def decode(self, ids, skip_special_tokens=True):
            return ""

    scheduler = GenerationScheduler(decoder, _NoText(), max_batch=streams, name="bench")
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    prompts = [np.random.default_rng(i).integers(5, 16000, PROMPT).tolist() for i in range(streams)]

    def in_process(n: int) -> float:
        done = threading.Semaphore(0)
        start = time.perf_counter()
        for i in range(n):
            scheduler.submit(prompts[i], params, lambda p: p.finish_reason and done.release(), lambda m: done.release())
        for _ in range(n):
            done.acquire()
        return n * NEW / (time.perf_counter() - start)

    server = InferenceServer({"llama": path}, ServingConfig(port=0, threads=threads, max_batch=streams)) \
        if (path.parent / "model.tokenizer").is_dir() \
        else _server_with_ids(path, threads, streams)
    server.start()

    def over_http(n: int) -> float:
        def one(i):
            with httpx.Client(base_url=server.url, timeout=120) as c:
                with c.stream("POST", "/v1/completions", json={"model": "llama", "prompt": prompts[i], "max_tokens": NEW,
                                                                "temperature": 0, "stream": True, "ignore_eos": True}) as r:
                    for _ in r.iter_lines():
                        pass

        threads_ = [threading.Thread(target=one, args=(i,)) for i in range(n)]
        start = time.perf_counter()
        for t in threads_:
            t.start()
        for t in threads_:
            t.join()
        return n * NEW / (time.perf_counter() - start)

    rows = []
    try:
        for label, fn in (("in process (scheduler)", in_process), ("attnx serve, HTTP streams", over_http)):
            fn(1), fn(streams)  # warm-up
            single, many = [], []
            for _ in range(rounds):
                single.append(fn(1))
                many.append(fn(streams))
            s, m = statistics.median(single), statistics.median(many)
            rows.append({"path": label, "1_stream_tok_s": round(s, 1), f"{streams}_streams_tok_s": round(m, 1),
                         "ratio": round(m / s, 2)})
    finally:
        scheduler.close()
        server.stop()
    table = Table("path", "1 stream tok/s", f"{streams} streams tok/s (aggregate)", "ratio",
                  title=f"step-level batching, llama, {threads} threads, {NEW} tokens each, {rounds} interleaved "
                        "rounds (median)", title_justify="left")
    for r in rows:
        table.add_row(r["path"], f"{r['1_stream_tok_s']:.0f}", f"{r[f'{streams}_streams_tok_s']:.0f}",
                      f"{r['ratio']:.2f}x")
    console.print(table)
    return rows


def _server_with_ids(path: Path, threads: int, streams: int):
    """The bench folders have no tokenizer: serve with a minimal byte-level one (prompts go in as token ids)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from attnx.runtime.config import ServingConfig
    from attnx.runtime.server import InferenceServer

    tok_dir = path.parent / "bench-tokenizer"
    if not (tok_dir / "tokenizer.json").is_file():
        tok_dir.mkdir(exist_ok=True)
        vocab = {f"t{i}": i for i in range(16000)}
        tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        tok.decoder = decoders.WordPiece()
        tok.save(str(tok_dir / "tokenizer.json"))
    return InferenceServer({"llama": path}, ServingConfig(port=0, threads=threads, max_batch=streams),
                           tokenizers={None: tok_dir})


# ----------------------------------------------------------------------------- variants


def bench_variants(root: Path, rounds: int, threads: int, variants: list[str], lowerings: list[str]) -> list[dict]:
    # Several sessions in one process: pool threads spinning after one's run would take the cores of the
    # next, so spinning is off for every contender here (equal settings; the ratio is what counts).
    contenders = {}
    for lowering in lowerings:
        for v in ["mha", *variants]:
            contenders[(v, lowering)] = attnx_contender(export(root, "llama", v, lowering), threads, spin=False)
    per = decode_rounds(contenders, rounds)
    rows = []
    for lowering in lowerings:
        for v in variants:
            rows.append({"variant": v, "lowering": lowering, "ms_token": round(statistics.median(per[(v, lowering)]), 3),
                         "mha_ms_token": round(statistics.median(per[("mha", lowering)]), 3),
                         "vs_mha": round(ratio(per, (v, lowering), ("mha", lowering)), 2)})
    table = Table("variant", "lowering", "ms/token", "mha ms/token", "variant / mha (per-round median)",
                  title=f"decode cost per variant, llama (every layer; maw appended), {threads} threads, "
                        f"{rounds} interleaved rounds (median)", title_justify="left")
    for r in rows:
        table.add_row(r["variant"], r["lowering"], f"{r['ms_token']:.2f}", f"{r['mha_ms_token']:.2f}", f"{r['vs_mha']:.2f}x")
    console.print(table)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--what", nargs="+", default=["decode", "concurrency", "variants"],
                    choices=["decode", "concurrency", "variants"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--variants", nargs="+", default=["cultural", "metaphor", "smal", "maw"])
    ap.add_argument("--lowerings", nargs="+", default=["plugin", "rewrite"])
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import transformers

    transformers.logging.set_verbosity_error()
    tmp = None
    if args.workdir is None:
        tmp = tempfile.TemporaryDirectory()
        args.workdir = Path(tmp.name)
    args.workdir.mkdir(parents=True, exist_ok=True)
    results = {"threads": args.threads, "torch": torch.__version__}
    try:
        if "decode" in args.what:
            results["decode"] = bench_decode(args.workdir, args.rounds, args.threads)
        if "concurrency" in args.what:
            results["concurrency"] = bench_concurrency(args.workdir, args.rounds, args.threads)
        if "variants" in args.what:
            results["variants"] = bench_variants(args.workdir, args.rounds, args.threads, args.variants, args.lowerings)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp.name, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    sys.exit(main())
