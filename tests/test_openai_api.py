"""OpenAI-compatible /v1/embeddings (issue 24): the unmodified `openai` client, sync and async, against the real
all-MiniLM-L6-v2 served by attnx, compared with sentence-transformers itself; token ids, usage, `dimensions`,
`/v1/models`, OpenAI's error shape, and the limits and queue it shares with KServe v2."""

from __future__ import annotations

import asyncio
import base64
import json
import re
import threading
import time

import httpx
import numpy as np
import openai
import pytest
import tritonclient.http as httpclient

from attnx.runtime import BatcherConfig, load
from attnx.runtime.serving.encoding import Dimensions
from attnx.runtime.wire.metrics import histogram_counts
from attnx.runtime.wire.limits import Limits
from conftest_runtime import EXPORT_KW, GatedSession, cosine_rows, long_text, running_server
from support import exports

TEXTS = ["A man is eating food.", "Two dogs play in the snow near a frozen lake this morning.", "Hi",
         "The quick brown fox jumps over the lazy dog, again and again, until the dog finally wakes up."]
#: Tight enough to test, loose enough for every other request here.
LIMITS = Limits(max_texts=64, max_request_tokens=2000)


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    return load(exports.minilm().path, device="cpu")


@pytest.fixture(scope="module")
def server(session, exported):
    """MiniLM twice (one may be cut to fewer dimensions, one may not) and maw, which cannot embed text."""
    batching = BatcherConfig(max_batch_size=32, max_queue_delay_ms=20, max_length_ratio=None)
    models = {"minilm": session, "minilm-fixed": session, "maw": exported("maw", **EXPORT_KW).path}
    with running_server(models, batching=batching, limits=LIMITS,
                        dimensions=Dimensions.parse(["minilm=any"], models)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def st():
    return exports.minilm_reference()


def vectors(response) -> np.ndarray:
    """The embeddings of a response; asked for as base64, the client hands them over undecoded."""
    assert [d.index for d in response.data] == list(range(len(response.data)))
    rows = [np.frombuffer(base64.b64decode(d.embedding), "<f4") if isinstance(d.embedding, str) else d.embedding
            for d in response.data]
    return np.array(rows, dtype=np.float32)


def assert_matches(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape, (got.shape, want.shape)
    assert cosine_rows(got, want).min() >= 0.9999
    assert np.abs(got - want).max() < 3e-5


def st_tokens(st, texts) -> int:
    return int(st.tokenize(texts)["attention_mask"].sum())


# --- the bars: the openai client equals sentence-transformers -------------------------------------------


def test_a_string_equals_sentence_transformers(client, st):
    response = client.embeddings.create(input=TEXTS[0], model="minilm", encoding_format="float")
    assert response.model == "minilm" and response.object == "list" and len(response.data) == 1
    assert_matches(vectors(response), st.encode([TEXTS[0]]))
    assert response.usage.prompt_tokens == response.usage.total_tokens == st_tokens(st, TEXTS[:1])


@pytest.mark.parametrize("encoding", ["float", "base64", None], ids=["float", "base64", "client-default"])
def test_a_list_equals_sentence_transformers(client, st, encoding):
    kwargs = {"encoding_format": encoding} if encoding else {}  # the client asks for base64 by default
    response = client.embeddings.create(input=TEXTS, model="minilm", **kwargs)
    assert_matches(vectors(response), st.encode(TEXTS))
    assert response.usage.prompt_tokens == st_tokens(st, TEXTS)


def test_base64_on_the_wire_is_little_endian_float32_of_the_float_answer(http):
    answers = {}
    for fmt in ("float", "base64"):
        r = http.post("/v1/embeddings", json={"input": TEXTS[:2], "model": "minilm", "encoding_format": fmt})
        assert r.status_code == 200 and r.headers["content-type"] == "application/json"
        answers[fmt] = r.json()["data"]
    decoded = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in answers["base64"]]
    np.testing.assert_array_equal(np.array(decoded), np.array([d["embedding"] for d in answers["float"]], np.float32))


@pytest.mark.parametrize("dims", [64, 128, 383])
def test_dimensions_cut_and_renormalise_as_sentence_transformers_truncate_dim(client, st, dims):
    response = client.embeddings.create(input=TEXTS, model="minilm", dimensions=dims)
    got = vectors(response)
    want = st.encode(TEXTS, truncate_dim=dims)  # sentence-transformers' own Matryoshka cut...
    want = want / np.linalg.norm(want, axis=1, keepdims=True)  # ...renormalised, as OpenAI's are
    assert_matches(got, want)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)


def test_the_async_client_concurrently(server, st):
    async def main():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as c:
            return await asyncio.gather(*(c.embeddings.create(input=[t], model="minilm") for t in TEXTS),
                                        c.embeddings.create(input=TEXTS, model="minilm", dimensions=96))

    *singles, cut = asyncio.run(main())
    assert_matches(np.concatenate([vectors(r) for r in singles]), st.encode(TEXTS))
    want = st.encode(TEXTS, truncate_dim=96)
    assert_matches(vectors(cut), want / np.linalg.norm(want, axis=1, keepdims=True))


def test_langchains_openai_embedder_as_docs_serving_md_configures_it(server, st):
    from langchain_openai import OpenAIEmbeddings

    # check_embedding_ctx_length=False: otherwise it tokenises with tiktoken and sends OpenAI's token ids.
    embedder = OpenAIEmbeddings(model="minilm", base_url=server.url + "/v1", api_key="unused",
                                check_embedding_ctx_length=False, max_retries=0)
    assert_matches(np.array(embedder.embed_documents(TEXTS), np.float32), st.encode(TEXTS))
    assert_matches(np.array([embedder.embed_query(TEXTS[1])], np.float32), st.encode(TEXTS[1:2]))


# --- inputs: token ids, truncation, usage ---------------------------------------------------------------


def test_token_ids_are_the_models_own_vocabulary_used_as_given(client, st):
    ids = [st.tokenizer(t)["input_ids"] for t in TEXTS[:3]]  # special tokens included
    response = client.embeddings.create(input=ids, model="minilm")
    assert_matches(vectors(response), st.encode(TEXTS[:3]))
    assert response.usage.prompt_tokens == sum(len(i) for i in ids)
    one = client.embeddings.create(input=ids[0], model="minilm")  # one list of ids is one input
    assert len(one.data) == 1
    assert_matches(vectors(one), st.encode(TEXTS[:1]))


def test_a_long_text_is_truncated_as_sentence_transformers_does_and_counted_after(client, st):
    text = long_text(600, seed=5)
    response = client.embeddings.create(input=text, model="minilm")
    assert response.usage.prompt_tokens == 256 == st_tokens(st, [text])
    assert_matches(vectors(response), st.encode([text]))
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(input=["short", text], model="minilm", extra_body={"truncate": False})
    assert info.value.param == "input" and "input[1] is longer than the model's max length 256" in info.value.message


# --- models --------------------------------------------------------------------------------------------


def test_models_lists_every_served_model(client):
    """Issue 32: one registry; /v1/models lists every served model (maw serves KServe only, but is served)."""
    listed = client.models.list()
    assert sorted(m.id for m in listed.data) == ["maw", "minilm", "minilm-fixed"]
    assert all(m.object == "model" and m.owned_by == "attnx" and m.created > 0 for m in listed.data)
    assert client.models.retrieve("minilm").id == "minilm" and client.models.retrieve("maw").id == "maw"
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("nope")
    assert info.value.code == "model_not_found"


# --- errors: OpenAI's shape, the right status, and the server stays correct --------------------------------

MANY = [f"text number {i}" for i in range(5000)]

BAD = {
    # name: (body or raw bytes, status, param, message pattern)
    "unknown-model": ({"input": "hi", "model": "nope"}, 404, None, "'nope' does not exist"),
    "model-without-tokenizer": ({"input": "hi", "model": "maw"}, 400, "model", "has no tokenizer"),
    "no-model-with-two-served": ({"input": "hi"}, 400, "model", "several embedding models"),
    "model-not-a-string": ({"input": "hi", "model": 3}, 400, "model", "must be a string"),
    "no-input": ({"model": "minilm"}, 400, "input", "'input' is required"),
    "empty-list": ({"input": [], "model": "minilm"}, 400, "input", "empty list"),
    "empty-string": ({"input": ["ok", ""], "model": "minilm"}, 400, "input", r"input\[1\] is an empty string"),
    "input-a-number": ({"input": 3, "model": "minilm"}, 400, "input", "must be a string"),
    "input-mixed-junk": ({"input": ["ok", {"a": 1}], "model": "minilm"}, 400, "input", r"input\[1\] is dict"),
    "ids-with-a-float": ({"input": [[101, 2.5, 102]], "model": "minilm"}, 400, "input", "integer token ids"),
    "id-past-vocab": ({"input": [[101, 30522, 102]], "model": "minilm"}, 400, "input",
                      r"token id 30522 is outside the model's vocabulary \[0, 30522\)"),
    "negative-id": ({"input": [101, -1, 102], "model": "minilm"}, 400, "input", "token id -1"),
    "bad-encoding": ({"input": "hi", "model": "minilm", "encoding_format": "int8"}, 400, "encoding_format",
                     "must be one of"),
    "dims-not-allowed": ({"input": "hi", "model": "minilm-fixed", "dimensions": 128}, 400, "dimensions",
                         "does not allow 'dimensions'"),
    "dims-too-big": ({"input": "hi", "model": "minilm", "dimensions": 385}, 400, "dimensions", "from 1 to 384"),
    "dims-zero": ({"input": "hi", "model": "minilm", "dimensions": 0}, 400, "dimensions", "from 1 to 384"),
    "dims-a-string": ({"input": "hi", "model": "minilm", "dimensions": "64"}, 400, "dimensions", "integer"),
    "truncate-not-bool": ({"input": "hi", "model": "minilm", "truncate": "no"}, 400, "truncate", "boolean"),
    "context-for-a-model-without": ({"input": "hi", "model": "minilm", "context": {"trace": [[0.0]]}}, 400,
                                    "context", "takes none"),
    "5000-inputs": ({"input": MANY, "model": "minilm"}, 400, "input", "5000 inputs, over the limit of 64"),
    "too-many-tokens": ({"input": [long_text(300, seed=i) for i in range(10)], "model": "minilm"}, 413, None,
                        "2560 tokens, over the limit of 2000"),
    "not-json": (b"{input: hi", 400, None, "not valid JSON"),
    "json-but-a-list": (b"[1, 2]", 400, None, "must be a JSON object"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_requests_get_openais_error_shape_and_the_server_stays_correct(case, http, client, st):
    body, status, param, message = BAD[case]
    r = http.post("/v1/embeddings", **({"content": body} if isinstance(body, bytes) else {"json": body}))
    assert r.status_code == status, (case, r.status_code, r.text[:300])
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert re.search(message, error["message"]), error["message"]
    assert "\n" not in error["message"] and "Traceback" not in error["message"]
    if status == 404:
        assert error["code"] == "model_not_found"
    assert_matches(vectors(client.embeddings.create(input=TEXTS[:1], model="minilm")), st.encode(TEXTS[:1]))


def test_the_client_raises_its_own_exception_classes(client):
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(input="hi", model="nope")
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(input=MANY, model="minilm")
    assert info.value.status_code == 400 and info.value.code == "too_many_inputs"


def test_the_token_limit_is_shared_with_kserve_text_requests(http):
    texts = [long_text(300, seed=i) for i in range(10)]  # 10 x 256 tokens after truncation
    body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [len(texts)], "data": texts}]}
    r = http.post("/v2/models/minilm/infer", content=json.dumps(body))
    assert r.status_code == 413 and "2560 tokens, over the limit of 2000" in r.json()["error"]


# --- one queue, one set of metrics with KServe v2 -------------------------------------------------------------


def test_openai_and_kserve_requests_share_batches_and_metrics(server, st):
    texts = [long_text(n, seed=n) for n in (5, 9, 12, 7, 15, 6, 11, 8)]
    want = st.encode(texts)
    metrics = lambda: httpx.get(server.url + "/metrics", timeout=10).text  # noqa: E731
    before = histogram_counts(metrics(), "attnx_batch_requests", "minilm")
    got: dict[int, np.ndarray] = {}
    barrier = threading.Barrier(len(texts))

    def call(i: int) -> None:
        barrier.wait(30)
        if i % 2:
            with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as c:
                got[i] = vectors(c.embeddings.create(input=texts[i], model="minilm"))[0]
        else:
            c = httpclient.InferenceServerClient(server.address, network_timeout=120)
            item = httpclient.InferInput("text", [1], "BYTES")
            item.set_data_from_numpy(np.array([texts[i].encode()], dtype=object))
            got[i] = c.infer("minilm", [item], outputs=[httpclient.InferRequestedOutput("sentence_embedding")]
                             ).as_numpy("sentence_embedding")[0]
            c.close()

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(texts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(got) == list(range(len(texts)))
    assert_matches(np.array([got[i] for i in range(len(texts))]), want)
    text = metrics()
    after = histogram_counts(text, "attnx_batch_requests", "minilm")
    batches, singles = after["+Inf"] - before.get("+Inf", 0), after["1.0"] - before.get("1.0", 0)
    assert batches < len(texts) and singles < batches  # some batch merged requests of both APIs
    assert re.search(r'attnx_request_success_total\{model="minilm"\} \d+', text)
    assert 'attnx_request_failures_total{model="minilm",reason="bad_input"}' in text  # the 400s above


def test_a_full_queue_is_429_with_retry_after_and_a_request_bigger_than_the_queue_is_413(session):
    gated = GatedSession(session)
    batching = BatcherConfig(max_batch_size=1, max_queue_size=4, max_queue_delay_ms=0)
    with running_server({"g": gated}, batching=batching) as srv:
        url = srv.url + "/v1/embeddings"
        results: dict = {}

        def send(key, inputs):
            results[key] = httpx.post(url, json={"input": inputs, "model": "g"}, timeout=60)

        first = threading.Thread(target=send, args=("running", ["held in the model"]))
        first.start()
        assert gated.running.acquire(timeout=30)  # the worker is inside the model now
        # One input each: a request of several parts may first run one (a pace probe) and queue the rest later.
        queued = [threading.Thread(target=send, args=(f"queued{i}", [f"waiting {i}"])) for i in range(2)]
        for t in queued:
            t.start()
        deadline = time.monotonic() + 30
        while srv.models["g"].batcher.queue_depth < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert srv.models["g"].batcher.queue_depth == 2
        with openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0) as c:
            with pytest.raises(openai.RateLimitError) as info:
                c.embeddings.create(input=["a", "b", "c"], model="g")  # 2 waiting + 3 > 4
            assert info.value.response.headers["retry-after"] == "1"
            assert info.value.type == "rate_limit_error" and "queue full" in info.value.message
            with pytest.raises(openai.APIStatusError) as info:
                c.embeddings.create(input=["x"] * 5, model="g")  # could never fit: not worth a retry
            assert info.value.status_code == 413 and "queues at most 4" in info.value.message
        tei = httpx.post(srv.url + "/embed", json={"inputs": ["a", "b", "c"]}, timeout=60)
        assert tei.status_code == 429 and tei.json()["error_type"] == "Overloaded"
        gated.gate.set()
        for t in (first, *queued):
            t.join(60)
    assert [results[k].status_code for k in ("running", "queued0", "queued1")] == [200, 200, 200]


def test_a_placed_variants_context_rows_go_in_the_body_and_give_what_kserve_gives(tmp_path_factory):
    """cultural placed in MiniLM takes a [batch, 32] context row per text: over KServe beside the text
    tensor, here as the "context" extension; both must give the same embeddings."""
    rows = np.random.default_rng(3).standard_normal((2, 32)).astype(np.float32)
    with running_server({"cult": exports.minilm("cultural").path}) as srv:
        c = httpclient.InferenceServerClient(srv.address, network_timeout=120)
        text = httpclient.InferInput("text", [2], "BYTES")
        text.set_data_from_numpy(np.array([t.encode() for t in TEXTS[:2]], dtype=object))
        context = httpclient.InferInput("cultural", [2, 32], "FP32")
        context.set_data_from_numpy(rows)
        want = c.infer("cult", [text, context]).as_numpy("sentence_embedding")
        c.close()
        with openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0) as client:
            got = vectors(client.embeddings.create(input=TEXTS[:2], model="cult",
                                                   extra_body={"context": {"cultural": rows.tolist()}}))
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
            # left out, cultural's context is its declared default (zeros), as on KServe
            zeros = vectors(client.embeddings.create(input=TEXTS[:2], model="cult",
                                                     extra_body={"context": {"cultural": np.zeros_like(rows).tolist()}}))
            np.testing.assert_allclose(vectors(client.embeddings.create(input=TEXTS[:2], model="cult")), zeros,
                                       atol=1e-6, rtol=0)
            for extra, message in (({"context": {"cultural": rows[:1].tolist()}}, "needs 2 rows"),
                                   ({"context": {"cultural": [["a"] * 32] * 2}}, "not a regular list")):
                with pytest.raises(openai.BadRequestError) as info:
                    client.embeddings.create(input=TEXTS[:2], model="cult", extra_body=extra)
                assert info.value.param == "context" and re.search(message, info.value.message), info.value.message
        # Python's json module reads NaN (the openai client will not send it): refused, not run.
        body = '{"model": "cult", "input": "hi", "context": {"cultural": [[NaN' + ', 0' * 31 + ']]}}'
        r = httpx.post(srv.url + "/v1/embeddings", content=body, timeout=60)
        assert r.status_code == 400 and "NaN or infinite" in r.json()["error"]["message"]


def test_a_20mb_string_is_answered_at_once_as_its_truncated_start(client, st, server, monkeypatch):
    """Issue 32: one 20 MB string got no answer in 300 s (RSS 441 MB -> 3.5 GB). Texts are cut at the model's
    character cap (256 tokens x 64) before tokenising, so the answer is the first 256 tokens' embedding, as
    sentence-transformers gives it for the text (its start stands in for the whole: the same 256 tokens)."""
    base = long_text(100_000, seed=9) + " "
    text = base * (20_000_000 // len(base) + 1)
    assert len(text) >= 20_000_000
    from conftest_runtime import spy_on

    seen = spy_on(server.models["minilm"].tokenizer, monkeypatch)
    response = client.embeddings.create(input=text, model="minilm", encoding_format="float")
    assert max(seen) <= 256 * 64  # the tokenizer never read past the model's character cap
    assert response.usage.prompt_tokens == 256
    assert_matches(vectors(response), st.encode([text[:200_000]]))
    with pytest.raises(openai.APIStatusError) as info:  # truncation off: refused, not read to the end
        client.embeddings.create(input=text, model="minilm", extra_body={"truncate": False})
    assert info.value.status_code in (400, 413) and "\n" not in info.value.message
    assert httpx.get(server.url + "/v2/health/live", timeout=10).status_code == 200


def test_more_texts_than_the_queue_holds_is_413_on_every_api(session):
    """Issue 32: 9 texts to an idle KServe text route with --max-queue 8 got a retryable 503 that never succeeds
    (the OpenAI and TEI routes answered 413 for the same case)."""
    with running_server({"m": session}, batching=BatcherConfig(max_queue_size=8)) as srv:
        texts = [f"text {i}" for i in range(9)]
        body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [9], "data": texts}]}
        r = httpx.post(srv.url + "/v2/models/m/infer", json=body, timeout=60)
        assert r.status_code == 413 and "queues at most 8" in r.json()["error"] and "retry-after" not in r.headers
        assert httpx.post(srv.url + "/v1/embeddings", json={"input": texts, "model": "m"}, timeout=60).status_code == 413
        assert httpx.post(srv.url + "/embed", json={"inputs": texts}, timeout=60).status_code == 413
        body["inputs"][0].update(shape=[8], data=texts[:8])
        assert httpx.post(srv.url + "/v2/models/m/infer", json=body, timeout=60).status_code == 200
