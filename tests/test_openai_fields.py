"""OpenAI's generation fields on `attnx serve` (issue 34 item 4), through the unmodified ``openai`` client.

- ``logprobs`` / ``top_logprobs`` (completions' columns and chat's ``content`` list, streamed too) equal
  transformers' own log-softmax of the same logits (the model's distribution, before penalties: vLLM's default);
- ``presence_penalty`` / ``frequency_penalty`` give the greedy tokens of OpenAI's definition applied by hand to
  transformers' logits;
- ``response_format`` ``json_object`` / ``json_schema`` constrain the text (llguidance): it parses, and follows
  the schema;
- ``tools``: a template in the ``<tool_call>`` form, ``tool_choice`` "required" / a named function give OpenAI's
  ``tool_calls`` (arguments following the tool's parameters, ``finish_reason`` "tool_calls"); a template that
  renders no tools is a 400 naming ``tools``; the two forms are read back from text as vLLM's parsers read them;
- ``max_tokens`` past the positions is a one-line 400; LangChain's ``ChatOpenAI(logprobs=True)`` gets logprobs.
"""

from __future__ import annotations

import json

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
from attnx.runtime.core import tools  # noqa: E402

PROMPT = "the cat sat on the mat"
MESSAGES = [{"role": "user", "content": "Where is the cat?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "additionalProperties": False,
                                                           "properties": {"city": {"type": "string", "maxLength": 6}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
    "additionalProperties": False}}}


@pytest.fixture(scope="module")
def folders():
    return {"llm": gf.chat_folder(), "long": gf.long_folder()}


@pytest.fixture(scope="module")
def server(folders, tmp_path_factory):
    tooled = gf.tools_export(tmp_path_factory.mktemp("tools"))
    paths = {"llm": gf.export(folders["llm"], "mha"), "tools": tooled}
    with running_server(paths, batching=BatcherConfig(max_batch_size=8, max_queue_size=64)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def hf(folders):
    model = transformers.AutoModelForCausalLM.from_pretrained(folders["llm"], local_files_only=True).eval()
    return model, transformers.AutoTokenizer.from_pretrained(folders["llm"])


def _logits(model, ids: list[int]) -> np.ndarray:
    """transformers' logits at every position of ``ids`` (float64)."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].double().numpy()


def _log_softmax(x: np.ndarray) -> np.ndarray:
    return torch.log_softmax(torch.from_numpy(x), -1).numpy()


def test_completion_logprobs_are_transformers_log_softmax(client, hf):
    model, tok = hf
    out = client.completions.create(model="llm", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    choice = out.choices[0]
    lp = choice.logprobs
    prompt = tok(PROMPT)["input_ids"]
    n = len(lp.tokens)
    assert n == out.usage.completion_tokens and n > 0
    # the tokens chosen: the argmax of each row; their log-probabilities: transformers' log-softmax there
    ids, rows = [], []
    for _ in range(n):
        rows.append(_logits(model, prompt + ids)[-1])
        ids.append(int(np.argmax(rows[-1])))
    want = _log_softmax(np.stack(rows))
    np.testing.assert_allclose(lp.token_logprobs, [want[i, t] for i, t in enumerate(ids)], atol=2e-4)
    assert lp.tokens == [tok.decode([t]) for t in ids]
    for i, top in enumerate(lp.top_logprobs):
        best = np.argsort(-want[i])[:3]
        assert set(top) == {tok.decode([t]) for t in best} | {lp.tokens[i]}
        for t in best:
            assert abs(top[tok.decode([t])] - want[i, t]) < 2e-4
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n)]
    # streamed: the same entries, one chunk per token
    chunks = list(client.completions.create(model="llm", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3,
                                            stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.token_logprobs]
    np.testing.assert_allclose(streamed, lp.token_logprobs, atol=1e-6)


def test_chat_logprobs_and_top_logprobs(client, hf):
    model, tok = hf
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    out = client.chat.completions.create(model="llm", messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True,
                                         top_logprobs=2)
    content = out.choices[0].logprobs.content
    want = _log_softmax(_logits(model, ids)[-1])
    assert abs(content[0].logprob - want.max()) < 2e-4 and content[0].token == tok.decode([int(want.argmax())])
    assert [t.token for t in content[0].top_logprobs] == [tok.decode([int(t)]) for t in np.argsort(-want)[:2]]
    assert content[0].bytes == list(content[0].token.encode())
    chunks = list(client.chat.completions.create(model="llm", messages=MESSAGES, max_tokens=5, temperature=0,
                                                 logprobs=True, top_logprobs=2, stream=True))
    streamed = [e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    plain = client.chat.completions.create(model="llm", messages=MESSAGES, max_tokens=5, temperature=0)
    assert plain.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model="llm", messages=MESSAGES, max_tokens=2, top_logprobs=2)


def test_presence_and_frequency_penalties_follow_openais_definition(client, hf):
    model, tok = hf
    prompt = tok(PROMPT)["input_ids"]
    presence, frequency, n = 0.7, 1.3, 12

    def by_hand(p, f):
        out = []
        for _ in range(n):
            row = _logits(model, prompt + out)[-1]
            ids, counts = np.unique(out, return_counts=True) if out else ([], [])
            for t, c in zip(ids, counts):
                row[t] -= p + f * c
            out.append(int(np.argmax(row)))
        return out

    want = by_hand(presence, frequency)
    assert want != by_hand(0.0, 0.0)  # the penalties change this generation
    got = client.completions.create(model="llm", prompt=PROMPT, max_tokens=n, temperature=0, logprobs=0,
                                    presence_penalty=presence, frequency_penalty=frequency,
                                    extra_body={"ignore_eos": True})
    assert got.choices[0].logprobs.tokens == [tok.decode([t]) for t in want]
    # the logprobs stay the model's own: those of the tokens chosen under the penalties
    raw = _log_softmax(_logits(model, prompt + want)[len(prompt) - 1:-1])
    np.testing.assert_allclose(got.choices[0].logprobs.token_logprobs, [raw[i, t] for i, t in enumerate(want)],
                               atol=2e-4)


def test_response_format_constrains_the_text(client):
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "n": {"type": "integer",
                                                                                          "maximum": 99}},
              "required": ["answer", "n"], "additionalProperties": False}
    out = client.chat.completions.create(model="llm", messages=MESSAGES, max_tokens=40, temperature=0,
                                         response_format={"type": "json_schema",
                                                          "json_schema": {"name": "a", "schema": schema}})
    jsonschema.validate(json.loads(out.choices[0].message.content), schema)
    assert out.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model="llm", prompt=PROMPT, max_tokens=40, temperature=0.9, seed=3,
                                            stream=True, extra_body={"response_format": {"type": "json_schema",
                                                                     "json_schema": {"schema": schema}}}))
    jsonschema.validate(json.loads("".join(c.choices[0].text for c in chunks if c.choices)), schema)
    obj = client.chat.completions.create(model="tools", messages=MESSAGES, max_tokens=200, temperature=0,
                                         response_format={"type": "json_object"})
    assert obj.choices[0].finish_reason == "stop", obj.choices[0].message.content
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client.chat.completions.create(model="llm", messages=MESSAGES, max_tokens=4,
                                       response_format={"type": "json_schema", "json_schema": {"name": "x"}})


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_a_forced_tool_call_comes_back_as_tool_calls(client, choice):
    out = client.chat.completions.create(model="tools", messages=MESSAGES, tools=[WEATHER, TIME], tool_choice=choice,
                                         max_tokens=60, temperature=0)
    c = out.choices[0]
    assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1, c.message
    call = c.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
    if isinstance(choice, dict):
        assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    chunks = list(client.chat.completions.create(model="tools", messages=MESSAGES, tools=[WEATHER, TIME],
                                                 tool_choice=choice, max_tokens=60, temperature=0, stream=True))
    deltas = [t for ch in chunks for t in ch.choices[0].delta.tool_calls or ()]
    assert [(d.function.name, d.function.arguments) for d in deltas] == [(call.function.name, call.function.arguments)]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == (c.message.content or "")


def test_tools_a_template_cannot_render_are_refused(client):
    with pytest.raises(openai.BadRequestError, match="does not render 'tools'") as e:
        client.chat.completions.create(model="llm", messages=MESSAGES, tools=[WEATHER], max_tokens=4)
    assert e.value.body["param"] == "tools"
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        client.chat.completions.create(model="tools", messages=MESSAGES, tool_choice="required", max_tokens=4)
    # auto: the model chose prose here (random weights); the text is its content, no calls
    auto = client.chat.completions.create(model="tools", messages=MESSAGES, tools=[WEATHER], max_tokens=8,
                                          temperature=0)
    assert auto.choices[0].finish_reason in ("stop", "length") and not auto.choices[0].message.tool_calls


@pytest.mark.parametrize("form,text,content,calls", [
    (tools.HERMES, 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>', "Sure.",
     [("f", {"a": 1})]),
    (tools.HERMES, '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g", "arguments": '
                   '{"b": "é"}}</tool_call>', None, [("f", {}), ("g", {"b": "é"})]),
    (tools.HERMES, "<tool_call>{not json</tool_call>", "<tool_call>{not json</tool_call>", []),
    (tools.LLAMA, '<|python_tag|>{"name": "f", "parameters": {"x": [1, 2]}}', None, [("f", {"x": [1, 2]})]),
    (tools.LLAMA, '{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"y": 1}}', None,
     [("f", {}), ("g", {"y": 1})]),
    (tools.LLAMA, "The weather is fine.", "The weather is fine.", []),
])
def test_tool_calls_are_read_back_as_vllms_parsers_read_them(form, text, content, calls):
    got_content, got = tools.parse(form, text)
    assert got_content == content and [(c["name"], json.loads(c["arguments"])) for c in got] == calls
    reader = tools.Calls(form)  # streamed in single characters: the same answer, no call text leaked
    streamed = "".join(reader.feed(ch) for ch in text)
    rest, streamed_calls = reader.finish()
    assert streamed_calls == got
    assert (streamed + rest).strip() == (content or "") if got else streamed + rest == text


def test_max_tokens_past_the_positions_is_a_400(server, client):
    with pytest.raises(openai.BadRequestError, match="positions") as e:
        client.completions.create(model="llm", prompt=PROMPT, max_tokens=100000)
    assert e.value.body["param"] == "max_tokens" and "\n" not in e.value.body["message"]
    with pytest.raises(openai.BadRequestError, match="max_completion_tokens"):
        client.chat.completions.create(model="llm", messages=MESSAGES, max_completion_tokens=100000)
    triton = httpx.post(f"{server.url}/v2/models/llm/generate", json={"text_input": PROMPT, "max_tokens": 60})
    assert triton.status_code == 400 and "ask for at most" in triton.json()["error"]
    # chat without max_tokens runs to the end of sequence or, here, the positions (OpenAI's chat has no 16)
    out = client.chat.completions.create(model="llm", messages=MESSAGES, temperature=0, extra_body={"ignore_eos": True})
    assert out.usage.prompt_tokens + out.usage.completion_tokens == 64 and out.choices[0].finish_reason == "length"


def test_langchain_chat_openai_gets_logprobs(server, client):
    import langchain_openai

    llm = langchain_openai.ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model="llm", temperature=0,
                                      max_tokens=4, logprobs=True)
    msg = llm.invoke("Where is the cat?")
    want = client.chat.completions.create(model="llm", messages=MESSAGES, temperature=0, max_tokens=4, logprobs=True)
    assert [e["token"] for e in msg.response_metadata["logprobs"]["content"]] == \
        [e.token for e in want.choices[0].logprobs.content]
