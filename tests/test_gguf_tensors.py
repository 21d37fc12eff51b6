"""A GGUF's tensors read one at a time (:mod:`attnx.pretrained.gguf_tensors`, issue 44) against transformers' own
GGUF loader on the same file.

- every tensor :meth:`GgufSource.read` gives equals, bit for bit and in dtype, the state dict of
  ``from_pretrained(gguf_file=...)``: on the real SmolLM2-135M-Instruct (Q4_1, a Q8_0 embedding, F32 norms) and on
  small files of every type the gguf package reads (Q4_0 ... Q8_0, the k-quants, F16, BF16, a Q4_K_M-like mix),
  Llama (its Q/K rows reordered) and Qwen2 (biases, an untied head);
- :meth:`GgufSource.blocks`: Q4_0 and Q8_0 re-laid for MatMulNBits dequantize, the MatMulNBits way, to exactly
  ``read``'s tensor (Q/K rows in transformers' order), and an ONNX Runtime MatMulNBits node with them computes
  ``x @ W.T``; other types have none;
- reading every tensor of the real file leaves no file pages in RSS;
- a GGUF-backed folder's name drops the quantization tag.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

import gguf_files

transformers.logging.set_verbosity_error()


def _mix(name: str) -> str:
    """Roughly what GGUF-my-repo's Q4_K_M writes: Q6_K for attn_v / ffn_down, Q4_K elsewhere; a Q5_0 embedding
    (the fallback llama.cpp uses where a row does not fill a k-quant super-block)."""
    if name.endswith(("attn_v.weight", "ffn_down.weight")):
        return "Q6_K"
    return "Q5_0" if name == "token_embd.weight" else "Q4_K"


#: file kind -> tiny_gguf arguments (rows of 256 where k-quants need them; 8 heads over 2 KV heads, so the Q/K
#: row reordering is not the identity)
FILES = {
    "Q4_0": dict(qtype="Q4_0"), "Q4_1": dict(qtype="Q4_1"), "Q5_0": dict(qtype="Q5_0"),
    "Q8_0": dict(qtype="Q8_0"), "F16": dict(qtype="F16"), "F32": dict(qtype="F32"), "BF16": dict(qtype="BF16"),
    "Q4_K": dict(qtype="Q4_K"), "Q6_K": dict(qtype="Q6_K", tied=False), "Q4_K_M": dict(qtype=_mix, tied=False),
    "qwen2-Q4_0": dict(arch="qwen2", qtype="Q4_0", tied=False), "qwen2-Q8_0": dict(arch="qwen2", qtype="Q8_0"),
}


def _file(kind: str, folder: Path) -> Path:
    return gguf_files.tiny_gguf(folder / f"tiny-{kind}.gguf", hidden=256, ffn=512, heads=8, kv_heads=2, seed=11,
                                **FILES[kind])


def _transformers_state(gguf: Path) -> dict:
    model = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    return model.state_dict()


def _check_equal(source, want: dict) -> None:
    infos = source.infos()
    tied = [k for k in want if k not in infos]
    assert tied in ([], ["lm_head.weight"]), tied  # a tied head is the embedding, not a tensor of the file
    for name, info in infos.items():
        got = source.read(name)
        assert got.dtype == want[name].dtype == torch.float32, name
        assert tuple(got.shape) == info.shape == tuple(want[name].shape), name
        assert torch.equal(got, want[name]), name


@pytest.mark.parametrize("kind", list(FILES))
def test_every_tensor_equals_transformers_gguf_loader(kind, tmp_path, monkeypatch):
    from attnx.pretrained import gguf_tensors
    from attnx.pretrained.gguf_tensors import GgufSource

    monkeypatch.setattr(gguf_tensors, "_DEQUANT_VALUES", 1000)  # a few rows per step: the chunks' seams tested
    gguf = _file(kind, tmp_path)
    with GgufSource(gguf) as source:
        _check_equal(source, _transformers_state(gguf))
        types = {i.dtype for i in source.infos().values()}
    assert types == {"F32"} | ({"Q6_K", "Q4_K", "Q5_0"} if kind == "Q4_K_M" else {FILES[kind]["qtype"]})


def test_every_tensor_of_the_real_smollm2_gguf_equals_transformers():
    from attnx.pretrained.gguf_tensors import GgufSource

    real = gguf_files.smollm2_gguf()
    with GgufSource(real) as source:
        assert len(source.infos()) == 272
        _check_equal(source, _transformers_state(real))


def _matmulnbits_weight(blocks) -> torch.Tensor:
    """MatMulNBits' dequantization of ``blocks``: (q - zero point) * scale, q unpacked low nibble first."""
    data = blocks.data
    if blocks.bits == 4:
        q = np.stack([data & 0x0F, data >> 4], axis=-1).reshape(*data.shape[:2], -1)
    else:
        q = data
    zero = 8 if blocks.bits == 4 else 128
    w = (q.astype(np.float32) - np.float32(zero)) * blocks.scales[..., None]
    return torch.from_numpy(w.reshape(data.shape[0], -1))


@pytest.mark.parametrize("kind", ["Q4_0", "Q8_0", "qwen2-Q4_0", "Q4_1", "Q4_K_M"])
def test_q4_0_and_q8_0_blocks_are_matmulnbits_blocks_of_the_same_weights(kind, tmp_path):
    from attnx.pretrained.gguf_tensors import GgufSource

    with GgufSource(_file(kind, tmp_path)) as source:
        carried, matrices = 0, sum(len(i.shape) == 2 for i in source.infos().values())
        for name, info in source.infos().items():
            blocks = source.blocks(name)
            if info.dtype not in ("Q4_0", "Q8_0") or len(info.shape) != 2:
                assert blocks is None, name
                continue
            carried += 1
            bits = 4 if info.dtype == "Q4_0" else 8
            rows, cols = info.shape
            assert (blocks.bits, blocks.block_size, blocks.zero_points) == (bits, 32, None)
            assert blocks.data.dtype == np.uint8 and blocks.data.shape == (rows, cols // 32, 32 * bits // 8)
            assert blocks.scales.dtype == np.float32 and blocks.scales.shape == (rows, cols // 32)
            assert torch.equal(_matmulnbits_weight(blocks), source.read(name)), name
    # every matrix of a Q4_0/Q8_0 file (q_proj and k_proj reordered) is carried over; none of another type
    assert carried == (0 if kind in ("Q4_1", "Q4_K_M") else matrices)


@pytest.mark.parametrize("kind", ["Q4_0", "Q8_0"])
def test_an_onnx_runtime_matmulnbits_node_with_the_blocks_computes_x_times_w(kind, tmp_path):
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from attnx.pretrained.gguf_tensors import GgufSource

    name = "model.layers.1.self_attn.q_proj.weight"  # reordered rows
    with GgufSource(_file(kind, tmp_path)) as source:
        blocks, weight = source.blocks(name), source.read(name)
    rows, cols = weight.shape
    node = helper.make_node("MatMulNBits", ["x", "B", "scales"], ["y"], domain="com.microsoft", K=cols, N=rows,
                            bits=blocks.bits, block_size=blocks.block_size, accuracy_level=0)
    graph = helper.make_graph([node], "nbits", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, cols])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, rows])],
                              [numpy_helper.from_array(blocks.data, "B"),
                               numpy_helper.from_array(blocks.scales.reshape(-1), "scales")])
    model = helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 21),
                                                                 helper.make_opsetid("com.microsoft", 1)])
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).standard_normal((5, cols)).astype(np.float32)
    got = session.run(None, {"x": x})[0]
    want = (torch.from_numpy(x).double() @ weight.double().T).numpy()
    scale = np.abs(x).sum(1, keepdims=True) * float(weight.abs().max())  # the sum's magnitude: fp32 rounding of it
    assert np.all(np.abs(got - want) <= 1e-6 * scale + 1e-6), float(np.abs(got - want).max())


def _rss_file_kb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssFile:"):
            return int(line.split()[1])
    pytest.skip("no RssFile in /proc/self/status")


def test_reading_every_tensor_leaves_no_file_pages_in_rss():
    """The 98 MB file read tensor by tensor: file-backed RSS grows by no more than the metadata's pages."""
    from attnx.pretrained.gguf_tensors import GgufSource

    real = gguf_files.smollm2_gguf()
    with GgufSource(real) as source:
        names = list(source.infos())
        source.read(names[1]), source.blocks(names[1])  # the code's own pages (libraries) touched first
        before = _rss_file_kb()
        for name in names:
            source.read(name)
            source.blocks(name)
        grown = _rss_file_kb() - before
    assert grown < 8 * 1024, f"file-backed RSS grew {grown} kB reading the {real.stat().st_size >> 20} MB file"


@pytest.mark.parametrize("file, name", [
    ("SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"),
    ("smollm2-135m-instruct-q4_k_m.gguf", "smollm2-135m-instruct"),
    ("Meta-Llama-3.1-8B-Instruct-Q4_K_M.gguf", "Meta-Llama-3.1-8B-Instruct"),
    ("gemma-3-270m-it-UD-IQ4_XS.gguf", "gemma-3-270m-it-UD"),
    ("qwen2.5-0.5b-instruct-fp16.gguf", "qwen2.5-0.5b-instruct"),
    ("model.BF16.gguf", "model"),
    ("tiny-llama.gguf", "tiny-llama"),
    ("Q4_0.gguf", "Q4_0"),
])
def test_the_folder_is_named_without_the_quantization_tag(file, name):
    from attnx.pretrained.gguf import model_name

    assert model_name(Path(file)) == name


def test_fp32_folder_for_other_tools_holds_transformers_tensors(tmp_path, monkeypatch):
    """The benchmarks' peers read only Hugging Face folders: ``fp32_folder`` writes one, tensor by tensor, that
    transformers loads to the GGUF loader's model (untied head, Q/K reordered)."""
    from attnx.pretrained.gguf import fp32_folder

    monkeypatch.setenv("ATTNX_CACHE", str(tmp_path / "cache"))
    gguf = _file("Q4_K_M", tmp_path)
    out = fp32_folder(gguf, tmp_path / "hf")
    got = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    want = _transformers_state(gguf)
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
