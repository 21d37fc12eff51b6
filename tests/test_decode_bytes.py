"""``benchmarks/_decode_bytes.py``: the bytes of weights a decode step reads, counted from a contender's files
(issue 48, item 3), and the stream-copy probe's figure. Small hand-made files with known sizes."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import _decode_bytes as decode_bytes  # noqa: E402

VOCAB, HIDDEN = 64, 32


def _save(tmp_path: Path, nodes, inits, name: str = "model.onnx") -> Path:
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 1])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                    helper.make_opsetid("com.microsoft", 1)])
    path = tmp_path / name
    onnx.save(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=f"{name}.data",
              size_threshold=0)
    return path


def _table(name: str = "embed") -> onnx.TensorProto:
    return numpy_helper.from_array(np.ones((VOCAB, HIDDEN), np.float32), name)


def test_an_untied_table_only_gathered_is_not_read_a_projection_is(tmp_path):
    head = numpy_helper.from_array(np.ones((HIDDEN, VOCAB), np.float32), "head")
    path = _save(tmp_path, [helper.make_node("Gather", ["embed", "ids"], ["x"]),
                            helper.make_node("MatMul", ["x", "head"], ["logits"])], [_table(), head])
    got = decode_bytes.onnx_bytes(path)
    assert got["weights"] == 2 * VOCAB * HIDDEN * 4
    assert got["read"] == VOCAB * HIDDEN * 4  # the head only
    assert got["file"] >= got["weights"]  # the .onnx and its .data together


def test_a_tied_table_read_by_the_head_counts_in_full(tmp_path):
    path = _save(tmp_path, [helper.make_node("Gather", ["embed", "ids"], ["x"]),
                            helper.make_node("Transpose", ["embed"], ["embed_t"], perm=[1, 0]),
                            helper.make_node("MatMul", ["x", "embed_t"], ["logits"])], [_table()])
    assert decode_bytes.onnx_bytes(path)["read"] == VOCAB * HIDDEN * 4


def test_a_block_quantized_table_and_its_reshaped_scales_only_gathered_are_not_read(tmp_path):
    blocks = HIDDEN // 32
    q = numpy_helper.from_array(np.zeros((VOCAB, blocks, 16), np.uint8), "embed_q")
    scales = numpy_helper.from_array(np.ones((VOCAB, blocks), np.float32), "embed_scales")
    shape = numpy_helper.from_array(np.array([VOCAB, blocks, 1], np.int64), "shape3")
    head = numpy_helper.from_array(np.ones((HIDDEN, VOCAB), np.float32), "head")
    path = _save(tmp_path, [helper.make_node("Reshape", ["embed_scales", "shape3"], ["s3"]),
                            helper.make_node("GatherBlockQuantized", ["embed_q", "ids", "s3"], ["x3"],
                                             domain="com.microsoft", bits=4, block_size=32, gather_axis=0,
                                             quantize_axis=2),
                            helper.make_node("MatMul", ["x3", "head"], ["logits"])], [q, scales, shape, head])
    # read: the head and the Reshape's shape constant; not the table's 4-bit blocks or their scales
    assert decode_bytes.onnx_bytes(path)["read"] == HIDDEN * VOCAB * 4 + 3 * 8


def test_gguf_bytes_leave_out_the_table_only_when_an_output_matrix_is_there(tmp_path):
    import gguf

    def write(name: str, untied: bool) -> Path:
        path = tmp_path / name
        w = gguf.GGUFWriter(str(path), "llama")
        w.add_tensor("token_embd.weight", np.ones((VOCAB, HIDDEN), np.float32))
        w.add_tensor("blk.0.attn_q.weight", np.ones((HIDDEN, HIDDEN), np.float32))
        if untied:
            w.add_tensor("output.weight", np.ones((VOCAB, HIDDEN), np.float32))
        w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
        return path

    tied = decode_bytes.gguf_bytes(write("tied.gguf", False))
    untied = decode_bytes.gguf_bytes(write("untied.gguf", True))
    assert tied["read"] == (VOCAB * HIDDEN + HIDDEN * HIDDEN) * 4
    assert untied["read"] == tied["read"]  # the output matrix in, the table out
    assert untied["weights"] == tied["weights"] + VOCAB * HIDDEN * 4


def test_the_copy_probe_counts_read_and_written_bytes():
    got = decode_bytes.copy_bandwidth(threads=2, mb=16, rounds=3)
    assert len(got["rounds"]) == 3 and got["gb_s"] == sorted(got["rounds"])[1]
    assert 0.1 < got["gb_s"] < 10_000
