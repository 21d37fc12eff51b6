"""What a served file promises is checked when it loads (issue 26, items 3 and 9): an engine against its
sidecar (size and sha256, the check `attnx check` and `attnx triton-repo` make), and an export's metadata
against the model (tokenizer max length within the position table, pad id and id ranges within the
vocabulary). Each is refused with one line before anything is served."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import onnx
import pytest

from attnx.contract import ContractError, ModelInfo, sidecar_path
from attnx.runtime import TextModel, load
from attnx.runtime.server import InferenceServer
from support import exports
from support.cli import one_line_error
from support.cli import run as attnx


def serve_cli(*args, cwd: Path):
    """`attnx serve ... --port 0` in process: each case here is refused while loading, before serving."""
    return attnx("serve", *args, "--port", "0", cwd=cwd)


# ----------------------------------------------------------------------------- engines (item 3)


@pytest.fixture(scope="module")
def engines(exported, rtx, tmp_path_factory):
    """Two small engines built here with TensorRT-RTX (they cannot run without a GPU, but verify)."""
    from attnx import engine as eng

    folder = tmp_path_factory.mktemp("engines")
    a = eng.build(exported("mha", n_layers=1).path, folder / "a.engine", target="sm89").engine_path
    b = eng.build(exported("cultural", n_layers=1).path, folder / "b.engine", target="sm89").engine_path
    return a, b


@pytest.mark.rtx
@pytest.mark.parametrize("damage", ["truncated", "swapped", "truncated-no-sidecar"])
def test_a_damaged_engine_is_refused_at_load_in_one_line(engines, tmp_path, damage):
    a, b = engines
    bad = tmp_path / "model.engine"
    if damage == "swapped":  # another model's plan under this one's sidecar
        shutil.copy(b, bad)
        shutil.copy(sidecar_path(a), sidecar_path(bad))
    else:
        bad.write_bytes(a.read_bytes()[: a.stat().st_size // 2])
        if damage == "truncated":
            shutil.copy(sidecar_path(a), sidecar_path(bad))
    words = ("declares", "rebuild") if damage == "truncated-no-sidecar" else ("sha256 does not match", "rebuild")
    with pytest.raises(ContractError, match=words[0]):
        InferenceServer({"m": bad})
    with pytest.raises(ContractError, match=words[0]):
        TextModel(bad)
    one_line_error(serve_cli(bad, cwd=tmp_path), "model.engine", *words)


@pytest.mark.rtx
def test_an_engine_built_from_another_onnx_is_refused_when_the_onnx_is_named(engines, exported):
    a, _ = engines
    with pytest.raises(ContractError, match="was built from"):
        load(a, onnx_path=exported("cultural", n_layers=1).path)


# ----------------------------------------------------------------------------- metadata (item 9)


@pytest.fixture(scope="module")
def minilm(tmp_path_factory):
    return exports.minilm().path


def tampered(src: Path, folder: Path, change) -> Path:
    """A copy of an export (its tokenizer folder beside it) with ``change(info)`` applied to its metadata."""
    folder.mkdir(parents=True, exist_ok=True)
    tok = src.with_suffix(".tokenizer")
    shutil.copytree(tok, folder / tok.name, dirs_exist_ok=True)
    model = onnx.load(str(src))
    info = ModelInfo.read(model)
    change(info)
    info.write(model)
    out = folder / src.name
    onnx.save(model, str(out))
    return out


def _tokenizer(**values):
    def change(info):
        info.tokenizer = {**info.tokenizer.to_json(), **values}  # written unchecked: the load must refuse it
    return change


def _ids_range(low, high):
    def change(info):
        info.inputs = [dataclasses.replace(e, range=(low, high)) if e.name == "input_ids" else e for e in info.inputs]
    return change


TAMPERED = {
    "max-length-past-positions": (_tokenizer(max_length=10 ** 6), "max length 1000000 is beyond the model's 512"),
    "pad-id-past-vocab": (_tokenizer(pad_id=10 ** 9), "pad id 1000000000 is outside the model's token ids"),
    "pad-id-negative": (_tokenizer(pad_id=-1), "pad id -1 is outside"),
    "pad-id-not-int": (_tokenizer(pad_id="0"), "pad_id '0' is not an integer"),
    "ids-range-past-table": (_ids_range(0, 10 ** 9), "the table it indexes has 30522 rows"),
}


@pytest.mark.parametrize("case", sorted(TAMPERED))
def test_tampered_metadata_is_refused_at_load_in_one_line(minilm, tmp_path, case):
    change, message = TAMPERED[case]
    bad = tampered(minilm, tmp_path / "export", change)
    with pytest.raises(ContractError, match=message.split(" ")[0]) as info:
        InferenceServer({"m": bad})
    assert message in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(ContractError, match=message.split(" ")[0]):
        TextModel(bad)
    one_line_error(serve_cli(bad, cwd=tmp_path), message)


def test_a_foreign_tokenizer_without_a_limit_is_cut_at_the_models_positions(minilm, tmp_path):
    """A tokenizer folder that states no max length feeding a model whose metadata states its positions:
    long texts are cut there (else every such text would fail inside ONNX Runtime)."""
    import json

    folder = tmp_path / "tok"
    shutil.copytree(minilm.with_suffix(".tokenizer"), folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["model_max_length"] = 10 ** 30  # transformers' "no limit"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    raw = json.loads((folder / "tokenizer.json").read_text())
    raw["truncation"] = None
    (folder / "tokenizer.json").write_text(json.dumps(raw))
    model = TextModel(minilm, tokenizer=folder)
    assert model.max_seq_length == 512
    assert model.tokenize(["word " * 2000])[0].shape == (512,)


def test_the_graph_outline_reads_what_onnx_load_reads(minilm, tmp_path):
    """The id-range check reads the graph from the protobuf wire format without the weights (a with-past
    export's 650 MB are never loaded twice): every initializer's first dim and every Gather's inputs and axis,
    as ``onnx.load`` gives them, on the real MiniLM export and on a graph with a negative axis, a node and weights
    longer than one read."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    from attnx.runtime.core.onnx_outline import graph_outline

    def with_onnx(path):
        model = onnx.load(path)
        tables = {i.name: int(i.dims[0]) for i in model.graph.initializer if len(i.dims) >= 1}
        gathers = [(n.input[0], n.input[1], next((a.i for a in n.attribute if a.name == "axis"), 0))
                   for n in model.graph.node if n.op_type == "Gather" and len(n.input) == 2]
        return tables, gathers

    table = numpy_helper.from_array(np.zeros((70000, 3), np.float32), "table")  # raw_data past one read
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "ids"], ["a"], axis=-1, name="g" * 70000),
         helper.make_node("Gather", ["table", "ids"], ["b"]), helper.make_node("Identity", ["a"], ["c"])],
        "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["n"])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in "bc"],
        [table, numpy_helper.from_array(np.float32(2.0), "scalar")])
    small = tmp_path / "g.onnx"
    onnx.save(helper.make_model(graph), small)
    for path in (small, minilm):
        tables, gathers = graph_outline(path)
        assert (tables, gathers) == with_onnx(path)
    assert graph_outline(small)[1][0] == ("table", "ids", -1) and graph_outline(small)[0]["table"] == 70000
