"""A GGUF of a Llama folder's own weights, written one tensor at a time, for ``bench_decoder_sizes.py --peers``.

    python _sizes_gguf.py FOLDER OUT.gguf Q4_0|Q8_0|F32

What ``convert_hf_to_gguf.py`` + ``llama-quantize --pure`` would write, without the llama.cpp tree: the ``llama``
architecture's metadata from config.json, the byte-level BPE of tokenizer.json (``gpt2`` model; tokens padded to the
vocabulary with ``[PAD{i}]``), every 2-D weight in the one type asked for (its q/k projections permuted into
llama.cpp's rotary layout, as the converter does), the norms F32, a tied model without ``output.weight``. Each
tensor is read from the (memory-mapped) safetensors, quantized with the ``gguf`` package and written before the
next: memory holds one tensor in fp32, never the model.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """HF's rotary halves -> llama.cpp's interleaved pairs (``convert_hf_to_gguf.LlamaModel.permute``)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def plan(config: dict, names: set[str]) -> list[tuple[str, str, int | None]]:
    """``(gguf name, folder name, heads to permute by)`` of every tensor."""
    out = [("token_embd.weight", "model.embed_tokens.weight", None)]
    per_layer = {"attn_q": ("self_attn.q_proj", config["num_attention_heads"]),
                 "attn_k": ("self_attn.k_proj", config["num_key_value_heads"]),
                 "attn_v": ("self_attn.v_proj", None), "attn_output": ("self_attn.o_proj", None),
                 "ffn_gate": ("mlp.gate_proj", None), "ffn_up": ("mlp.up_proj", None),
                 "ffn_down": ("mlp.down_proj", None), "attn_norm": ("input_layernorm", None),
                 "ffn_norm": ("post_attention_layernorm", None)}
    for i in range(config["num_hidden_layers"]):
        out += [(f"blk.{i}.{g}.weight", f"model.layers.{i}.{h}.weight", heads) for g, (h, heads) in per_layer.items()]
    out.append(("output_norm.weight", "model.norm.weight", None))
    if "lm_head.weight" in names and not config.get("tie_word_embeddings", False):
        out.append(("output.weight", "lm_head.weight", None))
    return out


def write_gguf(folder: Path, out: Path, qtype_name: str) -> Path:
    import gguf
    import torch
    from safetensors import safe_open

    config = json.loads((folder / "config.json").read_text())
    qtype = gguf.GGMLQuantizationType[qtype_name]
    handles = {}
    for file in sorted(folder.glob("*.safetensors")):
        handle = safe_open(str(file), framework="pt")
        handles.update({name: handle for name in handle.keys()})
    tensors = plan(config, set(handles))

    def load(name: str, heads: int | None) -> np.ndarray:
        arr = handles[name].get_tensor(name).to(torch.float32).numpy()
        return _permute(arr, heads) if heads else arr

    writer = gguf.GGUFWriter(str(out) + ".part", "llama")
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    writer.add_context_length(config.get("max_position_embeddings", 2048))
    writer.add_embedding_length(hidden)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config.get("rms_norm_eps", 1e-5))
    writer.add_rope_freq_base(config.get("rope_theta", 10000.0))
    writer.add_rope_dimension_count(config.get("head_dim") or hidden // heads)
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type({"Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
                          "F32": gguf.LlamaFileType.ALL_F32}[qtype_name])
    _tokenizer(writer, folder, config)
    shapes = {}
    for gname, hname, _ in tensors:
        dims = tuple(handles[hname].get_slice(hname).get_shape())
        shapes[gname] = dims
        if len(dims) >= 2 and qtype != gguf.GGMLQuantizationType.F32:
            byte_shape = gguf.quant_shape_to_byte_shape(dims, qtype)
            writer.add_tensor_info(gname, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=qtype)
        else:
            writer.add_tensor_info(gname, dims, np.dtype(np.float32), 4 * int(np.prod(dims)))
    writer.write_header_to_file(path=str(out) + ".part")
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for gname, hname, permute_heads in tensors:  # one tensor in memory at a time
        arr = load(hname, permute_heads)
        writer.write_tensor_data(gguf.quants.quantize(arr, qtype) if arr.ndim >= 2 and qtype_name != "F32" else arr)
        del arr
    writer.close()
    Path(str(out) + ".part").rename(out)
    return out


def _tokenizer(writer, folder: Path, config: dict) -> None:
    import gguf

    tok = json.loads((folder / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    special = {a["content"]: a["id"] for a in tok.get("added_tokens", [])}
    by_id = {i: t for t, i in {**vocab, **special}.items()}
    size = config["vocab_size"]
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(size)]
    types = [gguf.TokenType.CONTROL if tokens[i] in special else gguf.TokenType.NORMAL if i in by_id
             else gguf.TokenType.UNUSED for i in range(size)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"].get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for key, add in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id),
                     ("pad_token_id", writer.add_pad_token_id)):
        if isinstance(config.get(key), int):
            add(config[key])


if __name__ == "__main__":
    write_gguf(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3])
