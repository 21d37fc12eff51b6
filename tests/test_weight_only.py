"""``attnx export --with-past --weights int4|int8`` (issue 34, item 2): a decoder's MatMul weights as ONNX Runtime's
block-wise ``MatMulNBits``, and ``attnx check`` judging it by perplexity and greedy agreement against fp32.

The tiny random Llama of ``tests/hf_folders.py``: its fp32 with-past export is the baseline of every number.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

import generation_fixtures as gf
from attnx.contract import ModelInfo
from support.cli import run as attnx

BITS = {"int8": 8, "int4": 4}


def _export(weights: str):
    return gf.export(gf.folder("llama"), "mha", weight_only_bits=BITS[weights])


def _weight_bytes(path) -> int:
    """Bytes of an export's initializers, wherever they are stored (inside the file or in its .data)."""
    total = 0
    for t in onnx.load(str(path), load_external_data=False).graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            total += int({e.key: e.value for e in t.external_data}["length"])
        else:
            total += len(t.raw_data) if t.raw_data else onnx.numpy_helper.to_array(t).nbytes
    return total


def _constant_matmul_weights(model: onnx.ModelProto) -> dict[str, tuple[int, ...]]:
    inits = {t.name: tuple(t.dims) for t in model.graph.initializer}
    return {n.input[1]: inits[n.input[1]] for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in inits}


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _head_output(model: onnx.ModelProto) -> str:
    """The output of the fp32 export's lm_head: the one constant MatMul whose weight is [hidden, vocab]."""
    vocab = json.loads((gf.folder("llama") / "config.json").read_text())["vocab_size"]
    inits = {t.name: tuple(t.dims) for t in model.graph.initializer}
    (out,) = [n.output[0] for n in model.graph.node
              if n.op_type == "MatMul" and inits.get(n.input[1], ())[-1:] == (vocab,)]
    return out


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_every_constant_matmul_becomes_matmulnbits_and_its_fp32_weight_goes(weights):
    """int8: every projection in asymmetric 8-bit blocks (a zero-point input). int4: symmetric 4-bit blocks (no
    zero points), except the lm_head, which is the one 8-bit asymmetric MatMulNBits."""
    bits = BITS[weights]
    fp32_path, path = gf.export(gf.folder("llama"), "mha"), _export(weights)
    fp32, quant = onnx.load(str(fp32_path)), onnx.load(str(path))
    matmuls = _constant_matmul_weights(fp32)
    assert len(matmuls) == 9  # 2 layers x (packed qkv, o, packed gate/up, down) + lm_head
    nbits = [n for n in quant.graph.node if n.op_type == "MatMulNBits"]
    assert len(nbits) == len(matmuls) and not _constant_matmul_weights(quant)
    head = _head_output(fp32)
    assert head in {o.name for o in quant.graph.output}  # the logits
    layout = {n.output[0]: (_attrs(n)["bits"], _attrs(n)["block_size"], _attrs(n)["accuracy_level"], len(n.input))
              for n in nbits}
    if weights == "int8":  # asymmetric: A, B, scales, zero points
        assert set(layout.values()) == {(8, 32, 4, 4)}
    else:
        assert layout.pop(head) == (8, 32, 4, 4)  # exactly one 8-bit node, the lm_head ...
        assert set(layout.values()) == {(4, 32, 4, 3)}  # ... and 8 symmetric 4-bit ones
    names = {t.name for t in quant.graph.initializer}
    embed = "model.hf.model.embed_tokens.weight"
    assert not names & {*matmuls, embed}  # no fp32 copy of a quantized weight, the embedding's table included
    (gather,) = [n for n in quant.graph.node if n.op_type == "GatherBlockQuantized"]
    assert _attrs(gather) == {"bits": bits, "block_size": 32, "gather_axis": 0, "quantize_axis": 2}
    assert gather.input[0] == f"{embed}_Q{bits}" and not [n for n in quant.graph.node if n.op_type == "Gather"
                                                           and n.input[0] in names]
    # bytes per quantized weight: 8-bit asymmetric 1 plus an fp32 scale and a uint8 zero point per 32, 4-bit
    # symmetric 1/2 plus an fp32 scale per 32 (the embedding at the projections' bits)
    stored = {8: 1 + 5 / 32, 4: 1 / 2 + 4 / 32}
    bits_of = {n.input[1]: 8 if n.output[0] == head else bits for n in fp32.graph.node
               if n.op_type == "MatMul" and n.input[1] in matmuls}
    vocab, hidden = (t.dims for t in fp32.graph.initializer if t.name == embed).__next__()
    saved = sum(int(np.prod(shape)) * (4 - stored[bits_of[w]]) for w, shape in matmuls.items()) + \
        vocab * hidden * (4 - stored[bits])
    expected = _weight_bytes(fp32_path) - saved  # (the files: model.onnx + model.onnx.data, page-aligned)
    assert abs(_weight_bytes(path) - expected) < 0.02 * _weight_bytes(fp32_path), (_weight_bytes(path), expected)
    info = ModelInfo.read(path)
    assert info.precision == f"{weights}-weights" and info.cache
    q = info.quantization
    assert (q["bits"], q["block_size"], q["accuracy_level"], q["matmuls"]) == (bits, 32, 4, 9)
    assert (q["symmetric"], q["lm_head_bits"], q["lm_head_symmetric"]) == (bits == 4, 8, False)
    assert q["weights"].startswith({"int8": "int8, asymmetric", "int4": "int4, symmetric"}[weights])
    assert ("the lm_head int8, asymmetric" in q["weights"]) == (weights == "int4")
    assert "int8" in q["activations"] and "per block of 32" in q["activations"]  # what accuracy_level 4 does
    assert q["embedding"].startswith(f"GatherBlockQuantized, int{bits}")
    assert json.loads((path.parent / "genai_config.json").read_text())["model"]["decoder"]["filename"] == "model.onnx"


def _dequantize(node: onnx.NodeProto, inits: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """MatMulNBits' own layout read back by hand: ``(q, zero_point, scale, bits)``, each [N, blocks, 1 or 32].
    B [N, blocks, 32 * bits / 8] (4 bits: two per byte, low nibble first), scales [N * blocks], zero points uint8
    packed the same way per column ([N, blocks] at 8 bits, [N, ceil(blocks / 2)] at 4), or 2^(bits-1) if absent."""
    attrs = _attrs(node)
    bits, N, blocks = attrs["bits"], attrs["N"], -(-attrs["K"] // attrs["block_size"])

    def unpack(packed, n):
        codes = np.stack([packed & 15, packed >> 4], -1).reshape(N, -1) if bits == 4 else packed.reshape(N, -1)
        return codes[:, :n].astype(np.int32)

    q = unpack(inits[node.input[1]], blocks * 32).reshape(N, blocks, 32)
    zp = (unpack(inits[node.input[3]], blocks).reshape(N, blocks, 1) if len(node.input) > 3
          else np.full((N, blocks, 1), 2 ** (bits - 1), np.int32))
    return q, zp, inits[node.input[2]].reshape(N, blocks, 1), bits


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_the_stored_blocks_dequantize_to_the_fp32_weights_within_half_a_step(weights):
    """Every stored weight, ``(q - zero_point) * scale``, is within half a step of the fp32 weight (round to
    nearest). Symmetric blocks (int4's projections): the step is the block's largest |w| / 2^(bits-1) and only
    the top code 2^(bits-1)-1 may clip up to one step (the largest |w| takes -2^(bits-1)). Asymmetric blocks
    (int8, int4's lm_head): the step spans the block's range with 0 in it, (max(w, 0) - min(w, 0)) / (2^bits - 1)."""
    from onnx import numpy_helper

    fp32, quant = onnx.load(str(gf.export(gf.folder("llama"), "mha"))), onnx.load(str(_export(weights)))
    weight_of = {n.output[0]: numpy_helper.to_array(next(t for t in fp32.graph.initializer if t.name == n.input[1]))
                 for n in fp32.graph.node if n.op_type == "MatMul" and n.input[1] in _constant_matmul_weights(fp32)}
    inits = {t.name: numpy_helper.to_array(t) for t in quant.graph.initializer}
    checked = {}
    for node in (n for n in quant.graph.node if n.op_type == "MatMulNBits"):
        q, zp, step, bits = _dequantize(node, inits)
        N, blocks = step.shape[:2]
        w = weight_of[node.output[0]]  # [K, N]
        assert w.shape == (_attrs(node)["K"], N)
        w_blocks = np.zeros((N, blocks * 32), np.float32)
        w_blocks[:, :w.shape[0]] = w.T
        w_blocks = w_blocks.reshape(N, blocks, 32)
        err = np.abs((q - zp) * step - w_blocks) / np.abs(step)
        if len(node.input) == 3:  # symmetric
            half = 2 ** (bits - 1)
            np.testing.assert_allclose(np.abs(step), np.abs(w_blocks).max(-1, keepdims=True) / half, rtol=1e-6)
            assert err.max() <= 1 + 1e-5 and err[q - zp < half - 1].max() <= 0.5 + 1e-5, (node.name, err.max())
        else:
            span = np.maximum(w_blocks.max(-1, keepdims=True), 0) - np.minimum(w_blocks.min(-1, keepdims=True), 0)
            np.testing.assert_allclose(step, span / (2 ** bits - 1), rtol=1e-6)
            assert err.max() <= 0.5 + 1e-5, (node.name, err.max())
            assert len({*zp.ravel()}) > 1  # a zero point per block, not one fixed offset
        checked[bits, len(node.input)] = checked.get((bits, len(node.input)), 0) + 1
    assert checked == ({(8, 4): 9} if weights == "int8" else {(4, 3): 8, (8, 4): 1})


def _matmul_chain(tail: list[str]) -> onnx.ModelProto:
    """``x [1, 64] -> MatMul(W1 [64, 64]) -> MatMul(W2 [64, 96]) -> *tail -> logits``: a hand-made graph."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((64, 64)).astype(np.float32), "W1"),
             numpy_helper.from_array(rng.standard_normal((64, 96)).astype(np.float32), "W2"),
             numpy_helper.from_array(rng.standard_normal(96).astype(np.float32), "bias"),
             numpy_helper.from_array(np.array([1, 96], np.int64), "shape")]
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h"], name="up"),
             helper.make_node("MatMul", ["h", "W2"], ["t0"], name="head")]
    for i, op in enumerate(tail):
        ins = {"Add": [f"t{i}", "bias"], "Reshape": [f"t{i}", "shape"], "Mul": [f"t{i}", "h2"]}.get(op, [f"t{i}"])
        nodes.append(helper.make_node(op, ins, [f"t{i + 1}"], name=f"tail{i}"))
    nodes.append(helper.make_node("Identity", [f"t{len(tail)}"], ["logits"], name="out"))
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])]
    if "Mul" in tail:
        inputs.append(helper.make_tensor_value_info("h2", TensorProto.FLOAT, [1, 96]))
    logits = helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 96])
    graph = helper.make_graph(nodes, "chain", inputs, [logits], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


@pytest.mark.parametrize("tail, head_bits", [
    ([], 8), (["Add", "Reshape"], 8),  # a bias and a reshape between the head and the logits: still the head
    (["Relu"], 4), (["Mul"], 4),  # an op it does not walk through, a second computed operand: no head found
])
def test_int4_finds_the_lm_head_from_the_logits_or_keeps_every_matmul_at_4_bits(tmp_path, tail, head_bits):
    from attnx.export.weight_only import lm_head, quantize_weights

    model = _matmul_chain(tail)
    head = lm_head(model.graph)
    assert (head.name if head is not None else None) == ("head" if head_bits == 8 else None)
    onnx.save(model, tmp_path / "fp32.onnx")
    assert quantize_weights(tmp_path / "fp32.onnx", tmp_path / "int4.onnx", 4) == 2
    quant = onnx.load(str(tmp_path / "int4.onnx"))
    bits = {n.name: (_attrs(n)["bits"], len(n.input)) for n in quant.graph.node if n.op_type == "MatMulNBits"}
    assert bits == {"up_Q4": (4, 3), f"head_Q{head_bits}": (head_bits, 4 if head_bits == 8 else 3)}
    # and the two passes wrote a model that runs and computes the fp32 one, quantized
    x = np.random.default_rng(1).standard_normal((1, 64)).astype(np.float32)
    feeds = {"x": x, **({"h2": np.ones((1, 96), np.float32)} if "Mul" in tail else {})}
    ref = ort.InferenceSession(str(tmp_path / "fp32.onnx"), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    got = ort.InferenceSession(str(tmp_path / "int4.onnx"), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    # measured 7% of the largest |output| with the 8-bit head, 16% with both at 4 bits (random normal weights,
    # K = 64, int8 activations); a wrong scale, zero point or nibble order is ~100%
    assert 0 < np.abs(got - ref).max() < (0.15 if head_bits == 8 else 0.3) * np.abs(ref).max()


def test_logits_are_near_fp32_int8_closer_than_int4():
    from attnx.runtime import TextModel

    fp32 = TextModel(gf.export(gf.folder("llama"), "mha"))
    ids = fp32.tokenizer.tokenize(["the cat sat on the mat"])[0].ids.tolist()
    ref, ref_state = fp32.decoder.start(ids)
    ref_next, _ = fp32.decoder.step(ref_state, [5])
    scale = np.abs(np.asarray(ref)).max()
    diffs = {}
    for weights in BITS:
        model = TextModel(_export(weights))
        got, state = model.decoder.start(ids)
        got_next, _ = model.decoder.step(state, [5])
        diffs[weights] = max(np.abs(np.asarray(got) - np.asarray(ref)).max(),
                             np.abs(np.asarray(got_next) - np.asarray(ref_next)).max())
    # Quantized, so not equal. Measured on this tiny random Llama (largest |logit| 2.7-3.6, 3 prompts): int8
    # 2.0-3.9% of it (symmetric blocks: 2.0-4.6%; accuracy_level 0: 1.4-2.1%, the int8 activations add the
    # rest), int4 22-46% (with a 4-bit lm_head: 23-49%), ~10x int8; this prompt 2.0% / 22%. Bounds with ~2x
    # margin; a wrong scale, zero point, transposition or nibble order is >= 100%.
    assert 0 < diffs["int8"] < 0.06 * scale, (diffs, scale)
    assert 0 < diffs["int4"] < 0.6 * scale, (diffs, scale)
    assert diffs["int8"] < diffs["int4"] / 4, diffs


def _tie_embeddings(folder) -> None:
    """The Llama folder with ``tie_word_embeddings`` (SmolLM2's layout): no lm_head weight of its own."""
    from safetensors.torch import load_file, save_file

    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    weights = load_file(folder / "model.safetensors")
    save_file({k: v for k, v in weights.items() if k != "lm_head.weight"}, folder / "model.safetensors",
              metadata={"format": "pt"})


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_a_tied_lm_head_and_the_embedding_share_one_quantized_table(weights):
    """A tied lm_head is exported as MatMul(x, Transpose(embedding)): its MatMulNBits weight, at the head's bits
    (8 in an int4 file), is also the table the embedding's GatherBlockQuantized reads. One table in the file, no
    fp32 copy, no Transpose."""
    from attnx.runtime import TextModel

    tied = gf.exports.hf_folder("llama", edit=_tie_embeddings, tag="tied-embeddings")
    fp32_path, path = gf.export(tied, "mha"), gf.export(tied, "mha", weight_only_bits=BITS[weights])
    fp32, quant = onnx.load(str(fp32_path)), onnx.load(str(path))
    inits = {t.name: t for t in fp32.graph.initializer}
    (embed,) = {n.input[0] for n in fp32.graph.node if n.op_type == "Gather" and n.input[0] in inits}  # the table
    transposes = {n.output[0] for n in fp32.graph.node if n.op_type == "Transpose" and n.input[0] == embed}
    assert len(_constant_matmul_weights(fp32)) == 8  # the head is not a constant MatMul here ...
    assert [n for n in fp32.graph.node if n.op_type == "MatMul" and n.input[1] in transposes]  # ... but this
    nbits = [n for n in quant.graph.node if n.op_type == "MatMulNBits"]
    consts = {t.name for t in quant.graph.initializer}
    assert len(nbits) == 9 and not [n for n in quant.graph.node if n.op_type in ("MatMul", "Transpose", "Gather")
                                    and set(n.input) & consts]
    (head,) = [n for n in nbits if n.output[0] == "logits"]
    vocab, hidden = inits[embed].dims
    assert (_attrs(head)["N"], _attrs(head)["K"], _attrs(head)["bits"]) == (vocab, hidden, 8)
    (gather,) = [n for n in quant.graph.node if n.op_type == "GatherBlockQuantized"]
    assert gather.input[0] == head.input[1] and _attrs(gather)["bits"] == 8  # the same initializer
    assert embed not in {t.name for t in quant.graph.initializer}
    info = ModelInfo.read(path)
    assert info.quantization["matmuls"] == 9 and info.quantization["lm_head_bits"] == 8
    assert "shared" in info.quantization["embedding"] and "tied_lm_head" in info.quantization
    # one 8-bit table (1 + 5/32 bytes a weight) instead of fp32's 4 bytes; nothing else changes size
    assert _weight_bytes(path) < _weight_bytes(fp32_path) - vocab * hidden * (4 - 1.2)
    # and it still computes the tied model: logits as near fp32 as the untied model's (bounds as above)
    ref_model, model = TextModel(fp32_path), TextModel(path)
    ids = ref_model.tokenizer.tokenize(["the cat sat on the mat"])[0].ids.tolist()
    ref, got = np.asarray(ref_model.decoder.start(ids)[0]), np.asarray(model.decoder.start(ids)[0])
    assert 0 < np.abs(got - ref).max() < {"int8": 0.06, "int4": 0.6}[weights] * np.abs(ref).max()


def test_block_size_and_lm_head_bits_are_the_users_choice():
    """``--block-size 16 --lm-head-bits 4`` (what onnxruntime-genai's and llama.cpp's 4-bit files do with the head):
    every MatMulNBits 4-bit symmetric in blocks of 16, the tied table shared at 4 bits by the embedding's
    GatherBlockQuantized, the metadata saying so; the logits as near fp32 as int4's."""
    from attnx.runtime import TextModel

    tied = gf.exports.hf_folder("llama", edit=_tie_embeddings, tag="tied-embeddings")
    fp32_path = gf.export(tied, "mha")
    path = gf.export(tied, "mha", weight_only_bits=4, weight_only_options={"block_size": 16, "lm_head_bits": 4})
    quant = onnx.load(str(path))
    nbits = [n for n in quant.graph.node if n.op_type == "MatMulNBits"]
    assert len(nbits) == 9 and {(_attrs(n)["bits"], _attrs(n)["block_size"], len(n.input)) for n in nbits} == \
        {(4, 16, 3)}  # the head too: symmetric, no zero points
    (head,) = [n for n in nbits if n.output[0] == "logits"]
    (gather,) = [n for n in quant.graph.node if n.op_type == "GatherBlockQuantized"]
    assert gather.input[0] == head.input[1] and (_attrs(gather)["bits"], _attrs(gather)["block_size"]) == (4, 16)
    q = ModelInfo.read(path).quantization
    assert (q["block_size"], q["lm_head_bits"], q["lm_head_symmetric"]) == (16, 4, True) and "lm_head" not in q["weights"]
    ref_model, model = TextModel(fp32_path), TextModel(path)
    ids = ref_model.tokenizer.tokenize(["the cat sat on the mat"])[0].ids.tolist()
    ref, got = np.asarray(ref_model.decoder.start(ids)[0]), np.asarray(model.decoder.start(ids)[0])
    assert 0 < np.abs(got - ref).max() < 0.6 * np.abs(ref).max()


def test_attnx_generate_runs_a_weight_only_folder(tmp_path):
    path = _export("int4")
    proc = attnx("generate", str(path.parent), "the cat", "-n", "6", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip()


def _hf_perplexity(folder, sentences) -> float:
    """transformers' own model on each built-in sentence in full: the fp32 reference perplexity."""
    import transformers

    from attnx.runtime.core.text import TextTokenizer

    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32).eval()
    tok = TextTokenizer.from_export(gf.export(folder, "mha"), ModelInfo.read(gf.export(folder, "mha")))
    nll, n = 0.0, 0
    for s in sentences:
        ids = [int(t) for t in tok.tokenize([s])[0].ids]
        if len(ids) < 2:
            continue
        with torch.no_grad():
            logp = torch.log_softmax(hf(input_ids=torch.tensor([ids])).logits[0].double(), -1)
        nll -= float(sum(logp[t - 1, ids[t]] for t in range(1, len(ids))))
        n += len(ids) - 1
    return float(np.exp(nll / n))


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_attnx_check_reports_perplexity_and_greedy_agreement_against_fp32(tmp_path, weights):
    from attnx.pretrained.sentences import SENTENCES

    path = _export(weights)
    proc = attnx("check", str(path), "--no-engine", cwd=tmp_path)
    assert proc.returncode in (0, 1, 3), proc.stdout + proc.stderr
    assert "perplexity" in proc.stdout and "greedy" in proc.stdout and "top-1 agreement" in proc.stdout
    (written,) = (tmp_path / "attnx-out" / "parity").glob("*.parity.json")
    report = json.loads(written.read_text())
    assert report["precision"] == f"{weights}-weights"
    (q,) = report["quality"]
    # the reference perplexity is transformers' own on the same sentences (the tiny Llama is the original)
    assert q["reference_perplexity"] == pytest.approx(_hf_perplexity(gf.folder("llama"), SENTENCES), rel=1e-4)
    assert q["ratio"] == pytest.approx(q["perplexity"] / q["reference_perplexity"]) and q["ratio"] != 1.0
    assert q["limit"] == {"int8": 1.01, "int4": 1.05}[weights]
    assert q["passed"] == (q["ratio"] <= q["limit"]) and report["passed"] == (proc.returncode == 0)
    assert 0 <= q["greedy_identical"] <= q["prompts"] == 4 and 0.5 < q["top1_agreement"] <= 1.0
    if weights == "int8":  # 8-bit blocks of 32 on these weights: within 1%, and it passes
        assert q["passed"] and proc.returncode == 0, proc.stdout


@pytest.mark.parametrize("args, says", [
    (["--weights", "int4"], "--with-past"),
    (["--with-past", "--weights", "int4", "--int8"], "--int8"),
    (["--with-past", "--weights", "int4", "--fp16"], "--fp16"),
    (["--with-past", "--weights", "int3"], "valid: int4, int8"),
    (["--with-past", "--block-size", "64"], "add --weights"),
    (["--with-past", "--weights", "int4", "--block-size", "48"], "a power of 2 >= 16"),
    (["--with-past", "--weights", "int4", "--lm-head-bits", "6"], "valid: 4, 8"),
])
def test_option_combinations_that_make_no_sense_are_one_line_before_any_work(tmp_path, args, says):
    out = tmp_path / "w" / "model.onnx"
    proc = attnx("export", "--from-pretrained", gf.folder("llama"), *args, "-o", out, cwd=tmp_path)
    assert proc.returncode != 0
    assert len(proc.errors()) == 1 and says in proc.errors()[0], proc.stderr
    assert "Traceback" not in proc.output and not out.parent.exists()


def test_a_failed_quantization_leaves_nothing_under_the_final_name(tmp_path, monkeypatch):
    import attnx.export.weight_only as w

    def broken(*args, **kwargs):
        raise RuntimeError("MatMulNBits kernel refused the weight")

    monkeypatch.setattr(w, "quantize_graph", broken)
    out = tmp_path / "int4" / "model.onnx"
    proc = attnx("export", "--from-pretrained", gf.folder("llama"), "--with-past", "--weights", "int4", "-o", out,
                 cwd=tmp_path)
    assert proc.returncode != 0
    assert len(proc.errors()) == 1 and "int4 weight-only quantization failed" in proc.errors()[0], proc.stderr
    assert "refused the weight" in proc.errors()[0] and "Traceback" not in proc.output
    assert not out.parent.exists() or not any(out.parent.iterdir())
