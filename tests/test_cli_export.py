"""`attnx export` / `attnx inspect` / `attnx variants` through the command line (in process)."""

from __future__ import annotations

import json

import onnx
import pytest
from onnx import TensorProto, helper

from attnx.models import VARIANTS

from support.cli import run as attnx


def test_export_defaults_writes_under_workdir(tmp_path):
    proc = attnx("export", "--variant", "maw", "--set", "d_model=32", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    path = tmp_path / "attnx-out" / "maw.onnx"
    assert path.is_file() and proc.stdout.strip().splitlines()[-1] == "attnx-out/maw.onnx"
    assert (tmp_path / "attnx-out" / "maw.safetensors").is_file()
    info = json.loads(attnx("inspect", str(path), "--json").stdout)
    assert info["attnx"] and info["opsets"] == {"ai.onnx": 23, "attnx": 1}
    assert [c["op"] for c in info["custom_ops"]] == ["MawDepthGather"] and info["custom_ops"][0]["function_body"]
    assert [o["name"] for o in info["outputs"]] == ["output", "maw_depth"]
    assert info["metadata"]["attnx.variant"] == "maw"
    assert info["parameters"] > 10_000


def test_export_fuses_by_default_and_no_fuse_keeps_the_traced_graph(tmp_path):
    ops = {}
    for name, extra in (("fused", []), ("plain", ["--no-fuse"])):
        out = tmp_path / f"{name}.onnx"
        proc = attnx("export", "--variant", "mha", "--set", "d_model=32", "-o", str(out), *extra)
        assert proc.returncode == 0, proc.stderr
        ops[name] = [n.op_type for n in onnx.load(str(out)).graph.node]
    assert ops["fused"].count("Split") == 2 and ops["fused"].count("Transpose") == 0  # packed q|k|v, 3-D attention
    assert ops["plain"].count("Split") == 0 and ops["plain"].count("Transpose") > 0


def test_export_flags(tmp_path):
    out = tmp_path / "s.onnx"
    proc = attnx("export", "--variant", "smal", "-o", str(out), "--lowering", "rewrite", "--fp16", "--layers", "3",
                 "--set", "d_model=48", "--set", "n_heads=6", "--set", "per_head_trace=true", "--seq", "1,64,256")
    assert proc.returncode == 0, proc.stderr
    model = onnx.load(str(out))
    meta = {p.key: p.value for p in model.metadata_props}
    assert meta["attnx.lowering"] == "rewrite" and meta["attnx.precision"] == "fp16"
    cfg = json.loads(meta["attnx.config"])
    assert cfg["encoder"]["n_layers"] == 3 and cfg["attention"]["smal"]["per_head_trace"] is True
    assert json.loads(meta["attnx.profiles"])["seq"] == [1, 64, 256]
    trace = next(i for i in model.graph.input if i.name == "trace")
    assert [d.dim_param or d.dim_value for d in trace.type.tensor_type.shape.dim] == ["batch", 6, 8, 8]


@pytest.mark.parametrize("args,message", [
    (["--variant", "nope"], "unknown variant 'nope'; valid variants: mha, cultural, metaphor, maw, smal"),
    (["--variant", "maw", "--set", "depth=3"], "--set depth: unknown option for variant 'maw'; valid:"),
    (["--variant", "maw", "--set", "depth_dim=three"], "--set depth_dim=three: expected int"),
    (["--variant", "maw", "--set", "d_model"], "expected key=value"),
    (["--variant", "mha", "--set", "d_model=30", "--set", "n_heads=4"], "d_model (30) must be divisible by n_heads (4)"),
    (["--variant", "cultural", "--set", "bias_mode=sideways"], "bias_mode must be one of 'key', 'query'"),
    (["--variant", "mha", "--lowering", "fast"], "--lowering 'fast': valid: plugin, rewrite"),
    (["--variant", "mha", "--checkpoint", "/nonexistent/w.safetensors"], "checkpoint not found"),
    (["--variant", "mha", "--seq", "1,2"], "expected min,opt,max"),
    (["--variant", "mha", "--seq", "8,4,16"], "need 1 <= min <= opt <= max"),
])
def test_export_errors_are_one_line(tmp_path, args, message):
    proc = attnx("export", *args, cwd=tmp_path)
    assert proc.returncode != 0
    assert message in proc.stderr.replace("\n", " ")
    assert "Traceback" not in proc.stderr
    assert not list(tmp_path.glob("attnx-out/*.onnx"))


def test_checkpoint_that_does_not_fit(tmp_path):
    import torch
    from safetensors.torch import save_file

    save_file({"blocks.0.attn.W_Q.weight": torch.zeros(2, 2)}, str(tmp_path / "w.safetensors"))
    proc = attnx("export", "--variant", "mha", "--checkpoint", str(tmp_path / "w.safetensors"), cwd=tmp_path)
    assert proc.returncode == 1 and "does not fit this mha model" in proc.stderr and "Traceback" not in proc.stderr
    verbose = attnx("--verbose", "export", "--variant", "mha", "--checkpoint", str(tmp_path / "w.safetensors"), cwd=tmp_path)
    assert "Traceback" in verbose.stderr


def test_inspect_any_onnx_file(tmp_path):
    node = helper.make_node("Relu", ["x"], ["y"])
    custom = helper.make_node("Foo", ["y"], ["z"], domain="acme")
    graph = helper.make_graph([node, custom], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3])],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["n", 3])],
                              [helper.make_tensor("w", TensorProto.FLOAT, [4, 5], [0.0] * 20)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("acme", 1)])
    onnx.save(model, tmp_path / "other.onnx")
    info = json.loads(attnx("inspect", str(tmp_path / "other.onnx"), "--json").stdout)
    assert info["inputs"] == [{"name": "x", "dtype": "float", "shape": ["n", 3]}]
    assert info["custom_ops"] == [{"domain": "acme", "op": "Foo", "count": 1, "function_body": False, "schema": False}]
    assert info["parameters"] == 20 and not info["attnx"]
    table = attnx("inspect", str(tmp_path / "other.onnx"))
    assert table.returncode == 0 and "acme::Foo" in table.stdout
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a model")
    proc = attnx("inspect", str(bad))
    assert proc.returncode != 0 and "not a readable ONNX file" in proc.stderr and "Traceback" not in proc.stderr


def test_variants_lists_options_and_context():
    proc = attnx("variants", "--json")
    info = {v["name"]: v for v in json.loads(proc.stdout)}
    assert list(info) == list(VARIANTS)
    assert info["maw"]["options"]["depth_dim"] == 5 and info["maw"]["outputs"] == ["output", "maw_depth"]
    assert info["smal"]["context"][1] == {"name": "trace", "shape": ["batch", 64, 64], "dtype": "float",
                                           "doc": "trace tensor T (zeros: no distance term)"}
    assert info["cultural"]["options"]["bias_mode"] == "key"
    assert "depth_dim" in attnx("variants").stdout


# ----------------------------------------------------------------------------- issue 15: bad files, no destruction


def _one_line(proc, *phrases):
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for phrase in phrases:
        assert phrase in lines[0], lines[0]


@pytest.mark.parametrize("content,message", [
    (b"", "is empty: not an ONNX file"),
    (b"\x08\x07", "holds no graph"),  # parses (an IR version alone) but is no model
    (b"plain text, not protobuf\n", "is not a readable ONNX file"),
])
def test_inspect_refuses_files_that_are_not_models(tmp_path, content, message):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(content)
    _one_line(attnx("inspect", str(bad)), message)
    _one_line(attnx("inspect", str(tmp_path)), "no such file")
    verbose = attnx("--verbose", "inspect", str(bad))
    assert verbose.returncode != 0 and "Traceback" in verbose.stderr


@pytest.fixture(scope="module")
def tiny_bert_folder(tmp_path_factory):
    """A small BERT saved by transformers itself (model.safetensors + config.json), with tokenizer files."""
    import torch
    import transformers

    import shutil

    from attnx.pretrained import minilm_path

    folder = tmp_path_factory.mktemp("tiny") / "bert"
    cfg = transformers.BertConfig(vocab_size=100, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=32)
    torch.manual_seed(0)
    transformers.BertModel(cfg).save_pretrained(folder, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt"):  # a text model: its tokenizer travels
        shutil.copy2(minilm_path() / name, folder / name)
    return folder


def _snapshot(folder):
    return {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_export_never_overwrites_the_pretrained_folder_it_reads(tiny_bert_folder, tmp_path):
    import shutil

    folder = tmp_path / "x.tokenizer"  # a model folder whose name the export's tokenizer folder would take
    shutil.copytree(tiny_bert_folder, folder)
    before = _snapshot(folder)
    # model.safetensors is the model's own weights: the export would write its weights there.
    _one_line(attnx("export", "--from-pretrained", str(folder), "-o", str(folder / "model.onnx")),
              "would overwrite", "model.safetensors", "model folder it exports from")
    # x.onnx's tokenizer folder is x.tokenizer/, the model folder itself, which the export replaces.
    _one_line(attnx("export", "--from-pretrained", str(folder), "-o", str(tmp_path / "x.onnx")),
              "would overwrite", "x.tokenizer")
    assert _snapshot(folder) == before and not (tmp_path / "x.onnx").exists()


def test_export_never_overwrites_its_checkpoint(tiny_bert_folder, tmp_path):
    """A placed variant's trained parameters: c.onnx would put the whole model's weights in c.safetensors."""
    from safetensors.torch import save_file

    from attnx import pretrained

    host = pretrained.load(tiny_bert_folder, "smal")
    state = host.state_dict()
    weights = tmp_path / "c.safetensors"
    save_file({k: state[k].contiguous() for k in host.variant_parameter_names()}, str(weights))
    before = weights.read_bytes()
    _one_line(attnx("export", "--from-pretrained", str(tiny_bert_folder), "--variant", "smal", "--checkpoint",
                    str(weights), "-o", str(tmp_path / "c.onnx")), "would overwrite the checkpoint", "c.safetensors")
    assert weights.read_bytes() == before and not (tmp_path / "c.onnx").exists()
    _one_line(attnx("export", "--variant", "mha", "-o", str(tmp_path / "x.safetensors")), "must be a .onnx file")


def test_export_from_a_folder_with_corrupt_weights_is_one_line(tiny_bert_folder, tmp_path):
    import shutil

    folder = tmp_path / "broken"
    shutil.copytree(tiny_bert_folder, folder)
    (folder / "model.safetensors").write_bytes(b"\x00\x01 not safetensors")
    _one_line(attnx("export", "--from-pretrained", str(folder), "-o", str(tmp_path / "b.onnx")),
              "model.safetensors: not a safetensors file")
    assert not list(tmp_path.glob("b.*"))
