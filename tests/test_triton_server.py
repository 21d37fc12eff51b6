"""`attnx triton-repo` repositories in a real Triton server (nvidia-pytriton's ``tritonserver``, Triton 2.51).

One server for the module, on one repository written by ``attnx triton-repo --backend python``: the real
all-MiniLM-L6-v2 (mha, and smal with its context inputs ``self_state``/``trace``), a BERT cross-encoder
(random weights, tests/scoring_fixtures.py) and a foreign ONNX file (a BERT exported by ``torch.onnx``,
no attnx metadata). The unmodified tritonclient queries them over HTTP and gRPC, runs the repository
README's own examples as written, and sends concurrent requests of different lengths through Triton's
dynamic batcher; answers are compared with sentence-transformers and transformers (max abs <= 1e-5).

This Triton has no ONNX Runtime or TensorRT backend, so the model steps here run on attnx's runtime
in the Python backend; the ensembles and tokenizer models around them are the ones the ONNX Runtime
and TensorRT forms use too. Those forms' model configs are checked against Triton's own schema and
their ensembles followed step by step with ONNX Runtime in tests/test_triton_repo.py and
tests/test_triton_text.py.
"""

from __future__ import annotations

import contextlib
import io
import re
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

sys.path.insert(0, str(Path(__file__).parent))
import scoring_fixtures  # noqa: E402
from tritonserver import TritonServer  # noqa: E402

from attnx.deploy.repository import write_repository  # noqa: E402

TEXTS = ["A man is eating food.", "A man is riding a white horse on an enclosed ground.",
         "Das ist ein Satz, und noch einer, der etwas länger ist als der erste Satz hier."]
# Eight lengths across several 16-token buckets: only a ragged batch can merge them.
MANY = [" ".join(["word"] * n) + "." for n in (3, 40, 7, 90, 15, 2, 60, 25)]
PAIRS = [("how do dogs play", "Two dogs play in the snow."), ("how do dogs play", "A man is eating food.")]
FOREIGN_VOCAB = 40
TOL = 1e-5


@pytest.fixture(scope="module")
def foreign(tmp_path_factory):
    """(onnx path, transformers model): a random BERT exported by torch.onnx with dims named
    ``batch_size`` / ``sequence_length``, as exporters other than attnx name them."""
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=FOREIGN_VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=64)
    hf = transformers.BertModel(cfg).eval()

    class Hidden(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask):
            return self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    path = tmp_path_factory.mktemp("foreign") / "bert.onnx"
    ids = torch.randint(1, FOREIGN_VOCAB, (2, 7))
    axes = {n: {0: "batch_size", 1: "sequence_length"} for n in ("input_ids", "attention_mask", "last_hidden_state")}
    torch.onnx.export(Hidden(hf).eval(), (ids, torch.ones_like(ids)), str(path), dynamo=True, dynamic_axes=axes,
                      input_names=["input_ids", "attention_mask"], output_names=["last_hidden_state"])
    return path, hf


@pytest.fixture(scope="module")
def repository(minilm_export, tmp_path_factory, foreign):
    repo = tmp_path_factory.mktemp("triton") / "repo"
    # A long queue delay for minilm: concurrent requests then surely meet in Triton's batcher.
    write_repository(minilm_export("mha").path, repo, name="minilm", backend="python", max_queue_delay_us=100_000)
    write_repository(minilm_export("smal").path, repo, name="minilm_smal", backend="python")
    write_repository(scoring_fixtures.export("bert-cross-encoder"), repo, name="reranker",
                     backend="python")
    written = write_repository(foreign[0], repo, name="foreign", backend="python", max_queue_delay_us=100_000)
    assert written.backend == "python" and written.entry == "foreign"
    return repo


@pytest.fixture(scope="module")
def server(repository, tmp_path_factory):
    with TritonServer(repository, tmp_path_factory.mktemp("tritonserver")) as running:
        yield running


@pytest.fixture(scope="module")
def sbert(st_minilm):
    return st_minilm


def texts_input(module, name, texts):
    tensor = module.InferInput(name, [len(texts), 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[t.encode()] for t in texts], dtype=object))
    return tensor


def close(client):
    client.close()  # an open connection would hold the server's shutdown


def test_the_server_loaded_every_model_of_the_repository(server, repository):
    client = httpclient.InferenceServerClient(server.http)
    try:
        ready = {m["name"] for m in client.get_model_repository_index() if m.get("state") == "READY"}
        assert ready == {p.name for p in repository.iterdir() if (p / "config.pbtxt").is_file()}
        assert "CUDA driver" in server.log() or "CudaDriverHelper" in server.log()  # a CPU-only machine
        metadata = client.get_model_metadata("minilm_smal")
        assert [i["name"] for i in metadata["inputs"]] == ["text", "self_state", "trace"]
    finally:
        close(client)


@pytest.mark.parametrize("module", [httpclient, grpcclient], ids=["http", "grpc"])
def test_minilm_embeddings_are_sentence_transformers(server, sbert, module):
    client = module.InferenceServerClient(server.http if module is httpclient else server.grpc)
    try:
        result = client.infer("minilm", [texts_input(module, "text", TEXTS)])
    finally:
        close(client)
    reference = sbert.encode(TEXTS, convert_to_numpy=True)
    assert np.abs(result.as_numpy("sentence_embedding") - reference).max() <= TOL
    tokens = sbert.encode(TEXTS, output_value="token_embeddings")
    mask = result.as_numpy("attention_mask")
    hidden = result.as_numpy("last_hidden_state")
    for row, want in enumerate(tokens):
        assert mask[row].sum() == len(want)
        assert np.abs(hidden[row, :len(want)] - want.numpy()).max() <= TOL


def test_smal_without_and_with_its_context_inputs(server, sbert):
    """The defect of issue 35: smal's context inputs have a zeros default, so a request may leave them
    out (the tokenizer step fills them); given, they travel with the text, one row per text."""
    reference = sbert.encode(TEXTS, convert_to_numpy=True)
    client = grpcclient.InferenceServerClient(server.grpc)
    try:
        alone = client.infer("minilm_smal", [texts_input(grpcclient, "text", TEXTS)])
        assert np.abs(alone.as_numpy("sentence_embedding") - reference).max() <= TOL
        rng = np.random.default_rng(0)
        context = []
        for name, shape in (("self_state", [len(TEXTS), 32]), ("trace", [len(TEXTS), 32, 32])):
            tensor = grpcclient.InferInput(name, shape, "FP32")
            tensor.set_data_from_numpy(rng.standard_normal(shape).astype(np.float32))
            context.append(tensor)
        given = client.infer("minilm_smal", [texts_input(grpcclient, "text", TEXTS), *context])
        # smal is neutral at any context value: the original model's embeddings either way.
        assert np.abs(given.as_numpy("sentence_embedding") - reference).max() <= TOL
        short = grpcclient.InferInput("trace", [1, 32, 32], "FP32")
        short.set_data_from_numpy(np.zeros([1, 32, 32], np.float32))
        with pytest.raises(InferenceServerException, match="batch size does not match other inputs"):
            client.infer("minilm_smal", [texts_input(grpcclient, "text", TEXTS), short])
    finally:
        close(client)


def test_the_cross_encoder_scores_pairs_as_transformers(server, tmp_path_factory):
    reference = scoring_fixtures.reference("bert-cross-encoder")
    client = httpclient.InferenceServerClient(server.http)
    try:
        pairs = client.infer("reranker", [texts_input(httpclient, "text", [q for q, _ in PAIRS]),
                                          texts_input(httpclient, "text_pair", [d for _, d in PAIRS])])
        alone = client.infer("reranker", [texts_input(httpclient, "text", TEXTS)])
    finally:
        close(client)
    assert np.abs(pairs.as_numpy("logits") - reference.logits(PAIRS)).max() <= TOL
    assert np.abs(alone.as_numpy("logits") - reference.logits(TEXTS)).max() <= TOL


def readme_examples(repo: Path) -> dict[str, str]:
    """``{model: code}`` of the README's Python examples (each calls one model)."""
    blocks = re.findall(r"```python\n(.*?)```", (repo / "README.md").read_text(), re.S)
    return {re.search(r'client\.infer\("([^"]+)"', b).group(1): b for b in blocks}


def test_the_readme_examples_run_as_written(server, repository, sbert, tmp_path_factory):
    examples = readme_examples(repository)
    assert set(examples) == {"minilm", "minilm_smal", "reranker"}
    assert 'client.infer("minilm_smal", [text])' in examples["minilm_smal"]  # no context inputs
    sentences = ["first sentence", "second one"]
    want = {"minilm": sbert.encode(sentences), "minilm_smal": sbert.encode(sentences),
            "reranker": scoring_fixtures.reference("bert-cross-encoder").logits(PAIRS)}
    for model, code in examples.items():
        assert code.count('"localhost:8000"') == 1
        scope: dict = {}
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(code.replace('"localhost:8000"', f'"{server.http}"'), scope)  # only the address differs
        scope["client"].close()
        output = "sentence_embedding" if model != "reranker" else "logits"
        assert f"result.as_numpy({output!r})" in code and printed.getvalue().strip().startswith("[[")
        assert np.abs(scope["result"].as_numpy(output) - want[model]).max() <= TOL, model


def test_concurrent_requests_of_different_lengths_share_batches(server, sbert):
    """Triton's dynamic batcher hands the model step requests of different lengths together
    (``allow_ragged_batch``): attnx pads them into one run and cuts each answer back."""
    results, errors = {}, []
    barrier = threading.Barrier(len(MANY))

    def call(i):
        client = grpcclient.InferenceServerClient(server.grpc)
        try:
            barrier.wait()
            results[i] = client.infer("minilm", [texts_input(grpcclient, "text", [MANY[i]])])
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
        finally:
            close(client)

    before = _stats(server, "minilm_model")
    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(MANY))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    reference = sbert.encode(MANY, convert_to_numpy=True)
    got = np.concatenate([results[i].as_numpy("sentence_embedding") for i in range(len(MANY))])
    assert np.abs(got - reference).max() <= TOL
    lengths = {results[i].as_numpy("attention_mask").shape[1] for i in range(len(MANY))}
    assert len(lengths) > 1  # the requests had different padded lengths ...
    after = _stats(server, "minilm_model")
    requests, runs = after[0] - before[0], after[1] - before[1]
    assert requests == len(MANY) and runs < requests  # ... and still shared runs


def test_a_foreign_onnx_file_batches_and_matches_transformers(server, foreign):
    import torch

    _, hf = foreign
    rng = np.random.default_rng(0)
    requests = [rng.integers(1, FOREIGN_VOCAB, (1, n)).astype(np.int64) for n in (5, 17, 9, 30)]
    results, errors = {}, []
    barrier = threading.Barrier(len(requests))

    def call(i):
        client = httpclient.InferenceServerClient(server.http)
        try:
            ids = httpclient.InferInput("input_ids", list(requests[i].shape), "INT64")
            ids.set_data_from_numpy(requests[i])
            barrier.wait()
            results[i] = client.infer("foreign", [ids])  # attention_mask left out: attnx fills it
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
        finally:
            close(client)

    before = _stats(server, "foreign")
    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    for i, ids in enumerate(requests):
        with torch.no_grad():
            want = hf(input_ids=torch.from_numpy(ids)).last_hidden_state.numpy()
        got = results[i].as_numpy("last_hidden_state")
        assert got.shape == want.shape and np.abs(got - want).max() <= TOL
    after = _stats(server, "foreign")
    assert after[0] - before[0] == len(requests) and after[1] - before[1] < len(requests)


def test_a_bad_request_gets_its_own_error_and_the_server_goes_on(server, sbert):
    client = httpclient.InferenceServerClient(server.http)
    try:
        with pytest.raises(InferenceServerException, match="text 1 is empty"):
            client.infer("minilm", [texts_input(httpclient, "text", ["fine", ""])])
        ids = httpclient.InferInput("input_ids", [1, 3], "INT64")
        ids.set_data_from_numpy(np.array([[1, FOREIGN_VOCAB + 5, 2]], np.int64))
        with pytest.raises(InferenceServerException, match="outside the model's range"):
            client.infer("foreign", [ids])
        result = client.infer("minilm", [texts_input(httpclient, "text", TEXTS[:1])])
        assert np.abs(result.as_numpy("sentence_embedding") - sbert.encode(TEXTS[:1])).max() <= TOL
    finally:
        close(client)


def _stats(server, model) -> tuple[int, int]:
    """(inference_count, execution_count) of a model: requests answered, and runs they took."""
    client = httpclient.InferenceServerClient(server.http)
    try:
        stats = client.get_inference_statistics(model)["model_stats"][0]
    finally:
        close(client)
    return int(stats.get("inference_count", 0)), int(stats.get("execution_count", 0))
