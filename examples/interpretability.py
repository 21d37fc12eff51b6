"""Interpretability tour of attnx, offline and in seconds.

    python examples/interpretability.py [--out attnx-out/interp] [--lm path/to/hf-causal-lm-folder]

1. an ``mha`` encoder: run_with_cache, ablate a head, patch activations, analyze heads;
2. a causal LM (``--lm``: any Hugging Face folder of a family with transformers' attention
   interface, GPT-2, Llama, Qwen...; or a tiny random GPT-2 written here), run by transformers' own
   model with attnx's attention backend: logits, head analysis with TransformerLens hook names, and
   an HTML page + PNG heatmaps of its attention for a sentence.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from attnx.models import build_encoder
from attnx.explain.analysis import format_behaviors
from attnx.interp.analysis import analyze_heads
from attnx import pretrained
from attnx.interp import patch_heads, run_with_cache
from attnx.interp.visualize import save_attention_html, save_layer_pngs, visualize_text

TEXT = "the cat sat on the mat and the dog sat on the log"


def encoder_tour(out: Path) -> None:
    torch.manual_seed(0)
    enc = build_encoder("mha", n_layers=2, d_model=64, n_heads=4, is_causal=True)
    x = torch.randn(2, 10, 64)  # [B, L, d_model]
    mask = torch.tensor([[1] * 10, [1] * 7 + [0] * 3])  # example 1 has 3 padding tokens

    # 1. Cache every hook point.
    y, cache = run_with_cache(enc, x, mask)
    print(f"cached {len(cache)} activations; blocks.1.attn.hook_pattern {list(cache.pattern(1).shape)}")

    # 2. Ablate layer 1 head 2 (head_mask [n_layers, H], 0 = off) and measure the effect.
    head_mask = torch.ones(2, 4)
    head_mask[1, 2] = 0
    delta = (enc(x, mask, head_mask=head_mask) - y).norm() / y.norm()
    print(f"ablating L1H2 changes the output by {delta:.3f} (relative norm)")

    # 3. Activation patching: which head's z carries the difference between two inputs?
    clean, corrupted = {"hidden_states": x[:1]}, {"hidden_states": x[:1] + 0.5 * torch.randn(1, 10, 64)}
    target = enc(**clean)[0, -1]

    def metric(out: torch.Tensor) -> torch.Tensor:  # closeness of the last position to the clean run
        return -(out[0, -1] - target).norm()

    scores = patch_heads(enc, clean, corrupted, metric)  # [n_layers, H]
    best = divmod(int(scores.argmax()), 4)
    print(f"patching sweep (higher = restores more):\n{scores.numpy().round(3)}\nbest head: L{best[0]}H{best[1]}")

    # 4. Head analysis.
    behaviors = analyze_heads(enc, x, mask)
    print(format_behaviors(behaviors))
    tokens = [f"t{i}" for i in range(10)]
    save_attention_html(out / "encoder.html", tokens, cache, behaviors=behaviors, title="mha encoder (random)")
    save_layer_pngs(out / "encoder", tokens, cache, behaviors=behaviors, dpi=80)


def write_tiny_gpt2(folder: Path, text: str) -> Path:
    """A random 2-layer GPT-2 saved by transformers (config.json, model.safetensors) with a word-level
    tokenizer.json (one id per word of ``text``): stands in for a real checkpoint."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = ["<unk>"] + sorted(set(text.split()))
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=32, vocab_size=len(words))
    model = transformers.GPT2LMHeadModel(config)
    with torch.no_grad():  # std 0.3: peakier attention than GPT-2's 0.02 init
        for name, p in model.named_parameters():
            if not (".ln_" in name or "ln_f" in name):
                p.normal_(0.0, 0.3)
    model.save_pretrained(folder)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()  # joins words with spaces
    tok.save(str(folder / "tokenizer.json"))
    return folder


def lm_tour(out: Path, folder: Path | None) -> None:
    from tokenizers import Tokenizer

    folder = folder or write_tiny_gpt2(out / "tiny-gpt2", TEXT)
    lm = pretrained.load(folder, "mha", task="causal-lm")  # transformers' own model, attnx's attention
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ids = torch.tensor([tokenizer.encode(TEXT).ids])  # [1, L]
    with torch.no_grad():
        logits = lm(ids)["logits"]  # [1, L, vocab]
    print(f"{type(lm.hf).__name__} from {folder}: {len(lm.blocks)} layers, logits {list(logits.shape)}; "
          f"greedy next token after the text: {tokenizer.decode([int(logits[0, -1].argmax())])!r}")
    behaviors = analyze_heads(lm, ids)  # token ids in; hook names blocks.{i}.attn.hook_pattern as on the encoder
    print(format_behaviors(behaviors))
    paths = visualize_text(lm, tokenizer, TEXT, out / "lm", layers=None, heads=None, dpi=80)
    print(f"wrote {paths['html']} and {', '.join(str(p) for p in paths['png'])}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("attnx-out/interp"))
    ap.add_argument("--lm", type=Path, default=None, help="a local Hugging Face causal-LM folder (default: a tiny "
                    "random GPT-2)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    encoder_tour(args.out)
    lm_tour(args.out, args.lm)
    print(f"done in {time.perf_counter() - t0:.1f}s; open {args.out / 'lm' / 'attention.html'} in a browser")


if __name__ == "__main__":
    main()
