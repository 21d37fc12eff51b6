"""``genai_config.json`` beside a with-past export, so onnxruntime-genai generates from the same file.

onnxruntime-genai (``pip install onnxruntime-genai``) reads a folder: ``genai_config.json`` (the model's
sizes, the names of its inputs and outputs, its special tokens, the default search) and the tokenizer
files (``tokenizer.json``, ``tokenizer_config.json``) beside it. It drives the cache itself: it feeds
``past_key_values.{i}.key|value`` and reads ``present.{i}.key|value`` for ``num_hidden_layers`` layers,
and nothing else, so a file runs under it when

- its cache is k and v only (mha, cultural, metaphor and variants like them; not smal's key term or
  maw's per-depth keys and pool, which it would never feed back), and
- it has no context inputs: onnxruntime-genai 0.18 feeds a decoder nothing else (``Generator.set_inputs``,
  its way to add inputs, is for multimodal models; text decoders refuse it).

So of attnx's variants it runs ``mha`` (any family it knows); every other variant takes context inputs
(cultural, metaphor, smal, the toy) or keeps more than k and v in its cache (smal, maw).

:func:`genai_support` says which, and why not; the config is written for every with-past export and
``attnx export`` prints the reasons for a file it cannot run (onnxruntime-genai's parser refuses keys it does
not know, so they cannot go into the config itself).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

#: onnxruntime-genai's ``model.type``: its generic decoder for every family. The graph holds everything a family
#: does (positions, scaling, masks), so genai's per-family types add nothing (measured: a Llama gives the same
#: greedy tokens as ``decoder`` and as ``llama``); its ``gpt2`` type would even expect the legacy ``past_%d`` layout.
GENAI_TYPE = "decoder"
CONFIG_NAME = "genai_config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def genai_support(info) -> list[str]:
    """Why onnxruntime-genai cannot run this with-past export by itself (empty: it can)."""
    reasons = []
    cache = info.cache or {}
    extra = sorted({e["name"] for e in cache.get("entries", []) if e["name"] not in ("key", "value")})
    if extra:
        reasons.append(f"its cache holds more than k and v ({', '.join(extra)}), which onnxruntime-genai does not "
                       "feed back between steps")
    if cache.get("layers", 0) != cache.get("host_layers", 0):
        reasons.append("layers appended after the last one keep their own cache, beyond num_hidden_layers")
    context = [e.name for e in info.inputs if e.role == "context"]
    if context:
        reasons.append(f"it takes context input(s) ({', '.join(context)}), and onnxruntime-genai feeds a decoder only "
                       "input_ids, attention_mask, position_ids and the cache (its Generator.set_inputs refuses text "
                       "decoders: 'SetInputs is not supported for this model type')")
    return reasons


def genai_config(info, onnx_name: str, hf_config: dict) -> dict:
    """The config onnxruntime-genai reads, from an export's metadata and its source's ``config.json``."""
    cache = info.cache or {}
    text = hf_config.get("text_config") or hf_config
    keys = [e for e in cache.get("entries", []) if e["name"] == "key" and e["layer"] < cache.get("host_layers", 0)]
    if not keys:
        raise ValueError("not a with-past export: no past_key_values.{i}.key inputs in its attnx.cache metadata")
    shape = keys[0]["shape"]  # [batch, kv_heads, past, head_dim]
    heads = int(text.get("num_attention_heads") or text.get("n_head") or shape[1])
    hidden = int(text.get("hidden_size") or text.get("n_embd") or heads * int(shape[3]))
    vocab = next(int(e.shape[-1]) for e in info.outputs if e.name == "logits")
    eos = cache.get("eos_token_id") or []
    pad = text.get("pad_token_id")
    inputs = {"input_ids": "input_ids", "attention_mask": "attention_mask",
              "past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value"}
    if cache.get("position_ids"):
        inputs["position_ids"] = "position_ids"
    context_length = int(cache.get("max_positions") or text.get("max_position_embeddings") or 2048)
    config = {
        "model": {
            "type": GENAI_TYPE,
            "bos_token_id": cache.get("bos_token_id") if cache.get("bos_token_id") is not None else (eos[0] if eos else 0),
            "eos_token_id": eos if len(eos) != 1 else eos[0],
            "pad_token_id": int(pad) if pad is not None else (eos[0] if eos else 0),
            "vocab_size": vocab,
            "context_length": context_length,
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "filename": onnx_name,
                "head_size": int(shape[3]),
                "hidden_size": hidden,
                "num_attention_heads": heads,
                "num_key_value_heads": int(shape[1]),
                "num_hidden_layers": len(keys),
                "inputs": inputs,
                "outputs": {"logits": "logits", "present_key_names": "present.%d.key",
                            "present_value_names": "present.%d.value"},
            },
        },
        # Greedy by default, as `attnx generate`. The cache grows by concatenation (present = past + new), so
        # onnxruntime-genai must not share one buffer between past and present.
        "search": {"do_sample": False, "num_beams": 1, "num_return_sequences": 1, "max_length": context_length,
                   "min_length": 0, "temperature": 1.0, "top_k": 1, "top_p": 1.0, "repetition_penalty": 1.0,
                   "length_penalty": 1.0, "no_repeat_ngram_size": 0, "diversity_penalty": 0.0,
                   "early_stopping": True, "past_present_share_buffer": False},
    }
    return config


def write_genai_files(onnx_path: str | Path, info, hf_config: dict, tokenizer_dir: str | Path | None) -> Path:
    """``genai_config.json`` and the tokenizer files onnxruntime-genai reads, beside ``onnx_path``."""
    onnx_path = Path(onnx_path)
    folder = onnx_path.parent
    config = genai_config(info, onnx_path.name, hf_config)
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            src = Path(tokenizer_dir) / name
            if src.is_file():
                shutil.copyfile(src, folder / name)
    out = folder / CONFIG_NAME
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(config, indent=2) + "\n")
    tmp.replace(out)
    return out
