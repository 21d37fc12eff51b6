"""Decoders exported from their checkpoint one tensor at a time (issue 44): no fp32 model in memory, each weight
read from the folder and written in its final form (fp32, fp16, MatMulNBits blocks) when the file writer reaches it.

- the blocks are ONNX Runtime's own: byte for byte what MatMulNBitsQuantizer writes for the same weights;
- the streamed fp32 file computes what transformers computes on the folder (bf16 weights widened per tensor);
- a subprocess exports a decoder whose fp32 weights are ~470 MB to int4 and its peak memory (the kernel's own
  high-water mark, ``VmHWM``) stays far below what holding those weights would take: a memory test, not a timing.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from attnx.contract import ModelInfo

#: A Llama shape whose fp32 weights (253M parameters, 1.01 GB) dwarf what a streamed export holds at once (its
#: largest tensor, the 32000 x 2048 embedding, is 262 MB in fp32) and whose graph is small (2 layers).
BIG = dict(hidden_size=2048, num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=4,
           intermediate_size=8192, vocab_size=32000, max_position_embeddings=256, tie_word_embeddings=False)


def write_random_folder(folder: Path, config: dict, dtype=torch.bfloat16, shards: int = 2, seed: int = 0) -> int:
    """A random Llama folder written shard by shard (never the whole model in memory); returns the parameter
    count. Weights ~N(0, 0.05) (norms 1), so logits are far from constant."""
    import transformers
    from accelerate import init_empty_weights
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    cfg = transformers.LlamaConfig(**config, architectures=["LlamaForCausalLM"])
    cfg.save_pretrained(folder)
    with init_empty_weights():
        shapes = {n: tuple(p.shape) for n, p in transformers.LlamaForCausalLM(cfg).named_parameters()}
    if cfg.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)  # a tied head is the embedding (save_pretrained leaves it out)
    names = sorted(shapes)
    g = torch.Generator().manual_seed(seed)
    # ~N(0, 0.05) values tiled from a base of prime length at a random offset per tensor: random enough for
    # logits far from constant, and quick (a full randn of a large model takes longer than its export)
    base = torch.randn(1_000_003, generator=g) * 0.05

    def weight(shape):
        if len(shape) == 1:
            return torch.ones(shape, dtype=dtype)
        numel = int(np.prod(shape))
        start = int(torch.randint(len(base), (1,), generator=g))
        reps = -(-(start + numel) // len(base))
        return base.to(dtype).repeat(reps)[start:start + numel].view(shape).clone()

    index, total = {}, 0
    for s in range(shards):
        part = names[s::shards]
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        tensors = {n: weight(shapes[n]) for n in part}
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
        total += sum(t.numel() for t in tensors.values())
        index.update({n: file for n in part})
        del tensors
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    return total


def _feeds(path: Path, ids: list[int]) -> dict:
    """Prefill feeds of a with-past export: one masked cache slot, then ``ids``."""
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = {"input_ids": np.array([ids], np.int64), "attention_mask": np.array([[0] + [1] * len(ids)], np.int64),
             "position_ids": np.arange(len(ids), dtype=np.int64)[None]}
    for i in session.get_inputs():
        if i.name.startswith("past_key_values."):
            dtype = np.float16 if i.type == "tensor(float16)" else np.float32
            feeds[i.name] = np.zeros([1, i.shape[1], 1, i.shape[3]], dtype)
    return session, {k: v for k, v in feeds.items() if k in {i.name for i in session.get_inputs()}}


def _logits(path: Path, ids: list[int]) -> np.ndarray:
    session, feeds = _feeds(path, ids)
    return session.run(["logits"], feeds)[0].reshape(-1)


def _hf_logits(folder: Path, ids: list[int]) -> np.ndarray:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(input_ids=torch.tensor([ids])).logits[0, -1].numpy()


# --------------------------------------------------------------------------- the blocks are ORT's own

@pytest.mark.parametrize("bits, symmetric", [(4, True), (8, False)])
@pytest.mark.parametrize("k", [96, 80])  # whole blocks, and a last block ORT pads
def test_blocks_are_byte_for_byte_what_matmulnbitsquantizer_writes(bits, symmetric, k):
    from onnx import TensorProto, helper, numpy_helper
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    from attnx.export import onnx_file
    from attnx.export.weight_only import quantize_graph

    rng = np.random.default_rng(k)
    w = (rng.standard_normal((k, 72)) * rng.uniform(0.01, 3, (k, 1))).astype(np.float32)  # K x N, uneven rows
    w[:, 3] = 0  # an all-zero column: the scale ORT gives it
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 72])],
                              [numpy_helper.from_array(w, "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    theirs = MatMulNBitsQuantizer(copy.deepcopy(model), bits=bits, block_size=32, is_symmetric=symmetric,
                                  accuracy_level=4)
    theirs.process()
    expected = {t.name.split("W")[-1]: numpy_helper.to_array(t) for t in theirs.model.model.graph.initializer}
    mine = onnx_file.from_proto(model)
    quantize_graph(mine, bits)
    got = {v.name.split("W")[-1]: v.const_value.numpy() for v in mine.graph.initializers.values()}
    assert sorted(got) == sorted(expected) == sorted([f"_Q{bits}", "_scales"] + ([] if symmetric else ["_zero_points"]))
    for key in expected:
        assert got[key].dtype == expected[key].dtype and got[key].shape == expected[key].shape, key
        assert got[key].tobytes() == expected[key].tobytes(), key


# --------------------------------------------------------------------------- streamed == loaded

@pytest.fixture(scope="module")
def small_bf16(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("bf16") / "llama"
    write_random_folder(folder, dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, intermediate_size=128, vocab_size=300,
                                     max_position_embeddings=64, tie_word_embeddings=True))
    return folder


def test_a_bf16_folder_streams_to_an_fp32_file_equal_to_transformers(small_bf16, tmp_path):
    from attnx.export.pretrained import export_pretrained

    result = export_pretrained(small_bf16, tmp_path / "out" / "model.onnx", with_past=True)
    assert getattr(result.model.hf, "attnx_source", None) is not None  # streamed, not loaded
    assert all(p.stride() == (0,) * p.dim() for p in result.model.hf.parameters() if p.dim())  # placeholders
    ids = [3, 17, 42, 99, 5, 200, 7]
    got, ref = _logits(result.path, ids), _hf_logits(small_bf16, ids)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


def test_fp16_decoder_streams_per_tensor(small_bf16, tmp_path):
    from attnx.export.pretrained import export_pretrained

    result = export_pretrained(small_bf16, tmp_path / "out" / "model.onnx", with_past=True, fp16=True)
    weights = [t for t in onnx.load(str(result.path)).graph.initializer if len(t.dims) == 2]
    assert weights and all(t.data_type == onnx.TensorProto.FLOAT16 for t in weights)
    ids = [3, 17, 42, 99, 5, 200, 7]
    got, ref = _logits(result.path, ids).astype(np.float32), _hf_logits(small_bf16, ids)
    # bf16 weights of ~N(0, 0.05) are exact in fp16; the arithmetic is fp16 (measured 0.3% of the largest logit)
    assert np.abs(got - ref).max() < 0.01 * np.abs(ref).max()


# --------------------------------------------------------------------------- bounded memory

_CHILD = textwrap.dedent("""
    import sys, json
    def status():
        return {l.split(':')[0]: int(l.split()[1]) * 1024 for l in open('/proc/self/status')
                if l.startswith(('VmRSS', 'VmHWM', 'RssAnon', 'RssFile'))}
    import torch, transformers, onnxruntime, onnx_ir
    from attnx.export.pretrained import export_pretrained
    import attnx.export.weight_only, attnx.pretrained.streamed, accelerate
    before = status()
    export_pretrained(sys.argv[1], sys.argv[2], with_past=True, weight_only_bits=4)
    print(json.dumps({"before": before, "after": status()}))
""")


def test_int4_export_of_a_decoder_peaks_far_below_its_fp32_weights(tmp_path):
    """The fp32 model (~470 MB) would not fit in what the export adds to the process: its peak RSS (VmHWM, every
    page it ever held at once, libraries included) minus the RSS of the same process before the export (torch,
    transformers, ONNX Runtime imported) stays under half the fp32 weights (measured a third: the trace, and the
    largest tensor's blocks while they are written). Loading them whole, as the export did before, adds at least
    the fp32 weights."""
    folder = tmp_path / "big"
    params = write_random_folder(folder, BIG)
    fp32_bytes = params * 4
    out = tmp_path / "int4" / "model.onnx"
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(folder), str(out)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    mem = json.loads(proc.stdout.strip().splitlines()[-1])
    added = mem["after"]["VmHWM"] - mem["before"]["VmRSS"]
    assert added < fp32_bytes / 2, (added / 1e6, fp32_bytes / 1e6, mem)  # measured 0.33 of them
    files = out.stat().st_size + out.with_name("model.onnx.data").stat().st_size
    assert files < fp32_bytes / 5  # int4 projections and embedding, an 8-bit head: ~0.2 of fp32
    # The blocks written a chunk of rows at a time are those of each whole weight (ORT's bytes: test above) ...
    from attnx.export.weight_only import quantize_rows
    from attnx.pretrained.tensors import SafetensorsSource

    stored = {t.name: onnx.numpy_helper.to_array(t, base_dir=str(out.parent))
              for t in onnx.load(str(out), load_external_data=False).graph.initializer
              if t.name.endswith(("lm_head.weight_Q8", "embed_tokens.weight_Q4", "layers.1.mlp.down_proj.weight_Q4"))}
    source = SafetensorsSource(sorted(folder.glob("*.safetensors")))
    block = ModelInfo.read(out).quantization["block_size"]
    assert block == 64  # int4's default where blocks of 64 divide every K (2048, 8192)
    for name, array in stored.items():
        bits = 8 if name.endswith("_Q8") else 4
        whole = source.read(name.removeprefix("model.hf.").removesuffix(f"_Q{bits}"))
        assert array.tobytes() == quantize_rows(whole, bits, symmetric=bits == 4, block_size=block)[0].tobytes(), name
    assert len(stored) == 3
    # ... and the file is the model: logits near transformers' fp32 ones within int4's error on these weights
    # (measured: max |d| 0.71 of the largest logit, correlation 0.72; int8 blocks of the same file 0.05 / 0.999:
    # per weight, int4's step is ~16x int8's; a wrong row, block or scale decorrelates them, ~0)
    ids = [3, 17, 42, 99, 5, 200, 7, 1000, 31000]  # (the base tiles every ~490 rows of the embedding)
    got, ref = _logits(out, ids), _hf_logits(folder, ids)
    assert np.abs(got - ref).max() < 1.0 * np.abs(ref).max(), (np.abs(got - ref).max(), np.abs(ref).max())
    assert np.corrcoef(got, ref)[0, 1] > 0.6


# --------------------------------------------------------------------------- GGUF blocks carried over

@pytest.mark.parametrize("qtype, bits", [("Q8_0", 8), ("Q4_0", 4)])
def test_gguf_blocks_at_the_exports_bits_are_written_as_they_are(tmp_path, monkeypatch, qtype, bits):
    """A GGUF whose matrices are Q8_0 (Q4_0) exported at 8 (4) bits: each MatMulNBits weight is the file's own
    blocks, re-laid, not requantized (the source's blocks, byte for byte, scales equal), with no zero-point input
    (the format's: 128, 8). Q4_0 at 4 bits carries the projections; its 8-bit lm_head is requantized."""
    import gguf_files

    from attnx.export.pretrained import export_pretrained
    from attnx.pretrained import read_folder
    from attnx.pretrained.tensors import source_of

    monkeypatch.setenv("ATTNX_CACHE", str(tmp_path / "cache"))
    # (matrices above 8192 values: smaller ones are folded with their values by the optimiser, then requantized)
    gguf = gguf_files.tiny_gguf(tmp_path / f"tiny.{qtype}.gguf", qtype=qtype, tied=False, hidden=128, ffn=256)
    result = export_pretrained(gguf, tmp_path / "out" / "model.onnx", with_past=True, weight_only_bits=bits)
    model = onnx.load(str(result.path))
    arrays = {t.name: onnx.numpy_helper.to_array(t, base_dir=str(result.path.parent)) for t in model.graph.initializer}
    source = source_of(read_folder(gguf))
    checked = 0
    for name in ("layers.1.mlp.down_proj.weight", "layers.0.self_attn.o_proj.weight"):
        blocks = source.blocks(f"model.{name}")
        node = next(n for n in model.graph.node
                    if n.op_type == "MatMulNBits" and n.input[1] == f"model.hf.model.{name}_Q{bits}")
        assert len(node.input) == 3  # no zero points: the format's default
        assert arrays[node.input[1]].tobytes() == blocks.data.tobytes()
        np.testing.assert_array_equal(arrays[node.input[2]], blocks.scales)
        checked += 1
    q = result.info.quantization
    assert checked == 2 and "taken from the source as they are" in q["source_blocks"]
    carried = {n.input[1] for n in model.graph.node if n.op_type == "MatMulNBits" and len(n.input) == 3
               and _attrs_bits(n) == bits}
    n = int(q["source_blocks"].split()[0])
    if bits == 8:  # requantized 8-bit weights are asymmetric (a zero-point input): the 3-input ones are the carried
        assert n == len(carried) >= 4  # o, down, packed gate/up per layer at least
    else:  # 4-bit weights are symmetric either way; the 8-bit head is requantized from Q4_0
        assert 2 <= n <= len(carried) and q["lm_head_bits"] == 8


def _attrs_bits(node) -> int:
    return next(a.i for a in node.attribute if a.name == "bits")
