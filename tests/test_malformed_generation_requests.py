"""Hostile and malformed generation requests on `attnx serve` (issue 45, items 2, 4, 5), over the unmodified HTTP path.

- a table of malformed ``tools``, ``tool_choice`` and ``response_format`` values: each a 400 (never a 500) with one
  line naming the field; schemas that match nothing, recurse forever, or pass a size limit are 400s too;
- a grammar compiles off the event loop (health answers while a compile is held);
- a request whose grammar mask runs past its budget fails alone (400) while a greedy neighbour's tokens are those it
  gets alone; the ``x{1000000}`` pattern is refused with a 400 while a neighbour completes;
- each model renders its chat template in its own pool: a template that loops on one model never delays another's.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time

import httpx
import numpy as np
import pytest

import generation_fixtures as gf
from conftest_runtime import running_server
from support import exports

from attnx.runtime import BatcherConfig

MESSAGES = [{"role": "user", "content": "Where is the cat?"}]
LOOPING_TEMPLATE = ("{% for a in range(99999) %}{% for b in range(99999) %}{% endfor %}{% endfor %}"
                    "{% for m in messages %}{{ m['content'] }}{% endfor %}")
F = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {
    "zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    long = gf.long_folder()
    tooled = gf.tools_export(tmp_path_factory.mktemp("tools"))
    looping = exports.linked_copy(gf.export(long, "mha"), tmp_path_factory.mktemp("looping"))
    (looping.parent / "model.tokenizer" / "chat_template.jinja").write_text(LOOPING_TEMPLATE)
    paths = {"llm": gf.export(gf.chat_folder(), "mha"), "tools": tooled, "looping": looping}
    with running_server(paths, batching=BatcherConfig(max_batch_size=8, max_queue_size=64)) as s:
        yield s


def _schema(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}


def _nested(depth: int) -> dict:
    schema = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


MANY = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(10_000)},
        "required": [f"p{i}" for i in range(10_000)]}
#: (field, value, a word the one-line message must hold); ``tool_choice`` rows come with ``tools: [F]``
MALFORMED = [
    ("tools", "f", "'tools' must be a list"),
    ("tools", {"type": "function"}, "'tools' must be a list"),
    ("tools", [{}], "'tools[0].type' is required"),
    ("tools", [{"type": "function"}], "'tools[0].function' is required"),
    ("tools", [{"type": "function", "function": "f"}], "'tools[0].function' must be an object"),
    ("tools", [{"type": "function", "function": {}}], "'tools[0].function.name' is required"),
    ("tools", [{"type": "function", "function": {"name": ""}}], "'tools[0].function.name' must be 1 to 64"),
    ("tools", [{"type": "function", "function": {"name": "get time"}}], "'tools[0].function.name' must be"),
    ("tools", [{"type": "function", "function": {"name": 7}}], "'tools[0].function.name' must be a string"),
    ("tools", [{"type": "retrieval", "function": {"name": "f"}}], "'tools[0].type' must be one of ['function']"),
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": "x"}}],
     "'tools[0].function.parameters' must be an object"),
    ("tools", [{"type": "function", "function": {"name": "f", "description": 3}}],
     "'tools[0].function.description' must be a string"),
    ("tools", [{"type": "function", "function": {"name": "f", "strict": "yes"}}],
     "'tools[0].function.strict' must be a boolean"),
    ("tools", [F, "f"], "'tools[1]' must be an object"),
    ("tools", [F] * 129, "'tools' must have at most 128 items"),
    ("tool_choice", {}, "'tool_choice' must be \"none\""),
    ("tool_choice", "any", "'tool_choice' must be \"none\""),
    ("tool_choice", 1, "'tool_choice' must be \"none\""),
    ("tool_choice", {"type": "function"}, "'tool_choice' must be \"none\""),
    ("tool_choice", {"type": "function", "function": "get_time"}, "'tool_choice' must be \"none\""),
    ("tool_choice", {"type": "function", "function": {}}, "'tool_choice' must be \"none\""),
    ("tool_choice", {"type": "function", "function": {"name": "get_weather"}}, "'tool_choice' names the function"),
    ("response_format", "json", "'response_format' must be an object"),
    ("response_format", {}, "'response_format.type' is required"),
    ("response_format", {"type": "xml"}, "'response_format.type' must be one of"),
    ("response_format", {"type": "json_schema"}, "'response_format.json_schema' is required"),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x"}},
     "'response_format.json_schema.schema' is required"),
    ("response_format", {"type": "json_schema", "json_schema": {"schema": "{}"}},
     "'response_format.json_schema.schema' must be an object"),
    ("response_format", {"type": "json_schema", "json_schema": 5}, "'response_format.json_schema' must be an object"),
    # schemas that pass the request model and are refused where they compile
    ("response_format", _schema({"type": "strin"}), "'response_format': it cannot be compiled"),
    ("response_format", _schema({"allOf": [{"type": "string"}, {"type": "integer"}]}), "'response_format'"),
    ("response_format", _schema({"enum": []}), "'response_format'"),
    ("response_format", _schema({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}), "matches no text"),
    ("response_format", _schema({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}),
     "'response_format': it cannot be followed"),
    ("response_format", _schema({"type": "string", "pattern": "^x{1000000}$"}),
     "'response_format': it cannot be followed"),
    ("response_format", _schema(MANY), "more than 2000 properties (the limit)"),
    ("response_format", _schema({"enum": [f"value{i}" for i in range(5_000)]}), "enum and const values (the limit)"),
    ("response_format", _schema(_nested(40)), "nests deeper than 32 levels (the limit)"),
    ("response_format", _schema({"description": "x" * (300 << 10)}), "larger than 256 KiB (the limit)"),
]


@pytest.mark.parametrize("field,value,said", MALFORMED, ids=[f"{i}-{row[0]}" for i, row in enumerate(MALFORMED)])
def test_malformed_tools_tool_choice_and_response_format_are_one_line_400s(server, field, value, said):
    body = {"model": "tools", "messages": MESSAGES, "max_tokens": 8, field: value}
    if field == "tool_choice":
        body["tools"] = [F]
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert said in error["message"] and "\n" not in error["message"] and "non-verbose" not in error["message"]
    assert error["param"] in (field, None) and field in error["message"]


def test_a_forced_tool_call_whose_parameters_cannot_compile_is_a_400(server):
    broken = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "strin"}}}}}
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "tools", "messages": MESSAGES, "max_tokens": 8,
                                                              "tools": [broken], "tool_choice": "required"}, timeout=60)
    assert r.status_code == 400 and "'tools'" in r.json()["error"]["message"], r.text[:300]
    big = {"type": "function", "function": {"name": "g", "parameters": MANY}}
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "tools", "messages": MESSAGES, "max_tokens": 8,
                                                              "tools": [big], "tool_choice": "required"}, timeout=60)
    assert r.status_code == 400 and "more than 2000 properties" in r.json()["error"]["message"], r.text[:300]


def test_a_grammar_compiles_off_the_event_loop(server, monkeypatch):
    """A compile held in the model's grammar thread: health and a plain completion answer meanwhile."""
    grammars = server.models["llm"].grammars
    entered, release, compile_ = threading.Event(), threading.Event(), grammars.compile

    def held(grammar):
        entered.set()
        release.wait(60)
        return compile_(grammar)

    monkeypatch.setattr(grammars, "compile", held)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        guided = pool.submit(httpx.post, f"{server.url}/v1/chat/completions", timeout=120,
                             json={"model": "llm", "messages": MESSAGES, "max_tokens": 12, "temperature": 0,
                                   "response_format": _schema(schema)})
        assert entered.wait(60)
        assert httpx.get(f"{server.url}/v2/health/live", timeout=30).status_code == 200
        plain = httpx.post(f"{server.url}/v1/completions", json={"model": "llm", "prompt": "the cat", "max_tokens": 3},
                           timeout=60)
        assert plain.status_code == 200 and not guided.done()  # answered while the compile is still held
        release.set()
        r = guided.result()
    assert r.status_code == 200, r.text[:300]
    assert isinstance(json.loads(r.json()["choices"][0]["message"]["content"])["n"], int)


def _greedy(server, prompt: str, n: int = 12) -> list[str]:
    r = httpx.post(f"{server.url}/v1/completions", timeout=120,
                   json={"model": "llm", "prompt": prompt, "max_tokens": n, "temperature": 0, "logprobs": 0,
                         "ignore_eos": True})
    assert r.status_code == 200, r.text[:300]
    return r.json()["choices"][0]["logprobs"]["tokens"]


def test_a_mask_past_its_budget_fails_its_own_request_and_the_neighbour_goes_on(server, monkeypatch):
    from attnx.runtime.core import guided

    alone = _greedy(server, "the cat sat")
    held, compute = threading.Event(), guided.Guide._compute

    def slow(self):  # a mask that does not come within the budget (released when the test ends)
        held.wait(60)
        return compute(self)

    monkeypatch.setattr(guided, "MASK_TIME_BUDGET_S", 0.2)
    monkeypatch.setattr(guided.Guide, "_compute", slow)
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            hostile = pool.submit(httpx.post, f"{server.url}/v1/completions", timeout=120,
                                  json={"model": "llm", "prompt": "the dog", "max_tokens": 20, "n": 4,
                                        "response_format": {"type": "json_object"}})
            neighbour = pool.submit(_greedy, server, "the cat sat")
            r = hostile.result()
            assert neighbour.result() == alone
    finally:
        held.set()
    assert r.status_code == 400, r.text[:300]
    message = r.json()["error"]["message"]
    assert "mask took longer than 0.2 s" in message and "\n" not in message
    assert _greedy(server, "the cat sat") == alone  # the model goes on


def test_the_x_million_pattern_is_a_400_while_a_neighbour_completes(server):
    alone = _greedy(server, "the cat sat")
    pattern = {"model": "llm", "messages": MESSAGES, "max_tokens": 8,
               "response_format": _schema({"type": "string", "pattern": "^x{1000000}$"})}
    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        hostile = [pool.submit(httpx.post, f"{server.url}/v1/chat/completions", json=pattern, timeout=120)
                   for _ in range(4)]
        neighbour = pool.submit(_greedy, server, "the cat sat")
        assert neighbour.result() == alone
        for r in (h.result() for h in hostile):
            assert r.status_code == 400 and "\n" not in r.json()["error"]["message"], r.text[:300]


def test_a_grammar_error_mid_generation_is_one_line_without_llguidances_state(server):
    """A branch of the schema the lexer cannot build is reached only after a few tokens: the mask is then a
    GrammarError of one line (the scheduler answers it as that request's 400)."""
    from attnx.runtime.core.guided import GrammarError, json_schema

    grammars = server.models["llm"].grammars
    guide = grammars.compile(json_schema({"type": "object", "properties": {
        "a": {"type": "string", "pattern": "^x{1000000}$"}, "b": {"type": "integer"}}}))
    tokenizer = grammars._llg_tokenizer()
    assert guide.allowed().any()
    with pytest.raises(GrammarError) as e:
        for token in tokenizer.tokenize_str('{"a":"xx'):
            guide.accept(token)
            guide.allowed()
    assert "\n" not in str(e.value) and "non-verbose" not in str(e.value) and len(str(e.value)) < 300


def test_each_model_renders_its_template_in_its_own_pool(server):
    """Two chats on a model whose template loops hold both of its workers; a chat to another model is answered
    before either of them is refused (one shared pool made it wait for the looping ones)."""
    server.chat.time_budget_s = 6.0
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            looping = [pool.submit(httpx.post, f"{server.url}/v1/chat/completions", timeout=120,
                                   json={"model": "looping", "messages": MESSAGES, "max_tokens": 2})
                       for _ in range(2)]
            time.sleep(0.5)  # both are rendering
            benign = httpx.post(f"{server.url}/v1/chat/completions", timeout=120,
                                json={"model": "llm", "messages": MESSAGES, "max_tokens": 4, "temperature": 0})
            pending = sum(not f.done() for f in looping)
            refused = [f.result() for f in looping]
    finally:
        server.chat.time_budget_s = 2.0
    assert benign.status_code == 200 and pending == 2
    for r in refused:
        assert r.status_code == 400 and "did not finish within 6 s" in r.json()["error"]["message"], r.text[:300]
    np.testing.assert_equal(len(benign.json()["choices"]), 1)
