"""Serving any ONNX encoder (issue 17): a small BERT made with transformers' ``save_pretrained``,
exported by ``torch.onnx`` with dynamic axes named ``batch_size`` / ``sequence_length``; batched and
padded, compared with the model run alone and with transformers. (Optimum's exporter needs
transformers < 4.58 and cannot be installed beside attnx's transformers 5, so it is not tested here.)"""

from __future__ import annotations

import os
import threading

import httpx
import numpy as np
import onnx
import pytest
import tritonclient.http as httpclient

from attnx.runtime import BatcherConfig, load
from attnx.runtime.core.axes import AxisError, AxisFlags
from attnx.runtime.core.layout import BatchLayout
from attnx.runtime.wire.metrics import histogram_counts
from conftest_runtime import assert_outputs_equal, running_server, triton_infer

import transformers
import torch  # noqa: E402
from support.cli import run as attnx  # noqa: E402
os.environ.setdefault("HF_HUB_OFFLINE", "1")
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + "the a man woman dog cat eats runs sees big small red".split()
NAMES = ["input_ids", "attention_mask", "token_type_ids"]
PAD_ID = 0


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    """(onnx path, tokenizer folder, transformers model): a random BERT saved and exported as users do."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    transformers.logging.set_verbosity_error()
    folder = tmp_path_factory.mktemp("small-bert")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=64, pad_token_id=PAD_ID)
    transformers.BertModel(cfg).eval().save_pretrained(folder)
    hf = transformers.BertModel.from_pretrained(folder).eval()
    tok = Tokenizer(models.WordPiece({w: i for i, w in enumerate(VOCAB)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.BertProcessing(("[SEP]", 3), ("[CLS]", 2))
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text('{"pad_token": "[PAD]", "model_max_length": 64}')

    class Wrapped(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, token_type_ids):
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
            return out.last_hidden_state, out.pooler_output

    ids = torch.randint(5, len(VOCAB), (2, 7))
    path = folder.parent / "small-bert.onnx"
    axes = {n: {0: "batch_size", 1: "sequence_length"} for n in NAMES + ["last_hidden_state"]}
    torch.onnx.export(Wrapped(hf).eval(), (ids, torch.ones_like(ids), torch.zeros_like(ids)), str(path), dynamo=True,
                      input_names=NAMES, output_names=["last_hidden_state", "pooler_output"],
                      dynamic_axes={**axes, "pooler_output": {0: "batch_size"}})
    return path, folder, hf


def renamed(path, out, mapping):
    """A copy of an ONNX file with dynamic dims renamed (``{old: new}``), as other exporters name them."""
    model = onnx.load(str(path))
    for value in list(model.graph.input) + list(model.graph.output):
        for dim in value.type.tensor_type.shape.dim:
            key = (value.name, dim.dim_param)
            new = mapping.get(key, mapping.get(dim.dim_param))
            if new is not None:
                dim.dim_param = new
    onnx.save(model, str(out))
    return out


def ids_request(length, seed):
    rng = np.random.default_rng(seed)
    ids = np.concatenate([[2], rng.integers(5, len(VOCAB), length - 2), [3]]).astype(np.int64)[None, :]
    return {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}


def test_axes_come_from_common_names_and_describe_says_so(bert, tmp_path):
    path, _, _ = bert
    session = load(path, device="cpu")
    assert [s.shape for s in session.inputs] == [("batch", "seq")] * 3
    assert session.output("last_hidden_state").shape == ("batch", "seq", 32)
    assert session.output("pooler_output").shape == ("batch", 32)
    assert session.input("input_ids").range == (0, len(VOCAB))  # from the embedding table it indexes
    layout = BatchLayout.of(session)
    assert layout.can_batch and layout.can_pad
    run = attnx("serve", str(path), "--describe", env={"ATTNX_WORKDIR": str(tmp_path)})
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert "in  input_ids [batch_size, sequence_length]: batch=0 (dim name 'batch_size'), seq=1 (dim name " \
           "'sequence_length')" in out
    assert "out pooler_output [batch_size, 32]: batch=0 (dim name 'batch_size'), seq: -" in out
    assert "batched and padded" in out and "split by row: ['pooler_output']" in out


def test_concurrent_requests_of_different_lengths_are_merged_and_equal_single_runs(bert):
    path, _, hf = bert
    session = load(path, device="cpu")
    lengths = [4, 9, 6, 12, 3, 8, 10, 5]
    requests = [ids_request(n, seed=i) for i, n in enumerate(lengths)]
    alone = [session.run(r) for r in requests]
    batching = BatcherConfig(max_batch_size=16, max_queue_delay_ms=300, max_length_ratio=None)
    results, errors = {}, []
    with running_server({"bert": path}, batching=batching) as srv:
        barrier = threading.Barrier(len(requests))

        def call(i):
            c = httpclient.InferenceServerClient(srv.address, network_timeout=60)
            try:
                barrier.wait(30)
                results[i], _ = triton_infer(c, "bert", requests[i])
            except Exception as e:  # noqa: BLE001
                errors.append(e)
            finally:
                c.close()

        threads = [threading.Thread(target=call, args=(i,)) for i in range(len(requests))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        text = httpx.get(srv.url + "/metrics", timeout=10).text
    assert not errors, errors
    for i, n in enumerate(lengths):
        assert results[i]["last_hidden_state"].shape == (1, n, 32)
        assert_outputs_equal(results[i], alone[i], atol=1e-5)
        with torch.no_grad():
            want = hf(**{k: torch.from_numpy(v) for k, v in requests[i].items()})
        np.testing.assert_allclose(results[i]["pooler_output"], want.pooler_output.numpy(), atol=1e-5, rtol=0)
    per_batch = histogram_counts(text, "attnx_batch_requests", "bert")
    assert per_batch["+Inf"] < len(requests) and per_batch["1.0"] < per_batch["+Inf"]  # requests per batch > 1


def test_token_ids_are_padded_with_the_pad_id_and_the_mask_with_zero(bert):
    path, _, _ = bert
    session = load(path, device="cpu")
    layout = BatchLayout.of(session, pad_id=7)
    a, b = (layout.prepare(session.check_feeds(ids_request(n, seed=n))) for n in (3, 6))
    merged, _ = layout.merge([a, b])
    np.testing.assert_array_equal(merged["input_ids"][0, 3:], [7, 7, 7])
    np.testing.assert_array_equal(merged["attention_mask"][0], [1, 1, 1, 0, 0, 0])
    np.testing.assert_array_equal(merged["token_type_ids"][0, 3:], [0, 0, 0])


def test_a_tokenizer_folder_gives_such_a_file_the_text_input(bert):
    path, folder, hf = bert
    texts = ["the man sees a big dog", "a cat runs", "the small red cat eats"]
    with running_server({"bert": path}, tokenizers={None: folder}) as srv:
        c = httpclient.InferenceServerClient(srv.address)
        try:
            meta = c.get_model_metadata("bert")
            assert meta["inputs"][0] == {"name": "text", "datatype": "BYTES", "shape": [-1]}
            assert meta["parameters"]["max_length"] == 64
            item = httpclient.InferInput("text", [3], "BYTES")
            item.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=object))
            result = c.infer("bert", [item])
        finally:
            c.close()
    hidden = result.as_numpy("last_hidden_state")
    for i, t in enumerate(texts):
        ids = [2] + [VOCAB.index(w) for w in t.split()] + [3]
        with torch.no_grad():
            want = hf(input_ids=torch.tensor([ids])).last_hidden_state[0].numpy()
        np.testing.assert_allclose(hidden[i, :len(ids)], want, atol=1e-5, rtol=0)


def test_unknown_axes_are_served_unbatched_with_one_warning_and_flags_fix_it(bert, tmp_path):
    path, _, _ = bert
    odd = renamed(path, tmp_path / "odd.onnx", {"batch_size": "dim_a", "sequence_length": "dim_b"})
    heard: list[str] = []
    batching = BatcherConfig(max_batch_size=16, max_queue_delay_ms=200, max_length_ratio=None)
    requests = [ids_request(6, seed=i) for i in range(4)]
    session = load(odd, device="cpu")
    with running_server({"odd": odd}, batching=batching, on_warning=heard.append) as srv:
        assert len(heard) == 1 and "served unbatched" in heard[0] and "--batch-axis" in heard[0]
        assert not srv.models["odd"].batcher.layout.can_batch
        futures = [srv.models["odd"].batcher.submit(r) for r in requests]
        for f, r in zip(futures, requests):
            assert_outputs_equal(f.result(60), session.run(r), atol=1e-5)
        assert srv.models["odd"].batcher.stats.largest_batch == 1  # never wrongly batched
    flags = AxisFlags.parse(["0"], ["input_ids=1", "attention_mask=1", "token_type_ids=1", "last_hidden_state=1"])
    fixed = load(odd, device="cpu", axes=flags)
    assert BatchLayout.of(fixed).can_pad
    with pytest.raises(AxisError, match="fixed"):
        load(odd, device="cpu", axes=AxisFlags.parse(None, ["pooler_output=1"]))


def test_an_output_with_a_dynamic_dim_of_unknown_meaning_is_never_padded(bert, tmp_path):
    path, _, _ = bert
    odd = renamed(path, tmp_path / "out.onnx", {("last_hidden_state", "sequence_length"): "s9"})
    layout = BatchLayout.of(load(odd, device="cpu"))
    assert layout.can_batch and not layout.can_pad
    assert "equal lengths only" in layout.verdict()


def test_ids_outside_the_embedding_table_are_refused_before_batching(bert):
    path, _, _ = bert
    with running_server({"bert": path}) as srv:
        for bad in (len(VOCAB), -1):
            body = {"inputs": [{"name": "input_ids", "datatype": "INT64", "shape": [1, 3], "data": [2, bad, 3]}]}
            r = httpx.post(f"{srv.url}/v2/models/bert/infer", json=body, timeout=30)
            assert r.status_code == 400 and "outside the model's range" in r.json()["error"], r.text
