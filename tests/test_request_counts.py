"""Count before you build (issue 45, item 3): what a raw JSON body holds is checked before it is parsed
(runtime/wire/counts.py), and the counts that follow the parse (messages, ``n`` x prompts, token ids) come before
any tokenising or rendering, on every wire: a flood of strings, prompts, messages, id lists or token ids is one
4xx line naming the limit, and nothing was tokenised for it."""

from __future__ import annotations

import json

import grpc
import httpx
import pytest

import generation_fixtures as gf
from attnx.runtime import BatcherConfig
from attnx.runtime.core.text import TextTokenizer
from attnx.runtime.wire.counts import check_json
from attnx.runtime.wire.errors import Kind, ProtocolError
from attnx.runtime.wire.limits import JsonBound, Limits
from conftest_runtime import running_server
from support import exports


def bound(strings=None, values=None, lists=None) -> JsonBound:
    return JsonBound(strings, values, lists, "the test's limits")


# --- the scan alone ---------------------------------------------------------------------------------------------

def test_strings_are_counted_exactly_escaped_quotes_and_backslashes_included():
    tricky = ['a\\"b', 'c\\\\', '\\\\\\"', "d,[{e", ""]  # as JSON: escaped quotes, backslashes, structure in text
    for n in (2000, 2001):
        items = [tricky[i % len(tricky)] for i in range(n - 1)]  # plus the key "input": n strings in all
        body = ('{"input": [' + ", ".join(f'"{t}"' for t in items) + "]}").encode()
        assert len(json.loads(body)["input"]) == n - 1
        if n <= 2000:
            check_json(body, bound(strings=2000), "POST /x")
        else:
            with pytest.raises(ProtocolError) as info:
                check_json(body, bound(strings=2000), "POST /x")
            assert info.value.kind == Kind.TOO_MANY
            assert info.value.message.startswith("the request body holds 2001 strings, over the 2000 a request to "
                                                 "POST /x may hold (from the test's limits)")


def test_commas_and_brackets_inside_strings_are_not_values():
    text = "a, [b], {c}, " * 20_000  # 80,000 commas and brackets, inside one string
    body = json.dumps({"input": [text, text], "model": "m"}).encode()
    check_json(body, bound(strings=10, values=100, lists=10), "POST /x")  # 2 texts, 3 keys, 1 list: fine
    ids = json.dumps({"input": [[1, 2, 3]] * 400}).encode()
    with pytest.raises(ProtocolError, match="holds 401 lists, over the 100"):
        check_json(ids, bound(strings=10, values=10_000, lists=100), "POST /x")
    with pytest.raises(ProtocolError, match=r"holds 1\d\d\d values, over the 1000"):
        check_json(ids, bound(strings=10, values=1000, lists=1000), "POST /x")


def test_route_bounds_follow_the_limits_and_leave_kserve_tensors_unbounded():
    limits = Limits(max_texts=16, max_messages=8, max_request_tokens=1000)
    texts, chat, kserve = (limits.json_bound(r) for r in ("texts", "chat", "kserve"))
    assert texts.strings == 2 * 16 + (1 << 16) and "--max-inputs 16" in texts.limits
    assert chat.strings == 8 * 8 + (1 << 16) and "8 messages" in chat.limits
    assert kserve.values is None and kserve.lists is None  # 16 Mi-element tensors are legitimate
    numbers = ("[" + ",".join(["1.5"] * 300_000) + "]").encode()
    check_json(b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [300000], "data": ' + numbers + b"}]}",
               kserve, "POST /v2/models/m/infer")


# --- over HTTP and gRPC, nothing tokenised ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server():
    models = {"minilm": exports.minilm().path, "llm": gf.export(gf.chat_folder(), "mha")}
    with running_server(models, grpc_port=0, batching=BatcherConfig(max_batch_size=8, max_queue_size=64)) as s:
        yield s


@pytest.fixture
def tokenised(monkeypatch):
    """How many texts were tokenised (any model, any route) while the test ran."""
    count = [0]
    for name in ("tokenize", "tokenize_pairs"):
        original = getattr(TextTokenizer, name)

        def counted(self, texts, *a, _original=original, **kw):
            count[0] += len(texts)
            return _original(self, texts, *a, **kw)

        monkeypatch.setattr(TextTokenizer, name, counted)
    return count


def post(server, path: str, body: bytes) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", content=body, headers={"Content-Type": "application/json"}, timeout=120)


def one_line_error(r: httpx.Response) -> dict:
    error = r.json()["error"]
    assert "\n" not in error["message"]
    return error


def test_an_embeddings_flood_of_one_character_strings_is_refused_unparsed(server, tokenised):
    body = b'{"model": "minilm", "input": [' + b",".join([b'"a"'] * 300_000) + b"]}"
    r = post(server, "/v1/embeddings", body)
    assert r.status_code == 400, r.text
    error = one_line_error(r)
    assert error["code"] == "too_many_inputs" and "300003 strings" in error["message"]
    assert "--max-inputs 1024" in error["message"]
    assert tokenised[0] == 0


def test_millions_of_token_id_lists_are_refused_unparsed(server, tokenised):
    body = b'{"model": "minilm", "input": [' + b",".join([b"[101,2000,102]"] * 300_000) + b"]}"
    r = post(server, "/v1/embeddings", body)
    assert r.status_code == 400 and "300001 lists" in one_line_error(r)["message"], r.text
    r = post(server, "/embed", body.replace(b'"input"', b'"inputs"'))  # TEI: too many inputs is a 413
    assert r.status_code == 413 and "300001 lists" in r.json()["error"], r.text
    assert tokenised[0] == 0


def test_100000_prompts_are_refused_before_one_is_tokenised(server, tokenised):
    prompts = json.dumps({"model": "llm", "prompt": ["word"] * 100_000, "max_tokens": 1}).encode()
    r = post(server, "/v1/completions", prompts)
    assert r.status_code == 400 and "100004 strings" in one_line_error(r)["message"], r.text
    fewer = json.dumps({"model": "llm", "prompt": ["word"] * 20_000, "max_tokens": 1}).encode()  # past the scan
    r = post(server, "/v1/completions", fewer)
    assert r.status_code == 413 and "20000 generations" in one_line_error(r)["message"], r.text
    assert tokenised[0] == 0


def test_100000_chat_messages_are_refused_before_anything_is_rendered(server, tokenised):
    def chat(n):
        return json.dumps({"model": "llm", "max_tokens": 1,
                           "messages": [{"role": "user", "content": "hi"}] * n}).encode()

    r = post(server, "/v1/chat/completions", chat(100_000))
    assert r.status_code == 400 and "strings, over the" in one_line_error(r)["message"], r.text
    assert "2048 messages" in r.json()["error"]["message"]
    r = post(server, "/v1/chat/completions", chat(5000))  # past the scan: counted right after the parse
    error = one_line_error(r)
    assert r.status_code == 400 and error["param"] == "messages", r.text
    assert "'messages' has 5000 messages, over the limit of 2048" in error["message"]
    assert tokenised[0] == 0


def test_kserve_bytes_flood_is_refused_but_a_big_number_tensor_is_not_counted(server, tokenised):
    texts = json.dumps({"inputs": [{"name": "text", "datatype": "BYTES", "shape": [200_000],
                                    "data": ["a"] * 200_000}]}).encode()
    r = post(server, "/v2/models/minilm/infer", texts)
    assert r.status_code == 400 and "200007 strings" in r.json()["error"], r.text
    assert tokenised[0] == 0


def test_grpc_decode_of_a_million_ids_is_refused_and_a_small_one_answered(server):
    from attnx.runtime.apis.tei_grpc import messages

    with grpc.insecure_channel(server.grpc_address) as channel:
        decode = channel.unary_unary("/tei.v1.Tokenize/Decode",
                                     request_serializer=messages()["DecodeRequest"].SerializeToString,
                                     response_deserializer=messages()["DecodeResponse"].FromString)
        meta = (("model", "minilm"),)
        with pytest.raises(grpc.RpcError) as info:
            decode(messages()["DecodeRequest"](ids=[2000] * 1_000_000), metadata=meta, timeout=60)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "1000000 token ids, over the limit of 300000" in info.value.details()
        ids = [2000, 3899, 2652, 1999, 1996, 4586]  # "two dogs play in the snow"
        tok = server.models["minilm"].tokenizer
        answer = decode(messages()["DecodeRequest"](ids=ids, skip_special_tokens=True), metadata=meta, timeout=60)
        assert answer.text == tok.decode(ids) and answer.text
        with pytest.raises(grpc.RpcError) as info:
            decode(messages()["DecodeRequest"](ids=[tok.vocab_size]), metadata=meta, timeout=60)
        assert "outside the vocabulary" in info.value.details()


def test_texts_far_over_the_token_limit_are_refused_before_all_are_tokenised(tokenised):
    """Texts are tokenised 64 at a time with the request's tokens checked after each group: 200 texts of ~300
    tokens under a 20,000-token limit are refused after two groups (128 texts), never all 200."""
    with running_server({"minilm": exports.minilm().path}, limits=Limits(max_request_tokens=20_000)) as s:
        long = "word " * 300
        r = httpx.post(f"{s.url}/v1/embeddings", json={"input": [long] * 200}, timeout=120)
        assert r.status_code == 413, r.text
        each = min(302, s.models["minilm"].tokenizer.max_length)  # 300 words, CLS and SEP, cut to the max length
        assert f"come to at least {128 * each} tokens" in r.json()["error"]["message"]
        assert "over the limit of 20000 tokens" in r.json()["error"]["message"]
        assert tokenised[0] == 128
        ok = httpx.post(f"{s.url}/v1/embeddings", json={"input": [long] * 60}, timeout=120)
        assert ok.status_code == 200 and len(ok.json()["data"]) == 60, ok.text


def test_texts_needing_more_compute_than_the_deadline_are_refused_before_all_are_tokenised(tokenised):
    """The batcher's admission by work, checked after each group of 64: once the rate for these lengths is known,
    1,024 texts of the max length (~260,000 tokens: seconds of compute on any CPU) against a 200 ms queue deadline
    are refused after a few groups, not after all 1,024 were tokenised."""
    long = "word " * 600
    with running_server({"minilm": exports.minilm().path}, batching=BatcherConfig(timeout_ms=200)) as s:
        warm = httpx.post(f"{s.url}/v1/embeddings", json={"input": [long] * 4}, timeout=120)
        assert warm.status_code == 200, warm.text  # the rate at this length is known from here
        before = tokenised[0]
        r = httpx.post(f"{s.url}/v1/embeddings", json={"input": [long] * 1024}, timeout=120)
        assert r.status_code == 413 and "s of compute" in r.json()["error"]["message"], r.text
        assert tokenised[0] - before < 1024 and (tokenised[0] - before) % 64 == 0
