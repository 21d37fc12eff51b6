"""Interpretability tour of attnx, offline and in seconds.

    python examples/interpretability.py [--out attnx-out/interp] [--gpt2 path/to/hf-gpt2-folder]

1. an ``mha`` encoder: run_with_cache, ablate a head, patch activations, analyze heads;
2. a GPT-2 checkpoint (``--gpt2``, or a tiny random one written here): logits, head
   analysis, and an HTML page + PNG heatmaps of its attention for a sentence.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from attnx.models import build_encoder
from attnx.interp.analysis import analyze_heads, format_behaviors
from attnx.pretrained.gpt2 import load_gpt2
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
    """A random 2-layer GPT-2 in Hugging Face layout (config.json, model.safetensors,
    tokenizer.json with one id per word of ``text``) - stands in for a real checkpoint."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = ["<unk>"] + sorted(set(text.split()))
    d, n_layer, n_pos = 64, 2, 32
    config = {"model_type": "gpt2", "n_layer": n_layer, "n_embd": d, "n_head": 4, "n_positions": n_pos,
              "vocab_size": len(words), "layer_norm_epsilon": 1e-5, "activation_function": "gelu_new"}
    g = torch.Generator().manual_seed(0)

    def rnd(*shape):  # std 0.3: peakier attention than GPT-2's 0.02 init
        return torch.randn(*shape, generator=g) * 0.3

    t = {"wte.weight": rnd(len(words), d), "wpe.weight": rnd(n_pos, d),
         "ln_f.weight": torch.ones(d), "ln_f.bias": torch.zeros(d)}
    for i in range(n_layer):
        p = f"h.{i}."
        t |= {p + "ln_1.weight": torch.ones(d), p + "ln_1.bias": torch.zeros(d),
              p + "ln_2.weight": torch.ones(d), p + "ln_2.bias": torch.zeros(d),
              p + "attn.c_attn.weight": rnd(d, 3 * d), p + "attn.c_attn.bias": rnd(3 * d),  # Conv1D: [in, out]
              p + "attn.c_proj.weight": rnd(d, d), p + "attn.c_proj.bias": rnd(d),
              p + "mlp.c_fc.weight": rnd(d, 4 * d), p + "mlp.c_fc.bias": rnd(4 * d),
              p + "mlp.c_proj.weight": rnd(4 * d, d), p + "mlp.c_proj.bias": rnd(d)}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    save_file(t, str(folder / "model.safetensors"))
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()  # joins words with spaces
    tok.save(str(folder / "tokenizer.json"))
    return folder


def gpt2_tour(out: Path, folder: Path | None) -> None:
    folder = folder or write_tiny_gpt2(out / "tiny-gpt2", TEXT)
    lm = load_gpt2(folder)
    ids = lm.encode(TEXT)  # [1, L]
    logits = lm(ids)  # [1, L, vocab]
    print(f"GPT-2 from {folder}: {len(lm.blocks)} layers, logits {list(logits.shape)}; "
          f"greedy next token after the text: {lm.to_text(logits[0, -1].argmax()[None])!r}")
    behaviors = analyze_heads(lm, ids)  # GPT2LM takes token ids; hook names as on the encoder
    print(format_behaviors(behaviors))
    paths = visualize_text(lm, lm.tokenizer, TEXT, out / "gpt2", layers=None, heads=None, dpi=80)
    print(f"wrote {paths['html']} and {', '.join(str(p) for p in paths['png'])}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("attnx-out/interp"))
    ap.add_argument("--gpt2", type=Path, default=None, help="a local Hugging Face GPT-2 folder (default: tiny random)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    encoder_tour(args.out)
    gpt2_tour(args.out, args.gpt2)
    print(f"done in {time.perf_counter() - t0:.1f}s; open {args.out / 'gpt2' / 'attention.html'} in a browser")


if __name__ == "__main__":
    main()
