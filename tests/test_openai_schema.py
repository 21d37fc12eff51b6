"""Every field of OpenAI's request schemas honoured or refused (issue 46 item 4), vLLM's /tokenize and /detokenize
(item 3) and the serve options of generating models (item 6), through the unmodified ``openai`` client and httpx.

- the field lists of OpenAI's CreateCompletionRequest / CreateChatCompletionRequest are written here and checked
  against the installed ``openai`` package's; each field is either honoured (a behaviour test named here, which
  mentions it) or refused with a one-line 400 naming it; a field outside the schema is ignored and logged once;
- ``logit_bias`` changes greedy output exactly as adding it to transformers' logits does (-100 bans, +100 forces);
- ``functions`` / ``function_call`` (the legacy form) answer ``message.function_call``;
- ``/tokenize`` / ``/detokenize`` give transformers' ids and text; ``/v1/models`` says ``max_model_len``;
- ``--max-new-tokens`` is the default and clamps larger requests; ``--chat-template`` gives a template to a model
  whose files carry none.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import httpx
import jsonschema
import numpy as np
import openai
import pytest
import torch

import generation_fixtures as gf
from conftest_runtime import running_server

import transformers
transformers.logging.set_verbosity_error()

from attnx.runtime import BatcherConfig  # noqa: E402
from attnx.runtime.apis import completions  # noqa: E402

HERE = Path(__file__).parent
PROMPT = "the cat sat on the mat"
MESSAGES = [{"role": "user", "content": "Where is the cat?"}]
TIME = {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
                                           "required": ["zone"], "additionalProperties": False}}
WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}

# OpenAI's API reference (openai-python 3.57's completion_create_params.py and chat/completion_create_params.py,
# CompletionCreateParamsBase plus ``stream``), written out: a field OpenAI adds fails the check below until it is
# honoured or refused here.
COMPLETION_FIELDS = ["best_of", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "model", "n",
                     "presence_penalty", "prompt", "seed", "stop", "stream", "stream_options", "suffix",
                     "temperature", "top_p", "user"]
CHAT_FIELDS = ["audio", "frequency_penalty", "function_call", "functions", "logit_bias", "logprobs",
               "max_completion_tokens", "max_tokens", "messages", "metadata", "modalities", "model", "moderation", "n",
               "parallel_tool_calls", "prediction", "presence_penalty", "prompt_cache_key", "prompt_cache_options",
               "prompt_cache_retention", "reasoning_effort", "response_format", "safety_identifier", "seed",
               "service_tier", "stop", "store", "stream", "stream_options", "temperature", "tool_choice", "tools",
               "top_logprobs", "top_p", "user", "verbosity", "web_search_options"]

FIELDS_TESTS = "test_openai_fields.py"
SERVING_TESTS = "test_generate_serving.py"
THIS = "test_openai_schema.py"
#: Honoured fields -> the test (file, function) whose assertions show the behaviour.
HONOURED = {
    "model": (THIS, "test_models_say_their_max_model_len"),
    "prompt": (SERVING_TESTS, "test_completions_equal_generation_in_process"),
    "messages": (SERVING_TESTS, "test_chat_completions_render_the_chat_template"),
    "echo": (THIS, "test_n_stop_seed_stream_and_usage"),
    "frequency_penalty": (FIELDS_TESTS, "test_presence_and_frequency_penalties_follow_openais_definition"),
    "presence_penalty": (FIELDS_TESTS, "test_presence_and_frequency_penalties_follow_openais_definition"),
    "logit_bias": (THIS, "test_logit_bias_is_added_to_the_logits_as_openai_documents"),
    "logprobs": (FIELDS_TESTS, "test_completion_logprobs_are_transformers_log_softmax"),
    "top_logprobs": (FIELDS_TESTS, "test_chat_logprobs_and_top_logprobs"),
    "max_tokens": (FIELDS_TESTS, "test_max_tokens_past_the_positions_is_a_400"),
    "max_completion_tokens": (FIELDS_TESTS, "test_max_tokens_past_the_positions_is_a_400"),
    "n": (THIS, "test_n_stop_seed_stream_and_usage"),
    "seed": (THIS, "test_n_stop_seed_stream_and_usage"),
    "stop": (THIS, "test_n_stop_seed_stream_and_usage"),
    "stream": (THIS, "test_n_stop_seed_stream_and_usage"),
    "stream_options": (THIS, "test_n_stop_seed_stream_and_usage"),
    "temperature": (SERVING_TESTS, "test_a_subnormal_temperature_is_greedy_and_its_neighbours_are_untouched"),
    "top_p": (THIS, "test_n_stop_seed_stream_and_usage"),
    "user": (THIS, "test_user_and_safety_identifier_are_logged_with_the_request"),
    "safety_identifier": (THIS, "test_user_and_safety_identifier_are_logged_with_the_request"),
    "response_format": (FIELDS_TESTS, "test_response_format_constrains_the_text"),
    "tools": (FIELDS_TESTS, "test_a_forced_tool_call_comes_back_as_tool_calls"),
    "tool_choice": (FIELDS_TESTS, "test_a_forced_tool_call_comes_back_as_tool_calls"),
    "functions": (THIS, "test_legacy_functions_are_tools_answered_as_function_call"),
    "function_call": (THIS, "test_legacy_functions_are_tools_answered_as_function_call"),
    "parallel_tool_calls": (THIS, "test_parallel_tool_calls_false_keeps_one_call"),
}
#: Refused fields -> a value attnx cannot honour (sent: a 400 naming the field) and one meaning "not asked for".
REFUSED = {
    "completions": {"suffix": ("and then", None), "best_of": (3, 1)},
    "chat": {"audio": ({"voice": "alloy", "format": "wav"}, None), "modalities": (["text", "audio"], ["text"]),
             "metadata": ({"k": "v"}, None), "store": (True, False), "moderation": ({"model": "x"}, None),
             "prediction": ({"type": "content", "content": "x"}, None), "prompt_cache_key": ("k", None),
             "prompt_cache_options": ({"mode": "implicit"}, None), "prompt_cache_retention": ("24h", None),
             "reasoning_effort": ("high", None), "service_tier": ("flex", "auto"), "verbosity": ("low", None),
             "web_search_options": ({}, None)},
}


@pytest.fixture(scope="module")
def folders():
    return {"llm": gf.chat_folder(), "long": gf.long_folder()}


@pytest.fixture(scope="module")
def server(folders, tmp_path_factory):
    tooled = gf.tools_export(tmp_path_factory.mktemp("tools"))
    llm = gf.export(folders["llm"], "mha")
    bare = gf.export(folders["long"], "mha")  # its files carry no chat template
    paths = {"llm": llm, "tools": tooled, "capped": llm, "bare": bare}
    with running_server(paths, batching=BatcherConfig(max_batch_size=8, max_queue_size=64)) as s:
        s.generators["capped"].configure(max_new_tokens=5)
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
def hf(folders):
    model = transformers.AutoModelForCausalLM.from_pretrained(folders["llm"], local_files_only=True).eval()
    return model, transformers.AutoTokenizer.from_pretrained(folders["llm"])


def _next_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].double().numpy()


def _greedy(model, prompt: list[int], n: int, bias: dict[int, float] | None = None) -> list[int]:
    """transformers' greedy tokens with ``bias`` added to every step's logits (OpenAI's logit_bias, by hand)."""
    out = []
    for _ in range(n):
        row = _next_logits(model, prompt + out)
        for token, value in (bias or {}).items():
            row[token] += value
        out.append(int(np.argmax(row)))
    return out


def _source_of(file: str, test: str) -> str:
    text = (HERE / file).read_text()
    match = re.search(rf"^def {test}\(.*?(?=^def |^@|\Z)", text, re.S | re.M)
    assert match, f"{file} has no test {test}"
    return match.group(0)


# --- the schema walk --------------------------------------------------------------------------------------

def test_the_field_lists_are_openais():
    from openai.types import completion_create_params as completion
    from openai.types.chat import completion_create_params as chat

    assert sorted(COMPLETION_FIELDS) == sorted({*completion.CompletionCreateParamsBase.__annotations__, "stream"})
    assert sorted(CHAT_FIELDS) == sorted({*chat.CompletionCreateParamsBase.__annotations__, "stream"})


@pytest.mark.parametrize("field", sorted(set(COMPLETION_FIELDS) | set(CHAT_FIELDS)))
def test_every_field_is_honoured_by_a_test_or_refused(field):
    refused = {**REFUSED["completions"], **REFUSED["chat"]}
    assert field in HONOURED or field in refused, f"{field!r}: neither honoured nor refused"
    if field in HONOURED:
        file, test = HONOURED[field]
        assert field in _source_of(file, test), f"{file}::{test} does not exercise {field!r}"


@pytest.mark.parametrize("route,field", [(r, f) for r in ("completions", "chat") for f in REFUSED[r]])
def test_the_schema_walk_refuses_what_it_cannot_honour(http, route, field):
    url = "/v1/completions" if route == "completions" else "/v1/chat/completions"
    base = {"model": "llm", "max_tokens": 1, "temperature": 0,
            **({"prompt": PROMPT} if route == "completions" else {"messages": MESSAGES})}
    bad, fine = REFUSED[route][field]
    r = http.post(url, json={**base, field: bad})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and f"'{field}'" in error["message"] and "\n" not in error["message"]
    ok = http.post(url, json={**base, field: fine})  # the value that asks for nothing attnx lacks
    assert ok.status_code == 200, ok.text


def test_a_field_outside_the_schema_is_ignored_and_logged_once(http, caplog):
    body = {"model": "llm", "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    want = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    with caplog.at_level(logging.WARNING, logger="attnx.serve"):
        for _ in range(3):
            r = http.post("/v1/completions", json={**body, "made_up_field_46": {"x": 1}})
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
    named = [rec for rec in caplog.records if "made_up_field_46" in rec.getMessage()]
    assert len(named) == 1 and "ignored" in named[0].getMessage()


# --- honoured fields ----------------------------------------------------------------------------------------

def test_logit_bias_is_added_to_the_logits_as_openai_documents(client, http, hf):
    model, tok = hf
    prompt, n = tok(PROMPT)["input_ids"], 4
    plain = _greedy(model, prompt, n)

    def served(bias):
        out = client.completions.create(model="llm", prompt=PROMPT, max_tokens=n, temperature=0, logprobs=0,
                                        logit_bias=bias, extra_body={"ignore_eos": True})
        return out.choices[0].logprobs.tokens

    banned = {plain[0]: -100}  # -100: the greedy first token is never chosen
    want = _greedy(model, prompt, n, banned)
    assert want[0] != plain[0] and plain[0] not in want
    assert served({str(k): v for k, v in banned.items()}) == [tok.decode([t]) for t in want]
    forced = {7: 100}  # +100: that token every time
    assert _greedy(model, prompt, n, forced) == [7] * n
    assert served({"7": 100}) == [tok.decode([7])] * n
    small = {plain[0]: -0.5, 11: 1.5}  # a small bias moves the logits by exactly that much
    assert served({str(k): v for k, v in small.items()}) == [tok.decode([t]) for t in _greedy(model, prompt, n, small)]
    chat = client.chat.completions.create(model="llm", messages=MESSAGES, max_tokens=3, temperature=0, logprobs=True,
                                          logit_bias={"9": 100}, extra_body={"ignore_eos": True})
    assert [e.token for e in chat.choices[0].logprobs.content] == [tok.decode([9])] * 3
    vocab = tok.vocab_size if len(tok) == tok.vocab_size else len(tok)
    for bias, says in (({"x": "y"}, "logit_bias"), ({"5": 101}, "[-100, 100]"), ({"-3": 1}, "token ids"),
                       ({str(vocab + 1000): 1}, "vocabulary"), ([5], "logit_bias")):
        r = http.post("/v1/completions", json={"model": "llm", "prompt": PROMPT, "max_tokens": 1, "logit_bias": bias})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text
        assert says in r.json()["error"]["message"]


def test_n_stop_seed_stream_and_usage(client, hf):
    kw = dict(model="llm", prompt=PROMPT, max_tokens=6, temperature=0.9, top_p=0.8, extra_body={"ignore_eos": True})
    a = client.completions.create(n=3, seed=5, **kw)
    b = client.completions.create(n=3, seed=5, **kw)
    assert len(a.choices) == 3 and [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.usage.completion_tokens == 18
    full = client.completions.create(model="llm", prompt=PROMPT, max_tokens=6, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    echoed = client.completions.create(model="llm", prompt=PROMPT, max_tokens=6, temperature=0, echo=True,
                                       extra_body={"ignore_eos": True}).choices[0].text
    assert echoed == hf[1].decode(hf[1](PROMPT)["input_ids"], skip_special_tokens=True) + full
    stop = full[2:4]
    cut = client.completions.create(model="llm", prompt=PROMPT, max_tokens=6, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True}).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full[:full.index(stop)]
    chunks = list(client.completions.create(model="llm", prompt=PROMPT, max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full
    assert chunks[-1].usage.completion_tokens == 6


def test_user_and_safety_identifier_are_logged_with_the_request(client, caplog):
    with caplog.at_level(logging.INFO, logger="attnx.serve"):
        out = client.chat.completions.create(model="llm", messages=MESSAGES, max_tokens=1, user="user-46",
                                             safety_identifier="hash-46")
    lines = [rec.getMessage() for rec in caplog.records if out.id in rec.getMessage()]
    assert any("user" in m and "user-46" in m for m in lines) and any("hash-46" in m for m in lines)


def test_legacy_functions_are_tools_answered_as_function_call(client, http):
    out = client.chat.completions.create(model="tools", messages=MESSAGES, functions=[WEATHER, TIME],
                                         function_call={"name": "get_time"}, max_tokens=60, temperature=0)
    c = out.choices[0]
    assert c.finish_reason == "function_call" and not c.message.tool_calls
    assert c.message.function_call.name == "get_time"
    jsonschema.validate(json.loads(c.message.function_call.arguments), TIME["parameters"])
    chunks = list(client.chat.completions.create(model="tools", messages=MESSAGES, functions=[WEATHER, TIME],
                                                 function_call={"name": "get_time"}, max_tokens=60, temperature=0,
                                                 stream=True))
    calls = [ch.choices[0].delta.function_call for ch in chunks if ch.choices[0].delta.function_call]
    assert [(f.name, f.arguments) for f in calls] == [("get_time", c.message.function_call.arguments)]
    assert chunks[-1].choices[0].finish_reason == "function_call"
    with pytest.raises(openai.BadRequestError, match="does not render 'functions'") as e:
        client.chat.completions.create(model="llm", messages=MESSAGES, functions=[TIME], max_tokens=1)
    assert e.value.body["param"] == "functions"
    none = client.chat.completions.create(model="tools", messages=MESSAGES, functions=[TIME], function_call="none",
                                          max_tokens=4, temperature=0)
    assert none.choices[0].message.function_call is None
    base = {"model": "tools", "messages": MESSAGES, "max_tokens": 1}
    for body, says in (({"functions": [TIME], "tools": [{"type": "function", "function": TIME}]}, "cannot both"),
                       ({"function_call": "auto"}, "needs 'functions'"),
                       ({"functions": [TIME], "function_call": {"name": "nope"}}, "not one of 'functions'"),
                       ({"functions": [{"name": "bad name!"}]}, "functions[0].name")):
        r = http.post("/v1/chat/completions", json={**base, **body})
        assert r.status_code == 400 and says in r.json()["error"]["message"], r.text


def test_parallel_tool_calls_false_keeps_one_call(client):
    two = [{"name": "f", "arguments": "{}"}, {"name": "g", "arguments": "{}"}]
    assert [c["function"]["name"] for c in completions._calls(two, False, False)["tool_calls"]] == ["f", "g"]
    assert [c["function"]["name"] for c in completions._calls(two, False, True)["tool_calls"]] == ["f"]
    out = client.chat.completions.create(model="tools", messages=MESSAGES, max_tokens=60, temperature=0,
                                         tools=[{"type": "function", "function": TIME}], tool_choice="required",
                                         parallel_tool_calls=False)
    assert len(out.choices[0].message.tool_calls) == 1


# --- /tokenize, /detokenize, /v1/models -----------------------------------------------------------------------

def test_tokenize_and_detokenize_give_transformers_ids_and_text(http, hf):
    _, tok = hf
    r = http.post("/tokenize", json={"model": "llm", "prompt": PROMPT}).json()
    want = tok(PROMPT)["input_ids"]
    assert r == {"count": len(want), "max_model_len": 64, "tokens": want, "token_strs": None}
    bare = http.post("/tokenize", json={"model": "llm", "prompt": PROMPT, "add_special_tokens": False,
                                        "return_token_strs": True}).json()
    assert bare["tokens"] == tok(PROMPT, add_special_tokens=False)["input_ids"] != want
    assert bare["token_strs"] == tok.convert_ids_to_tokens(bare["tokens"])
    chat = http.post("/tokenize", json={"model": "llm", "messages": MESSAGES}).json()
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    assert chat["tokens"] == list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    served = http.post("/v1/chat/completions", json={"model": "llm", "messages": MESSAGES, "max_tokens": 1}).json()
    assert served["usage"]["prompt_tokens"] == chat["count"]  # what chat will count
    back = http.post("/detokenize", json={"model": "llm", "tokens": want}).json()
    assert back == {"prompt": tok.decode(want)}
    long = http.post("/tokenize", json={"model": "llm", "prompt": "cat " * 100}).json()
    assert long["count"] > long["max_model_len"]  # counted, not refused: the client budgets with it
    for path, body, param in (("/tokenize", {"model": "llm"}, None), ("/tokenize", {"prompt": 3}, "prompt"),
                              ("/detokenize", {"model": "llm", "tokens": [10 ** 9]}, "tokens"),
                              ("/detokenize", {"model": "llm", "tokens": ["a"]}, "tokens"),
                              ("/tokenize", {"model": "llm", "prompt": "x", "chat_template": "{{ x }}"},
                               "chat_template")):
        r = http.post(path, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, body, r.text)


def test_models_say_their_max_model_len(client, http):
    cards = {m.id: m for m in client.models.list().data}
    assert cards["llm"].model_extra["max_model_len"] == 64 and cards["tools"].model_extra["max_model_len"] == 512
    assert http.get("/v1/models/llm").json()["max_model_len"] == 64


# --- serve options --------------------------------------------------------------------------------------------

def test_max_new_tokens_is_the_default_and_clamps(client, http):
    free = client.chat.completions.create(model="capped", messages=MESSAGES, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert free.usage.completion_tokens == 5 and free.choices[0].finish_reason == "length"
    more = client.completions.create(model="capped", prompt=PROMPT, max_tokens=20, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert more.usage.completion_tokens == 5
    fewer = client.completions.create(model="capped", prompt=PROMPT, max_tokens=3, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert fewer.usage.completion_tokens == 3
    uncapped = client.completions.create(model="llm", prompt=PROMPT, max_tokens=20, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert uncapped.usage.completion_tokens == 20 and more.choices[0].text == uncapped.choices[0].text[:len(
        more.choices[0].text)]
    triton = http.post("/v2/models/capped/generate", json={"text_input": PROMPT, "max_tokens": 20,
                                                           "ignore_eos": True}).json()
    assert triton["completion_tokens"] == 5


def test_chat_template_option_gives_a_template_to_a_model_without_one(server, client, tmp_path):
    from attnx.cli._common import UserError
    from attnx.cli.serve_cmd import _chat_template_files, _configure_generators

    with pytest.raises(openai.BadRequestError, match="no chat template"):
        client.chat.completions.create(model="bare", messages=MESSAGES, max_tokens=1)
    file = tmp_path / "t.jinja"
    file.write_text("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                    "[assistant]")
    files = {name: Path(m.session.path) for name, m in server.models.items()}
    with pytest.raises(UserError, match="no such file"):
        _chat_template_files([f"bare={tmp_path / 'missing.jinja'}"], files)
    (tmp_path / "broken.jinja").write_text("{% for %}")
    with pytest.raises(UserError, match="does not compile"):
        _configure_generators(server, _chat_template_files([f"bare={tmp_path / 'broken.jinja'}"], files))
    _configure_generators(server, _chat_template_files([f"bare={file}"], files))
    out = client.chat.completions.create(model="bare", messages=MESSAGES, max_tokens=2, temperature=0)
    tokens = httpx.post(f"{server.url}/tokenize", json={"model": "bare", "messages": MESSAGES}).json()
    assert out.usage.prompt_tokens == tokens["count"]
    bos = server.generators["bare"].tokenizer
    text = httpx.post(f"{server.url}/detokenize", json={"model": "bare", "tokens": tokens["tokens"]}).json()["prompt"]
    assert text.endswith("[user] Where is the cat?\n[assistant]") and bos is not None


@pytest.mark.parametrize("args,words", [(["--max-new-tokens", "0"], ["--max-new-tokens", ">= 1"]),
                                        (["--chat-template", "missing.jinja"], ["--chat-template", "no such file"])])
def test_the_serve_options_refuse_bad_values_in_one_line_before_loading(folders, tmp_path, args, words):
    from support.cli import one_line_error
    from support.cli import run as attnx

    one_line_error(attnx("serve", str(gf.export(folders["llm"], "mha")), *args, cwd=tmp_path), *words)
