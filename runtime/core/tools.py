"""Tool calls (OpenAI's ``tools``): the convention a chat template asks the model to follow, and the calls read
back out of what it generates.

The template renders the tools (:mod:`attnx.runtime.core.chat`); the model then answers in the form that template
taught it, which is one of two in practice (vLLM's ``hermes`` and ``llama3_json`` parsers read the same):

- ``hermes`` (Qwen2.5, Hermes, and any template that shows ``<tool_call>``): ``<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>`` blocks, after optional text;
- ``llama3_json`` (Llama 3.x: ``{"name": function name, "parameters": ...}``): the whole answer is such an object
  (or several joined by ``;``), optionally after ``<|python_tag|>``.

:class:`Calls` reads a streamed answer: text passes until a call may begin, from there it is held and parsed at the
end (text that turns out not to be a call is released then). :func:`forced_grammar` is the grammar of a call to one
of the tools (OpenAI's ``tool_choice`` ``"required"`` or a named function), for constrained decoding.
"""

from __future__ import annotations

import json
import re
import uuid

from attnx.runtime.core.detokenize import longest_stop_prefix

HERMES, LLAMA = "hermes", "llama3_json"
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)
_PYTHON_TAG = "<|python_tag|>"


def convention(template: str) -> str | None:
    """The tool-call form a template's source teaches (None: it shows none that attnx reads)."""
    if "<tool_call>" in template:
        return HERMES
    if '"parameters"' in template or "python_tag" in template:
        return LLAMA
    return None


def parse(form: str, text: str) -> tuple[str | None, list[dict]]:
    """``(the text besides the calls or None, [{"name", "arguments" (a JSON string)}])``; no calls when the text
    holds none that parse (it is then all content)."""
    if form == HERMES:
        start = text.find("<tool_call>")
        bodies = _HERMES_CALL.findall(text[start:]) if start >= 0 else []
        head = text[:start].strip() if start >= 0 else text
    else:
        body = text.strip()
        body = body[len(_PYTHON_TAG):] if body.startswith(_PYTHON_TAG) else body
        bodies, head = (body.split(";") if body.startswith("{") else []), ""
    calls = []
    for body in bodies:
        try:
            call = json.loads(body)
        except ValueError:
            return text, []
        args = call.get("arguments", call.get("parameters")) if isinstance(call, dict) else None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not isinstance(args, (dict, str)):
            return text, []
        args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        calls.append({"name": call["name"], "arguments": args})
    return (head or None) if calls else text, calls


def openai_calls(calls: list[dict]) -> list[dict]:
    """Calls as OpenAI's ``tool_calls`` (ids made here)."""
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": call} for call in calls]


class Calls:
    """One streamed answer: :meth:`feed` returns the text that can go out now, :meth:`finish` the rest and the
    calls."""

    def __init__(self, form: str):
        self.form, self.buffer, self.holding = form, "", False

    def feed(self, text: str) -> str:
        self.buffer += text
        if self.holding:
            return ""
        if self.form == LLAMA:
            start = self.buffer.lstrip()
            if not start or _PYTHON_TAG.startswith(start[:len(_PYTHON_TAG)]) or start.startswith("{"):
                self.holding = bool(start)
                return ""
            out, self.buffer, self.form = self.buffer, "", ""  # prose: no call follows
            return out
        if not self.form:
            out, self.buffer = self.buffer, ""
            return out
        at = self.buffer.find("<tool_call>")
        if at >= 0:
            out, self.buffer, self.holding = self.buffer[:at], self.buffer[at:], True
            return out
        keep = longest_stop_prefix(self.buffer, ("<tool_call>",))
        out, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
        return out

    def finish(self) -> tuple[str, list[dict]]:
        if not self.holding:
            return self.buffer, []
        content, calls = parse(self.form, self.buffer)
        return ("" if calls else content or ""), calls


def forced_grammar(form: str | None, tools: list[dict], name: str | None = None) -> str:
    """The Lark grammar (llguidance's, JSON embedded) of one call to any of ``tools`` (or to ``name``)."""
    from attnx.runtime.core.guided import JSON_OPTIONS, check_schema, lark

    key = "parameters" if form == LLAMA else "arguments"
    options = []
    for tool in tools:
        fn = tool.get("function") or {}
        if name is None or fn.get("name") == name:
            options.append({"type": "object", "properties": {"name": {"const": fn.get("name")},
                                                               key: fn.get("parameters") or {"type": "object"}},
                            "required": ["name", key], "additionalProperties": False})
    check_schema(options, "the tools' parameters")  # their size bounded before anything compiles
    schema = json.dumps({"anyOf": options, "x-guidance": JSON_OPTIONS})
    body = '"<tool_call>\\n" call "\\n</tool_call>"' if form == HERMES else "call"
    return lark(f"start: {body}\ncall: %json {schema}\n")
