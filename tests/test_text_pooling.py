"""A plain ONNX encoder (token embeddings only) fed through a sentence-transformers folder (issue 26,
item 2): ``TextModel`` and ``attnx serve --tokenizer`` pool it as the folder's ``modules.json`` /
``1_Pooling/config.json`` say (CLS here, where mean pooling gave cosine 0.54), compared with
sentence-transformers itself; a folder without them gets mean pooling and says so once."""

from __future__ import annotations

import json
import os
import shutil
import warnings

import numpy as np
import pytest
import tritonclient.http as httpclient

from attnx.runtime import TextModel, load
from attnx.runtime.core.pooling import Pooling, pool_batch, read_pooling
from conftest_runtime import cosine_rows, running_server
from support.cli import run as attnx

import transformers
import torch  # noqa: E402
os.environ.setdefault("HF_HUB_OFFLINE", "1")
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + "the a man woman dog cat eats runs sees big small red".split()
TEXTS = ["the man sees a big dog", "a cat runs", "the small red cat eats the big dog", "a woman"]


@pytest.fixture(scope="module")
def st_model(tmp_path_factory):
    """(plain onnx with last_hidden_state only, a sentence-transformers folder pooling CLS, its model)."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling as STPooling, Transformer
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    transformers.logging.set_verbosity_error()
    base = tmp_path_factory.mktemp("cls-bert")
    bert = base / "bert"
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=64, pad_token_id=0)
    transformers.BertModel(cfg).eval().save_pretrained(bert)
    tok = Tokenizer(models.WordPiece({w: i for i, w in enumerate(VOCAB)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.BertProcessing(("[SEP]", 3), ("[CLS]", 2))
    tok.save(str(bert / "tokenizer.json"))
    (bert / "tokenizer_config.json").write_text(json.dumps({"pad_token": "[PAD]", "model_max_length": 64,
                                                            "tokenizer_class": "BertTokenizerFast"}))
    st = SentenceTransformer(modules=[Transformer(str(bert)), STPooling(32, "cls")], device="cpu")
    folder = base / "st-cls"
    st.save(str(folder))
    hf = transformers.BertModel.from_pretrained(bert).eval()

    class Hidden(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, token_type_ids):
            return self.model(input_ids=input_ids, attention_mask=attention_mask,
                              token_type_ids=token_type_ids).last_hidden_state

    ids = torch.randint(5, len(VOCAB), (2, 7))
    path = base / "plain.onnx"
    names = ["input_ids", "attention_mask", "token_type_ids"]
    axes = {n: {0: "batch", 1: "seq"} for n in names + ["last_hidden_state"]}
    torch.onnx.export(Hidden(hf).eval(), (ids, torch.ones_like(ids), torch.zeros_like(ids)), str(path), dynamo=True,
                      input_names=names, output_names=["last_hidden_state"], dynamic_axes=axes)
    return path, folder, st


def test_the_folder_says_cls_and_that_is_read(st_model):
    _, folder, _ = st_model
    assert read_pooling(folder) == Pooling(("cls",), False, str(folder / "modules.json"))


def test_text_model_pools_as_the_folder_says_and_equals_sentence_transformers(st_model):
    path, folder, st = st_model
    want = st.encode(TEXTS, convert_to_numpy=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the folder states its pooling: nothing to warn about
        model = TextModel(path, tokenizer=folder)
    got = model.encode(TEXTS, batch_size=4)  # one padded batch: each text pooled over its own tokens
    assert got.shape == want.shape == (len(TEXTS), 32)
    assert cosine_rows(got, want).min() > 0.99999
    assert np.abs(got - want).max() < 1e-4
    mean = TextModel(path, tokenizer=folder).encode(TEXTS, output_value="token_embeddings")
    assert cosine_rows(np.stack([m.mean(0) for m in mean]), want).min() < 0.99  # the mean would be wrong here


def test_attnx_serve_with_the_folder_gives_the_pooled_embedding(st_model):
    path, folder, st = st_model
    heard: list[str] = []
    with running_server({"bert": path}, tokenizers={None: folder}, on_warning=heard.append) as srv:
        assert not heard
        assert "cls pooling" in srv.describe()
        c = httpclient.InferenceServerClient(srv.address)
        try:
            meta = c.get_model_metadata("bert")
            assert {"name": "sentence_embedding", "datatype": "FP32", "shape": [-1, 32]} in meta["outputs"]
            item = httpclient.InferInput("text", [len(TEXTS)], "BYTES")
            item.set_data_from_numpy(np.array([t.encode() for t in TEXTS], dtype=object))
            result = c.infer("bert", [item], outputs=[httpclient.InferRequestedOutput("sentence_embedding")])
        finally:
            c.close()
    got = result.as_numpy("sentence_embedding")
    assert cosine_rows(got, st.encode(TEXTS)).min() > 0.99999


def test_a_folder_without_pooling_config_is_mean_pooled_and_says_so_once(st_model, tmp_path):
    path, folder, _ = st_model
    bare = tmp_path / "tok"
    bare.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(folder / name, bare / name)
    with pytest.warns(UserWarning, match="mean of 'last_hidden_state'") as caught:
        model = TextModel(path, tokenizer=bare)
    assert len([w for w in caught if "mean of" in str(w.message)]) == 1
    tokens = model.encode(TEXTS, output_value="token_embeddings")
    np.testing.assert_allclose(model.encode(TEXTS), np.stack([t.mean(0) for t in tokens]), atol=1e-5, rtol=0)
    heard: list[str] = []
    with running_server({"bert": path}, tokenizers={None: bare}, on_warning=heard.append):
        pass
    assert len(heard) == 1 and "mean of 'last_hidden_state'" in heard[0]
    run = attnx("serve", f"bert={path}", "--tokenizer", str(bare), "--describe", env={"ATTNX_WORKDIR": str(tmp_path)})
    assert run.returncode == 0, run.stderr
    assert run.stderr.count("mean of 'last_hidden_state'") == 1
    assert "mean pooling (no pooling config)" in run.stdout


def test_every_sentence_transformers_mode_matches_its_definition():
    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((2, 4, 3)).astype(np.float32)
    mask = np.array([[1, 1, 1, 0], [1, 1, 0, 0]])
    one = [hidden[0, :3], hidden[1, :2]]  # each row's own tokens
    want = {"cls": [t[0] for t in one], "lasttoken": [t[-1] for t in one], "max": [t.max(0) for t in one],
            "mean": [t.mean(0) for t in one], "mean_sqrt_len_tokens": [t.sum(0) / np.sqrt(len(t)) for t in one],
            "weightedmean": [(t * np.arange(1, len(t) + 1)[:, None]).sum(0) / np.arange(1, len(t) + 1).sum()
                             for t in one]}
    for mode, rows in want.items():
        np.testing.assert_allclose(pool_batch(hidden, mask, Pooling((mode,))), np.stack(rows), atol=1e-6, err_msg=mode)
    both = pool_batch(hidden, mask, Pooling(("cls", "mean"), normalize=True))
    assert both.shape == (2, 6) and np.allclose(np.linalg.norm(both, axis=1), 1)


def test_a_dense_module_or_an_escaping_path_gets_no_pooled_output_and_a_note(st_model, tmp_path):
    path, folder, _ = st_model
    for name, modules in {"dense": [{"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                                    {"path": "2_Dense", "type": "sentence_transformers.models.Dense"}],
                          "escape": [{"path": "../../..", "type": "sentence_transformers.models.Pooling"}]}.items():
        odd = tmp_path / name
        shutil.copytree(folder, odd)
        (odd / "modules.json").write_text(json.dumps(modules))
        heard: list[str] = []
        with running_server({"bert": load(path, device="cpu")}, tokenizers={None: odd}, on_warning=heard.append) as srv:
            assert srv.models["bert"].session.output_names == ["last_hidden_state"]
        assert len(heard) == 1 and "no 'sentence_embedding' output" in heard[0], heard
