"""`attnx triton-repo` on a text model: a Triton ensemble (Python-backend tokenizer -> ONNX model).

No Triton server runs here. The configs are parsed with Triton's own schema, and the tokenizer
model's shipped ``model.py`` runs in-process against a minimal stand-in for Triton's
``triton_python_backend_utils`` written below (only the calls the model makes: Tensor,
InferenceResponse, TritonError, get_input_tensor_by_name, triton_string_to_numpy). The ensemble's
steps are then followed as its config.pbtxt maps them, with ONNX Runtime running the repository's
model file, and compared with sentence-transformers itself and with attnx's own ``TextModel``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import sys
import types

import numpy as np
import onnxruntime as ort
import pytest
from google.protobuf import json_format, text_format

from attnx.contract import ModelInfo, sha256_file
from attnx.deploy.kserve import KServeOptions, check_manifest
from attnx.deploy.repository import write_repository
from attnx.deploy.triton import ConfigError, triton_schema, validate_ensemble
from attnx.pretrained import minilm_path
from support.cli import run as run_cli

MINILM = minilm_path()
SHORT = ["A man is eating food.", "A man is riding a horse.", "Das ist ein Satz, und noch einer."]
# 129-256 tokens: sentence-transformers keeps them whole, the tokenizer.json's own setting cuts at 128.
MEDIUM = " ".join(f"word{i} and the sky is blue" for i in range(30))
LONG = " ".join(f"token{i} with more text here" for i in range(80))  # past 256: truncated there


# ----------------------------------------------------------------------------- the stand-in


def _standin_pb_utils():
    """A minimal stand-in for Triton's ``triton_python_backend_utils`` (the real one lives in Triton's stub)."""
    pb = types.ModuleType("triton_python_backend_utils")

    class Tensor:
        def __init__(self, name, array):
            self._name, self._array = name, np.asarray(array)

        def name(self):
            return self._name

        def as_numpy(self):
            return self._array

        @classmethod
        def from_dlpack(cls, name, tensor):
            return cls(name, np.array(tensor.as_numpy()))

    class TritonError:
        UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG = 0, 1, 2, 3

        def __init__(self, message, code=0):
            self._message, self._code = message, code

        def message(self):
            return self._message

        def code(self):
            return self._code

    class InferenceResponse:
        def __init__(self, output_tensors, error=None):
            self._outputs, self._error = list(output_tensors), error

        def output_tensors(self):
            return self._outputs

        def has_error(self):
            return self._error is not None

        def error(self):
            return self._error

    class InferenceRequest:
        def __init__(self, inputs):
            self._inputs = list(inputs)

        def inputs(self):
            return self._inputs

    triton_to_numpy = {"TYPE_BOOL": np.bool_, "TYPE_INT32": np.int32, "TYPE_INT64": np.int64,
                       "TYPE_FP16": np.float16, "TYPE_FP32": np.float32, "TYPE_STRING": np.object_}
    pb.Tensor, pb.TritonError, pb.InferenceResponse, pb.InferenceRequest = Tensor, TritonError, InferenceResponse, InferenceRequest
    pb.get_input_tensor_by_name = lambda request, name: next((t for t in request.inputs() if t.name() == name), None)
    pb.triton_string_to_numpy = lambda s: triton_to_numpy[s]
    return pb


@pytest.fixture()
def pb_utils(monkeypatch):
    stand_in = _standin_pb_utils()
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", stand_in)
    return stand_in


def parse_config(folder):
    message = triton_schema().ModelConfig()
    text_format.Parse((folder / "config.pbtxt").read_text(), message)
    return message


def load_tokenizer_model(folder, pb_utils):
    """The repository's own ``1/model.py``, initialised the way Triton does (config as JSON, proto names)."""
    spec = importlib.util.spec_from_file_location(f"tok_{hashlib.md5(str(folder).encode()).hexdigest()}",
                                                  folder / "1" / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.pb_utils is pb_utils
    model = module.TritonPythonModel()
    config = json_format.MessageToJson(parse_config(folder), preserving_proto_field_name=True)
    model.initialize({"model_config": config, "model_repository": str(folder), "model_version": "1",
                      "model_name": folder.name, "model_instance_kind": "CPU", "model_instance_device_id": "0"})
    return model


def text_request(pb_utils, texts, name="text"):
    return pb_utils.InferenceRequest([pb_utils.Tensor(name, np.array([[t] for t in texts], dtype=object))])


def run_ensemble(repo, ensemble_name, feeds, pb_utils):
    """Follow the ensemble's steps as its config maps them: the tokenizer's model.py, then ONNX Runtime."""
    ensemble = parse_config(repo / ensemble_name)
    tensors = dict(feeds)
    for step in ensemble.ensemble_scheduling.step:
        folder = repo / step.model_name
        # An optional ensemble input the request left out: Triton runs the step without it.
        step_inputs = {key: tensors[value] for key, value in step.input_map.items() if value in tensors}
        config = parse_config(folder)
        if config.backend == "python":
            request = pb_utils.InferenceRequest([pb_utils.Tensor(k, v) for k, v in step_inputs.items()])
            (response,) = load_tokenizer_model(folder, pb_utils).execute([request])
            assert not response.has_error(), response.error().message()
            produced = {t.name(): t.as_numpy() for t in response.output_tensors()}
        else:
            session = ort.InferenceSession(str(folder / "1" / config.default_model_filename),
                                           providers=["CPUExecutionProvider"])
            produced = dict(zip([o.name for o in session.get_outputs()], session.run(None, step_inputs)))
        for key, value in step.output_map.items():
            tensors[value] = produced[key]
    return {t.name: tensors[t.name] for t in ensemble.output}


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def minilm_onnx(minilm_export):
    """The real all-MiniLM-L6-v2 export (mha), shared with the other modules (tests/conftest.py)."""
    return minilm_export("mha").path


@pytest.fixture(scope="module")
def text_repo(minilm_onnx, tmp_path_factory):
    return write_repository(minilm_onnx, tmp_path_factory.mktemp("r") / "repo", name="minilm",
                            max_queue_delay_us=500)


@pytest.fixture(scope="module")
def sbert(st_minilm):
    return st_minilm


# ----------------------------------------------------------------------------- the repository


def test_text_repository_is_an_ensemble_whose_configs_parse_with_tritons_schema(text_repo, minilm_onnx):
    repo, schema = text_repo.root, triton_schema()
    assert text_repo.entry == "minilm" and set(text_repo.models) == {"minilm", "minilm_tokenizer", "minilm_model"}
    configs = {n: parse_config(repo / n) for n in text_repo.models}
    ensemble, tokenizer, model = configs["minilm"], configs["minilm_tokenizer"], configs["minilm_model"]
    assert ensemble.platform == "ensemble" and not ensemble.instance_group and ensemble.max_batch_size == 32
    assert [(t.name, t.data_type, list(t.dims)) for t in ensemble.input] == [("text", schema.TYPE_STRING, [1])]
    assert [t.name for t in ensemble.output] == ["last_hidden_state", "sentence_embedding", "attention_mask"]
    assert [s.model_name for s in ensemble.ensemble_scheduling.step] == ["minilm_tokenizer", "minilm_model"]
    validate_ensemble(ensemble, configs)
    # The tokenizer: Python backend, dynamic batching, the export's tokenisation settings.
    params = {k: v.string_value for k, v in tokenizer.parameters.items()}
    assert tokenizer.backend == "python" and tokenizer.HasField("dynamic_batching")
    assert tokenizer.instance_group[0].kind == schema.ModelInstanceGroup.KIND_CPU
    assert params["max_length"] == "256" and params["truncation_side"] == "right" and params["pad_id"] == "0"
    assert json.loads(params["outputs"]) == {"input_ids": "input_ids", "attention_mask": "attention_mask",
                                             "token_type_ids": "token_type_ids"}
    assert [(t.name, list(t.dims)) for t in tokenizer.output] == [(t.name, list(t.dims)) for t in model.input]
    # The model: ONNX Runtime with dynamic batching, the export's bytes.
    assert model.platform == "onnxruntime_onnx" and model.dynamic_batching.max_queue_delay_microseconds == 500
    assert (repo / "minilm_model" / "1" / "model.onnx").read_bytes() == minilm_onnx.read_bytes()
    shipped = repo / "minilm_tokenizer" / "1"
    from attnx.deploy import tokenizer_model

    assert (shipped / "model.py").read_text() == open(tokenizer_model.__file__).read()
    # the export's tokenizer.json travels as exported: the source's fixed 128 padding off, truncation at 256
    exported = minilm_onnx.parent / ModelInfo.read(minilm_onnx).tokenizer.dir / "tokenizer.json"
    assert sha256_file(shipped / "tokenizer" / "tokenizer.json") == sha256_file(exported)
    shipped_json = json.loads((shipped / "tokenizer" / "tokenizer.json").read_text())
    assert shipped_json["padding"] is None and shipped_json["truncation"]["max_length"] == 256
    assert (repo / "minilm" / "1").is_dir()
    assert "tokenizers" in (repo / "Dockerfile").read_text() and "`minilm`" in (repo / "README.md").read_text()


def test_tokenizer_execute_gives_attnx_tokens_and_the_ensemble_sentence_transformers_embeddings(
        text_repo, minilm_onnx, sbert, pb_utils):
    from attnx.runtime.core.encode import TextModel

    texts = [*SHORT, MEDIUM, LONG]
    model = load_tokenizer_model(text_repo.root / "minilm_tokenizer", pb_utils)
    (response,) = model.execute([text_request(pb_utils, texts)])
    out = {t.name(): t.as_numpy() for t in response.output_tensors()}
    assert set(out) == {"input_ids", "attention_mask", "token_type_ids"} and out["input_ids"].dtype == np.int64
    lengths = out["attention_mask"].sum(axis=1)
    assert out["input_ids"].shape == (5, 256) and lengths.max() == 256  # LONG is cut at the export's 256
    attnx_ids = TextModel(minilm_onnx).tokenize(texts)
    want = sbert.tokenizer(texts, truncation=True, max_length=256)["input_ids"]
    for row, (ours, theirs, st) in enumerate(zip(out["input_ids"], attnx_ids, want)):
        assert lengths[row] == len(theirs) == len(st)
        assert ours[:lengths[row]].tolist() == theirs.tolist() == st
        assert (ours[lengths[row]:] == 0).all()  # the pad id
    assert 128 < lengths[3] < 256  # MEDIUM: the tokenizer.json's own 128 cut is not applied

    got = run_ensemble(text_repo.root, "minilm", {"text": np.array([[t] for t in texts], dtype=object)}, pb_utils)
    reference = sbert.encode(texts, convert_to_numpy=True)
    assert np.abs(got["sentence_embedding"] - reference).max() < 2e-5
    served = TextModel(minilm_onnx).encode(texts, normalize_embeddings=True)
    assert np.abs(got["sentence_embedding"] - served).max() < 2e-5
    assert (got["attention_mask"] == out["attention_mask"]).all() and got["last_hidden_state"].shape[:2] == (5, 256)


def test_a_batch_of_requests_is_answered_per_request_and_bad_ones_alone(text_repo, pb_utils):
    """What Triton's dynamic batcher hands the model: several requests at once; each padded to its own
    bucket, each bad one answered with its own INVALID_ARG error, the others unaffected."""
    model = load_tokenizer_model(text_repo.root / "minilm_tokenizer", pb_utils)
    good = [text_request(pb_utils, SHORT[:2]), text_request(pb_utils, [MEDIUM])]
    bad_utf8 = pb_utils.InferenceRequest([pb_utils.Tensor("text", np.array([[b"ok"], [b"\xff\xfe bad"]], dtype=object))])
    empty = text_request(pb_utils, ["fine", ""])
    missing = pb_utils.InferenceRequest([pb_utils.Tensor("sentence", np.array([[b"x"]], dtype=object))])
    responses = model.execute([good[0], bad_utf8, good[1], empty, missing])
    assert len(responses) == 5
    errors = {i: r.error() for i, r in enumerate(responses) if r.has_error()}
    assert set(errors) == {1, 3, 4}
    assert errors[1].message() == "text 1 is not valid UTF-8 (byte 0)" and errors[1].code() == pb_utils.TritonError.INVALID_ARG
    assert errors[3].message() == "text 1 is empty" and errors[4].message() == "missing input 'text'"
    for index, request in ((0, good[0]), (2, good[1])):
        alone = {t.name(): t.as_numpy() for t in model.execute([request])[0].output_tensors()}
        batched = {t.name(): t.as_numpy() for t in responses[index].output_tensors()}
        assert all((alone[k] == batched[k]).all() for k in alone)
        assert batched["input_ids"].shape[1] % 16 == 0  # padded to the 16-token bucket


def test_ensemble_validator_rejects_what_triton_would(text_repo):
    configs = {n: parse_config(text_repo.root / n) for n in text_repo.models}
    ensemble = configs["minilm"]
    broken = type(ensemble)()
    broken.CopyFrom(ensemble)
    broken.ensemble_scheduling.step[1].input_map["input_idz"] = "input_ids"
    with pytest.raises(ConfigError, match="minilm_model has no input 'input_idz'"):
        validate_ensemble(broken, configs)
    broken.CopyFrom(ensemble)
    del broken.ensemble_scheduling.step[1].input_map["token_type_ids"]
    with pytest.raises(ConfigError, match=r"inputs \['token_type_ids'\] are not mapped"):
        validate_ensemble(broken, configs)
    broken.CopyFrom(ensemble)
    broken.max_batch_size = 64
    with pytest.raises(ConfigError, match="max_batch_size 64 exceeds"):
        validate_ensemble(broken, configs)
    broken.CopyFrom(ensemble)
    broken.output[1].data_type = triton_schema().TYPE_FP16
    with pytest.raises(ConfigError, match="another data type"):
        validate_ensemble(broken, configs)
    broken.CopyFrom(ensemble)
    broken.input[0].optional = True  # Triton would run the tokenizer without the text it requires
    with pytest.raises(ConfigError, match=r"minilm_tokenizer needs \['text'\], which the ensemble lets a request leave out"):
        validate_ensemble(broken, configs)


def test_context_inputs_pass_through_the_ensemble(tmp_path, pb_utils):
    """A variant with context inputs (placed in a small BERT that has MiniLM's tokenizer): the ensemble
    takes them beside the text and hands them to the model; the output is the original BERT's."""
    import torch
    import transformers

    from attnx.export.pretrained import export_pretrained

    folder = tmp_path / "bert"
    cfg = transformers.BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=64)
    torch.manual_seed(0)
    hf = transformers.BertModel(cfg).eval()
    hf.save_pretrained(folder, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy2(MINILM / name, folder / name)
    export = export_pretrained(folder, tmp_path / "tiny.onnx", variant="smal")
    context = [e for e in export.info.inputs if e.role == "context"]
    assert context, "the variant declares context inputs"
    repo = write_repository(export.path, tmp_path / "repo", name="tiny").root
    ensemble = parse_config(repo / "tiny")
    assert [t.name for t in ensemble.input] == ["text", *(e.name for e in context)]
    rng = np.random.default_rng(0)
    feeds = {"text": np.array([[t] for t in SHORT], dtype=object)}
    for entry in context:
        feeds[entry.name] = rng.standard_normal((len(SHORT), *entry.shape[1:])).astype(np.float32)
    got = run_ensemble(repo, "tiny", feeds, pb_utils)
    # smal's context inputs default to zeros: optional in the ensemble, through the tokenizer step, which
    # passes them on; left out, it fills zeros and the model step still gets every input it requires.
    assert all(t.optional for t in ensemble.input[1:])
    tokenizer = parse_config(repo / "tiny_tokenizer")
    assert [(t.name, t.optional) for t in tokenizer.input] == [("text", False), *((e.name, True) for e in context)]
    assert [t.name for t in tokenizer.output][-len(context):] == [e.name for e in context]
    assert not any(t.optional for t in parse_config(repo / "tiny_model").input)  # ONNX Runtime fills nothing
    without = run_ensemble(repo, "tiny", {"text": feeds["text"]}, pb_utils)
    assert np.abs(without["last_hidden_state"] - got["last_hidden_state"]).max() < 1e-5  # smal is neutral
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    batch = tok(SHORT, padding="max_length", max_length=got["attention_mask"].shape[1], truncation=True,
                return_tensors="pt")
    with torch.no_grad():
        want = hf(**batch).last_hidden_state.numpy()
    real = got["attention_mask"].astype(bool)
    assert (batch["attention_mask"].numpy() == got["attention_mask"]).all()
    assert np.abs(got["last_hidden_state"] - want)[real].max() < 1e-4


# ----------------------------------------------------------------------------- engines


def _fake_engine(tmp_path, onnx_path, seq_max):
    """An engine file with an attnx sidecar (no TensorRT needed to write a repository for it)."""
    engine = tmp_path / "minilm.engine"
    engine.write_bytes(b"ftrt" + bytes(64))
    shutil.copy2(onnx_path, tmp_path / "minilm.onnx")
    folder = ModelInfo.read(onnx_path).tokenizer.dir  # the ONNX names its tokenizer folder
    shutil.copytree(onnx_path.parent / folder, tmp_path / folder)
    ids = {"dtype": "int64", "shape": ["batch", "seq"]}
    (tmp_path / "minilm.engine.json").write_text(json.dumps({
        "engine_sha256": sha256_file(engine), "engine_bytes": engine.stat().st_size, "onnx_name": "minilm.onnx",
        "profiles": {"batch": [1, 8, 16], "seq": [1, 64, seq_max]},
        "inputs": [{"name": n, **ids} for n in ("input_ids", "attention_mask", "token_type_ids")],
        "outputs": [{"name": "last_hidden_state", "dtype": "float16", "shape": ["batch", "seq", 384]},
                    {"name": "sentence_embedding", "dtype": "float16", "shape": ["batch", 384]}]}))
    return engine


def test_engine_text_ensemble_fits_the_engines_profiles(minilm_onnx, tmp_path):
    engine = _fake_engine(tmp_path, minilm_onnx, seq_max=128)
    with pytest.raises(ValueError, match="seq profile stops at 128.*--max-length 128"):
        write_repository(engine, tmp_path / "repo", plugin_library=None)
    assert not (tmp_path / "repo").exists()
    with pytest.raises(ValueError, match="exceeds the engine's batch profile maximum 16"):
        write_repository(engine, tmp_path / "repo", max_length=128, max_batch_size=32)
    written = write_repository(engine, tmp_path / "repo", max_length=128)
    configs = {n: parse_config(written.root / n) for n in written.models}
    assert configs["minilm_model"].platform == "tensorrt_plan" and configs["minilm_model"].max_batch_size == 16
    assert configs["minilm"].max_batch_size == 16
    params = {k: v.string_value for k, v in configs["minilm_tokenizer"].parameters.items()}
    assert params["max_length"] == "128"
    assert configs["minilm"].output[1].data_type == triton_schema().TYPE_FP16
    validate_ensemble(configs["minilm"], configs)


def test_engine_in_the_python_backend_ships_its_sidecar_and_plugin(minilm_onnx, tmp_path):
    """An attnx engine run by attnx's runtime in Triton's Python backend (no engine runs here: the files
    and the config are checked; the runtime's engine path is tested with TensorRT in test_engine_*)."""
    engine = _fake_engine(tmp_path, minilm_onnx, seq_max=256)
    plugin = tmp_path / "libattnx_plugins.so"
    plugin.write_bytes(b"\x7fELF fake")
    written = write_repository(engine, tmp_path / "repo", backend="python", plugin_library=plugin)
    model = parse_config(written.model_dir)
    params = {k: v.string_value for k, v in model.parameters.items()}
    assert model.backend == "python" and not model.platform and written.backend == "python"
    assert params["model_file"] == "model.plan" and params["plugin_library"] == "plugins/libattnx_plugins.so"
    assert "onnx_file" not in params  # the sidecar lists the engine's tensors
    assert model.instance_group[0].kind == triton_schema().ModelInstanceGroup.KIND_GPU
    version = written.model_dir / "1"
    assert sorted(p.name for p in version.iterdir()) == ["model.plan", "model.plan.json", "model.py"]
    assert (version / "model.plan").read_bytes() == engine.read_bytes()
    assert (written.model_dir / "plugins" / "libattnx_plugins.so").is_file()
    assert not (written.root / "kserve.yaml").exists()
    configs = {n: parse_config(written.root / n) for n in written.models}
    validate_ensemble(configs["minilm"], configs)
    with pytest.raises(ValueError, match="runs on Triton's tensorrt backend or attnx's"):
        write_repository(engine, tmp_path / "repo2", backend="onnxruntime")


# ----------------------------------------------------------------------------- KServe


def test_kserve_manifest_for_the_text_repository(minilm_onnx, tmp_path):
    with pytest.raises(ValueError, match="needs the tokenizers package.*--kserve-image"):
        write_repository(minilm_onnx, tmp_path / "repo", name="minilm",
                         kserve=KServeOptions("s3://models/minilm"))
    assert not (tmp_path / "repo").exists()
    written = write_repository(minilm_onnx, tmp_path / "repo", name="minilm",
                               kserve=KServeOptions("s3://models/minilm", image="registry/attnx-triton:1", gpus=1))
    import yaml

    manifest = yaml.safe_load(written.manifest.read_text())
    assert written.manifest_checked
    service = check_manifest(manifest)  # through kserve's own V1beta1InferenceService and back
    model = service["spec"]["predictor"]["model"]
    assert service["metadata"]["name"] == "minilm" and model["modelFormat"]["name"] == "triton"
    assert model["storageUri"] == "s3://models/minilm" and model["protocolVersion"] == "v2"
    assert model["image"] == "registry/attnx-triton:1" and model["resources"]["limits"]["nvidia.com/gpu"] == "1"
    bad = {**manifest, "spec": {"predictor": {"model": {**manifest["spec"]["predictor"]["model"], "storageUrl": "x"}}}}
    with pytest.raises(ValueError, match="has no field 'storageUrl'"):
        check_manifest(bad)
    assert "kserve.yaml" in (written.root / "README.md").read_text()


def test_cli_writes_the_text_ensemble_and_refuses_a_manifest_it_cannot_run(minilm_onnx, tmp_path):
    def attnx(*args):
        return run_cli("triton-repo", minilm_onnx, *args)

    run = attnx("-o", str(tmp_path / "repo"), "--kserve-uri", "s3://models/minilm")
    lines = run.stderr.strip().splitlines()
    assert run.returncode != 0 and len(lines) == 1 and "--kserve-image" in lines[0], run.stderr
    assert not (tmp_path / "repo").exists()
    run = attnx("-o", str(tmp_path / "repo"), "--kserve-uri", "not a uri", "--kserve-image", "img")
    assert run.returncode != 0 and "storage URI 'not a uri'" in run.stderr and not (tmp_path / "repo").exists()
    run = attnx("-o", str(tmp_path / "repo"), "--name", "minilm", "--pad-multiple", "32", "--kserve-uri", "gs://b/minilm",
                "--kserve-image", "registry/attnx-triton:1")
    assert run.returncode == 0, run.stderr
    assert "call minilm with a BYTES input 'text'" in " ".join(run.stdout.split())
    params = {k: v.string_value for k, v in parse_config(tmp_path / "repo" / "minilm_tokenizer").parameters.items()}
    assert params["pad_to_multiple_of"] == "32"
    assert "storageUri: gs://b/minilm" in (tmp_path / "repo" / "kserve.yaml").read_text()
