"""Served generation (issue 23): `attnx serve` on with-past exports, over real HTTP on loopback.

The unmodified ``openai`` client (completions and chat completions, streamed or not) and Triton's generate
extension (``/v2/models/{m}/generate`` and ``generate_stream`` as server-sent events) get the text that
``TextModel.generate`` gives in process, which equals transformers' greedy ``generate`` (test_generation.py);
the chat prompt is the one transformers' ``apply_chat_template`` renders. Concurrent streams share
decoding steps and each still gets its own tokens; a client that disconnects frees its row; bad
parameters are one-line 400s and the server keeps serving.
"""

from __future__ import annotations

import json
import shutil
import threading
import time

import httpx
import numpy as np
import openai
import pytest

import generation_fixtures as gf
from conftest_runtime import running_server

import transformers
transformers.logging.set_verbosity_error()

from attnx.runtime import BatcherConfig, TextModel  # noqa: E402

PROMPT = "the cat sat on the mat"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Where is the cat?"}]


@pytest.fixture(scope="module")
def paths():
    return {"llm": gf.export(gf.chat_folder(), "mha"),
            "smal": gf.export(gf.trained_folder("llama", "smal"), None, "rewrite")}


@pytest.fixture(scope="module")
def server(paths):
    with running_server(paths, batching=BatcherConfig(max_batch_size=8, max_queue_size=64), grpc_port=0) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def local(paths):
    return {name: TextModel(p) for name, p in paths.items()}


def greedy(model: TextModel, prompt, n: int, **kw) -> str:
    return "".join(model.generate(prompt, max_new_tokens=n, **kw))


def test_completions_equal_generation_in_process(client, local):
    want = greedy(local["llm"], PROMPT, 12)
    out = client.completions.create(model="llm", prompt=PROMPT, max_tokens=12, temperature=0)
    assert out.choices[0].text == want and out.object == "text_completion"
    ids = local["llm"].tokenizer.tokenize([PROMPT])[0].ids
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens <= 12
    chunks = list(client.completions.create(model="llm", prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == out.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == out.usage.completion_tokens
    # several prompts and n: each choice its own generation, in OpenAI's order
    many = client.completions.create(model="llm", prompt=[PROMPT, "a dog"], max_tokens=6, temperature=0, n=2)
    texts = [c.text for c in sorted(many.choices, key=lambda c: c.index)]
    assert texts == [greedy(local["llm"], PROMPT, 6)] * 2 + [greedy(local["llm"], "a dog", 6)] * 2


def test_sampling_with_a_seed_repeats(client):
    kw = dict(model="llm", prompt=PROMPT, max_tokens=10, temperature=0.9, top_p=0.95, seed=7)
    a, b = (client.completions.create(**kw).choices[0].text for _ in range(2))
    assert a == b


def test_chat_completions_render_the_chat_template(client, local):
    tok = transformers.AutoTokenizer.from_pretrained(gf.chat_folder())
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    model = local["llm"]
    from attnx.runtime.core.generate import stream
    from attnx.runtime.core.sampling import SamplingParams

    want = "".join(p.text for p in stream(model.decoder, model.tokenizer, list(ids), SamplingParams(max_new_tokens=10)))
    out = client.chat.completions.create(model="llm", messages=MESSAGES, max_tokens=10, temperature=0)
    assert out.choices[0].message.content == want and out.choices[0].message.role == "assistant"
    assert out.usage.prompt_tokens == len(ids)
    chunks = list(client.chat.completions.create(model="llm", messages=MESSAGES, max_completion_tokens=10,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    with pytest.raises(openai.BadRequestError, match="no chat template"):
        client.chat.completions.create(model="smal", messages=MESSAGES, max_tokens=4)


def test_triton_generate_and_stream(http, local):
    want = greedy(local["llm"], PROMPT, 8)
    r = http.post("/v2/models/llm/generate", json={"text_input": PROMPT, "parameters": {"max_tokens": 8}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["text_output"] == want and body["model_name"] == "llm" and body["finish_reason"] in ("stop", "length")
    with http.stream("POST", "/v2/models/llm/generate_stream", json={"text_input": PROMPT, "max_tokens": 8}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[len("data: "):]) for line in r.iter_lines() if line.startswith("data: ")]
    assert "".join(e["text_output"] for e in events) == want
    assert events[-1]["finish_reason"] == body["finish_reason"]


def test_context_inputs_of_a_placed_variant(client, local):
    """A trained smal's context goes in ``extra_body``; the served text equals the same in process."""
    ctx = {"self_state": np.full((1, 32), 0.5, np.float32).tolist(), "trace": (np.eye(8, dtype=np.float32) * 0.3)[None].tolist()}
    want = greedy(local["smal"], PROMPT, 8, context={k: np.asarray(v, np.float32) for k, v in ctx.items()})
    out = client.completions.create(model="smal", prompt=PROMPT, max_tokens=8, temperature=0,
                                    extra_body={"context": ctx})
    assert out.choices[0].text == want
    assert want != greedy(local["smal"], PROMPT, 8)  # the context matters to a trained smal


@pytest.mark.parametrize("body,param", [({"max_tokens": -1}, "max_tokens"), ({"top_p": 1.5}, "top_p"),
                                        ({"temperature": -1}, "temperature"), ({"logprobs": 2}, "logprobs"),
                                        ({"prompt": "the " * 80}, "prompt"), ({"n": 50}, "n"),
                                        ({"stop": 3}, "stop"), ({"context": {"nope": [1]}}, "context")])
def test_bad_parameters_are_one_line_400s(http, body, param):
    r = http.post("/v1/completions", json={"model": "llm", "prompt": PROMPT, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "\n" not in err["message"]
    triton = {"text_input": body.get("prompt", PROMPT), **{k: v for k, v in body.items() if k != "prompt"}}
    if param in ("max_tokens", "top_p", "prompt"):
        r = http.post("/v2/models/llm/generate", json=triton)
        assert r.status_code == 400 and "\n" not in r.json()["error"]
    assert http.post("/v1/completions", json={"model": "llm", "prompt": "ok", "max_tokens": 2}).status_code == 200


def test_unknown_model_and_bad_bodies(http):
    assert http.post("/v1/completions", json={"model": "nope", "prompt": "x"}).status_code == 404
    assert http.post("/v2/models/nope/generate", json={"text_input": "x"}).status_code == 404
    assert http.post("/v1/completions", content=b"{not json").status_code == 400
    assert http.post("/v2/models/llm/generate", json={"max_tokens": 3}).status_code == 400
    models = http.get("/v1/models").json()["data"]
    assert {"llm", "smal"} <= {m["id"] for m in models}


def test_concurrent_streams_share_steps_and_keep_their_tokens(server, client, local):
    prompts = ["the cat", "a dog ran", "hi there", "one two", "the mat", "we sat", "a b c", "on the"]
    want = [greedy(local["llm"], p, 16, stop=None) for p in prompts]
    got = [None] * len(prompts)
    scheduler = server.generators["llm"].scheduler
    before = scheduler.stats.max_rows

    def one(i):
        chunks = client.completions.create(model="llm", prompt=prompts[i], max_tokens=16, temperature=0, stream=True)
        got[i] = "".join(c.choices[0].text for c in chunks)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert got == want
    assert scheduler.stats.max_rows > max(1, before) or scheduler.stats.max_rows > 1


def test_a_client_that_disconnects_frees_its_row(server):
    scheduler = server.generators["llm"].scheduler
    with httpx.Client(base_url=server.url, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json={"model": "llm", "prompt": PROMPT, "max_tokens": 60,
                                                        "temperature": 0, "stream": True,
                                                        "ignore_eos": True}) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            tokens_before = scheduler.stats.tokens
    deadline = time.monotonic() + 10
    while scheduler.running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert scheduler.running == 0
    assert scheduler.stats.tokens - tokens_before < 55  # it stopped well before its 60 tokens


# --- issue 32: one registry, typed requests, sampling that cannot poison a step ----------------------------


def test_decoders_are_served_models_on_every_kserve_route(server, http):
    """They were a separate dict: /v2/models/llm, /ready, /config answered 404 while /generate worked."""
    meta = http.get("/v2/models/llm").json()
    assert meta["name"] == "llm" and meta["inputs"][0]["name"] == "text_input"
    assert http.get("/v2/models/llm/ready").json() == {"name": "llm", "ready": True}
    assert http.get("/v2/models/llm/versions/1/ready").status_code == 200
    assert http.get("/v2/models/llm/config").json()["model_transaction_policy"] == {"decoupled": True}
    assert {"llm", "smal"} <= {m["name"] for m in http.post("/v2/repository/index").json()}
    assert http.get("/v2/health/ready").status_code == 200
    assert 'attnx_queue_depth{model="llm"}' in http.get("/metrics").text
    r = http.post("/v2/models/llm/infer", json={"inputs": []})
    assert r.status_code == 400 and "/v2/models/llm/generate" in r.json()["error"]
    import tritonclient.grpc as grpcclient

    c = grpcclient.InferenceServerClient(server.grpc_address)
    try:
        assert c.is_model_ready("llm") and c.get_model_metadata("llm").name == "llm"
    finally:
        c.close()


@pytest.mark.parametrize("field, value", [("max_tokens", 10**400), ("n", 10**400), ("seed", 10**400),
                                          ("top_k", 10**400), ("temperature", 10**400), ("temperature", "1"),
                                          ("repetition_penalty", 1e-40), ("max_tokens", 2.0), ("top_p", 0)])
def test_out_of_range_sampling_fields_are_400_naming_the_field(http, field, value):
    """Integers past float range were 500 OverflowError; a 1e-40 repetition penalty poisoned the step."""
    literal = json.dumps(value) if isinstance(value, str) else str(value)
    body = json.dumps({"model": "llm", "prompt": PROMPT, "max_tokens": 2, field: None}).replace("null", literal)
    r = http.post("/v1/completions", content=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and "\n" not in err["message"]


def test_a_subnormal_temperature_is_greedy_and_its_neighbours_are_untouched(server, local):
    """temperature 1e-310 made the probabilities NaN, raised in the scheduler's thread and failed every
    generation in the step (4 of 4 neighbours got 500), the poisoned request itself never answered."""
    prompts = ["the cat", "a dog ran", "hi there", "one two"]
    want = [greedy(local["llm"], p, 12) for p in prompts]
    results: dict = {}

    def call(key, prompt, temperature):
        with httpx.Client(base_url=server.url, timeout=60) as c:
            results[key] = c.post("/v1/completions", json={"model": "llm", "prompt": prompt, "max_tokens": 12,
                                                            "temperature": temperature, "ignore_eos": True})

    threads = [threading.Thread(target=call, args=(i, p, 0)) for i, p in enumerate(prompts)]
    threads.append(threading.Thread(target=call, args=("tiny", PROMPT, 1e-310)))
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [results[i].status_code for i in range(4)] == [200] * 4
    assert [results[i].json()["choices"][0]["text"] for i in range(4)] == want
    assert results["tiny"].status_code == 200
    assert results["tiny"].json()["choices"][0]["text"] == greedy(local["llm"], PROMPT, 12)


def test_a_row_that_fails_fails_alone_and_is_answered(server, local, monkeypatch):
    """A request whose next token cannot be chosen fails on its own: its client hears a one-line 500, the requests
    decoding in the same steps get their own tokens."""
    from attnx.runtime.core.generate import Generation

    choose = Generation.choose

    def poisoned(self, logits):
        if self.params.seed == 666 and self.tokens:
            raise ValueError("probabilities contain NaN")
        return choose(self, logits)

    monkeypatch.setattr(Generation, "choose", poisoned)
    results: dict = {}

    def call(key, seed):
        with httpx.Client(base_url=server.url, timeout=60) as c:
            results[key] = c.post("/v1/completions", json={"model": "llm", "prompt": PROMPT, "max_tokens": 16,
                                                            "temperature": 0, "seed": seed, "ignore_eos": True})

    threads = [threading.Thread(target=call, args=(k, s)) for k, s in (("a", 1), ("poisoned", 666), ("b", 2))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results["poisoned"].status_code == 500
    assert "could not choose this request's next token" in results["poisoned"].json()["error"]["message"]
    want = greedy(local["llm"], PROMPT, 16, stop=None)
    assert [results[k].status_code for k in "ab"] == [200, 200]
    assert all(results[k].json()["choices"][0]["text"] == want for k in "ab")


def test_what_can_never_fit_is_413_not_a_retryable_429(http):
    """n x prompts beyond the queue (64 here) on an idle server was a 429 with Retry-After: a retry loop."""
    r = http.post("/v1/completions", json={"model": "llm", "prompt": ["a", "b", "c", "d", "e"], "n": 16})
    assert r.status_code == 413 and "retry-after" not in r.headers
    assert r.json()["error"]["param"] == "n" and "queues at most 64" in r.json()["error"]["message"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v2/models/llm/generate"])
def test_a_3mb_prompt_is_refused_without_tokenising_it_all(server, http, path, monkeypatch):
    """A 3 MB prompt was tokenised untruncated on the event loop (29 s without a health answer). The model's 64
    positions hold at most 64 x 64 characters: no more of the prompt reaches the tokenizer."""
    from conftest_runtime import spy_on

    seen = spy_on(server.generators["llm"].tokenizer, monkeypatch)
    text = "the cat sat on the mat " * 140_000
    body = {"model": "llm", "prompt": text, "text_input": text, "messages": [{"role": "user", "content": text}]}
    r = http.post(path, json=body)
    assert r.status_code in (400, 413), r.text[:300]
    message = r.json()["error"]["message"] if path.startswith("/v1") else r.json()["error"]
    assert "\n" not in message and any(w in message for w in ("characters", "positions", "max length")), message
    assert max(seen, default=0) <= 64 * 64
    assert http.get("/v2/health/live").status_code == 200


def test_a_generation_context_with_nan_is_refused(http):
    """One of the two parse_context copies (the generation routes') let NaN through to the model."""
    body = '{"model": "smal", "prompt": "the cat", "max_tokens": 2, "context": {"self_state": [[NaN' + ", 0" * 31 + "]]}}"
    r = http.post("/v1/completions", content=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "context" and "NaN" in r.json()["error"]["message"]


HOSTILE = ("{%- set m = messages[-1]['content'] %}"
           "{%- if m == 'loop' %}{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
           "{%- elif m == 'big' %}{{ 'a' * 10**7 }}"
           "{%- elif m == 'range' %}{% for i in range(10**9) %}{% endfor %}"
           "{%- elif m == 'recurse' %}{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}"
           "{%- else %}{{ bos_token }}{% for x in messages %}<{{ x['role'] }}>{{ x['content'] }}</s>{% endfor %}"
           "<assistant>{%- endif %}")


@pytest.fixture(scope="module")
def hostile(root):
    folder = root / "folders" / "llama-hostile"
    if not (folder / "config.json").is_file():
        shutil.copytree(gf.folder(root, "llama"), folder)
        cfg = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": HOSTILE}))
    with running_server({"h": gf.export(root, folder, "mha")}) as s:
        yield s


def test_a_hostile_chat_template_is_a_one_line_refusal_and_health_keeps_answering(hostile):
    """A folder's template with nested range(100000) loops hung the server for good; 'a' * 10**7 stalled it 61 s
    (2 GB RSS); range(10**9) and recursion were 500s. The template renders in a worker process now."""
    url = hostile.url
    results: dict = {}

    def chat(content):
        results[content] = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "model": "h", "max_tokens": 2, "messages": [{"role": "user", "content": content}]})

    looping = threading.Thread(target=chat, args=("loop",))
    looping.start()
    answered = 0
    while looping.is_alive():  # the server answers its probes while the template spins in its worker
        assert httpx.get(url + "/v2/health/live", timeout=10).status_code == 200
        answered += 1
        time.sleep(0.05)
    looping.join()
    assert answered > 1
    for content in ("big", "range", "recurse"):
        chat(content)
    for content, status, words in (("loop", 400, "did not finish"), ("big", 413, "characters"),
                                   ("range", 400, "Range too big"), ("recurse", 400, "recursed")):
        r = results[content]
        assert r.status_code == status, (content, r.text[:300])
        error = r.json()["error"]
        assert error["param"] == "messages" and words in error["message"] and "\n" not in error["message"]
    chat("hello")
    assert results["hello"].status_code == 200, results["hello"].text[:300]
