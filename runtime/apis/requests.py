"""Every JSON request the server takes, declared once (pydantic): strict types, the documented defaults.

OpenAI's, vLLM's tokenize, TEI's, Cohere/Jina's rerank, Infinity's classify, Triton's generate, and KServe v2's infer
body (:class:`InferBody`, for the OpenAPI document; its tensors are decoded by :mod:`attnx.runtime.apis.kserve_json`).
``"1"`` is not a number, ``1.0`` not an integer, ``NaN`` and ``1e999`` not a float; a field left out takes the
default its API documents. OpenAI's bodies take every field of OpenAI's CreateCompletionRequest and
CreateChatCompletionRequest: each is honoured, or refused with a 400 naming it when given a value attnx cannot
honour; a field outside the schema is ignored and logged once per name (:mod:`~attnx.runtime.apis.tool_requests`);
other APIs' unknown fields are ignored. :func:`parse` validates a body inside the envelope's budgeted read and turns
the first problem into one ProtocolError line naming its field (``param``).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.json_schema import models_json_schema
from pydantic_core import ErrorDetails, PydanticCustomError

from attnx.runtime.apis.tool_requests import (MAX_TOOLS, NAME_PATTERN, ChatRefusals, CompletionRefusals,
                                              FunctionDefinition, FunctionName, NamedToolChoice, OpenAIFields,
                                              ResponseFormat, Tool, legacy_tools)
from attnx.runtime.wire.errors import Kind, ProtocolError
from attnx.runtime.wire.limits import cut_long_strings

MAX_INT = 2**63 - 1


class Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False, frozen=True)
    #: field -> what it must be, said for any problem with it (for unions pydantic would explain member by member)
    musts: ClassVar[dict[str, str]] = {}
    #: fields whose inner problems are named by their whole path (``tools[0].function.name``), not the last key
    paths: ClassVar[frozenset] = frozenset()


def fail(message: str, kind: Kind = Kind.BAD_INPUT):
    raise PydanticCustomError(kind.value, message)


def text(value: Any, where: str, *, empty: bool = False) -> str:
    """A request string: a str, valid UTF-8, and (unless ``empty``) not empty."""
    if not isinstance(value, str):
        fail(f"{where} must be a string, got {type(value).__name__}")
    if not value and not empty:
        fail(f"{where} is an empty string")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        fail(f"{where} is not valid UTF-8 (a lone surrogate at position {e.start})")
    return value


def _ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(type(v) is int for v in value)


def items(value: str | list) -> list:
    """A ``texts_or_ids`` field as one item per input (a string, or one list of token ids, is one input)."""
    return [value] if isinstance(value, str) or _ids(value) else list(value)


def texts_or_ids(param: str):
    """A string, a list of strings, a list of token ids, or a list of such lists (strings and id lists may mix,
    as TEI allows): checked item by item, with the item at fault named."""

    def check(value: Any) -> Any:
        if isinstance(value, str):
            text(value, f"{param}[0]")
            return value
        if not isinstance(value, list):
            fail(f"'{param}' must be a string, a list of strings, a list of token ids or a list of token-id lists, "
                 f"got {type(value).__name__}")
        if not value:
            fail(f"'{param}' is an empty list", Kind.EMPTY)
        for i, item in enumerate([value] if _ids(value) else value):
            if isinstance(item, list):
                if not item:
                    fail(f"{param}[{i}] is an empty list of token ids")
                if not _ids(item):
                    fail(f"{param}[{i}] must be a string or a list of integer token ids")
            elif isinstance(item, str):
                text(item, f"{param}[{i}]")
            else:
                fail(f"{param}[{i}] is {type(item).__name__}, not a string or a list of token ids")
        return value

    return BeforeValidator(check)


def strings(param: str, *, empty: bool = False, objects: bool = False, none: str | None = None):
    """A non-empty list of strings (``objects``: or of ``{"text": ...}``, Cohere's documents; ``none``: what an
    empty list is told)."""

    def check(value: Any) -> Any:
        if not isinstance(value, list):
            fail(f"'{param}' must be a list of strings, got {type(value).__name__}")
        if not value:
            fail(none or f"'{param}' is an empty list", Kind.EMPTY)
        for i, item in enumerate(value):
            if objects and isinstance(item, dict):
                if "text" not in item:
                    fail(f"{param}[{i}] is an object without a 'text' field")
                item = item["text"]
            text(item, f"{param}[{i}]", empty=empty)
        return value

    return BeforeValidator(check)


Model = Annotated[str | None, Field(description="a served model's name; may be left out when one fits")]
Context = Annotated[dict[str, Any] | None, Field(description="attnx: a placed variant's context inputs, "
                                                             "{input name: one row per input}")]
Positive = Annotated[int | None, Field(ge=1, le=MAX_INT)]
Direction = Literal["Right", "Left", "right", "left"]


# --- OpenAI ---------------------------------------------------------------------------------------------

class EmbeddingRequest(Body):
    """``POST /v1/embeddings``."""

    input: Annotated[str | list[int] | list[str | list[int]], texts_or_ids("input")]
    model: Model = None
    encoding_format: Literal["float", "base64"] | None = "float"
    dimensions: int | None = None
    user: str | None = None
    truncate: bool = True
    context: Context = None
    musts: ClassVar = {"dimensions": "must be an integer"}


Penalty = Annotated[float | None, Field(ge=-2, le=2)]
TopLogprobs = Annotated[int | None, Field(ge=0, le=20)]


class Sampling(Body, OpenAIFields):
    """What completions and chat share: the sampling fields OpenAI documents, and attnx's extensions."""

    model: Model = None
    temperature: Annotated[float | None, Field(ge=0, le=100)] = 1.0
    top_p: Annotated[float | None, Field(gt=0, le=1)] = 1.0
    n: Annotated[int, Field(ge=1, le=MAX_INT)] = 1
    stop: str | list[str] | None = None
    seed: Annotated[int | None, Field(ge=0, le=2**64 - 1)] = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    response_format: ResponseFormat | None = None
    user: str | None = None
    top_k: Annotated[int | None, Field(ge=0, le=MAX_INT)] = None
    repetition_penalty: Annotated[float | None, Field(ge=0.01, le=100)] = None
    ignore_eos: bool = False
    prompt_logprobs: TopLogprobs = None  # vLLM's: each prompt token's logprob and this many alternatives
    context: Context = None
    musts: ClassVar = {"stop": "must be a string or a list of strings",
                       "logit_bias": "must be an object {\"token id\": bias in [-100, 100]}"}
    paths: ClassVar = frozenset({"logit_bias"})


class CompletionRequest(Sampling, CompletionRefusals):
    """``POST /v1/completions``."""

    prompt: Annotated[str | list[int] | list[str | list[int]], texts_or_ids("prompt")]
    max_tokens: Annotated[int | None, Field(ge=0, le=MAX_INT)] = 16  # 0: the prompt alone (with 'echo')
    echo: bool = False
    logprobs: TopLogprobs = None  # with 'echo': the prompt's tokens too (attnx.runtime.apis.prompt_logprobs)


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")  # templates may read more keys (tool_calls, name, ...)
    role: str
    content: str | list[dict[str, Any]] | None = None

    @field_validator("content")
    @classmethod
    def _text_parts(cls, value):
        if isinstance(value, list):  # content parts: text only
            parts = [p.get("text") for p in value if p.get("type") == "text"]
            if len(parts) != len(value) or not all(isinstance(t, str) for t in parts):
                fail("only text content parts are supported")
            return "".join(parts)
        return value


class ChatRequest(Sampling, ChatRefusals):
    """``POST /v1/chat/completions``: ``messages`` rendered by the model's chat template."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int | None, Field(ge=1, le=MAX_INT)] = None
    max_completion_tokens: Annotated[int | None, Field(ge=1, le=MAX_INT)] = None
    tools: Annotated[list[Tool] | None, Field(max_length=MAX_TOOLS)] = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # false: at most one call
    functions: Annotated[list[FunctionDefinition] | None, Field(max_length=MAX_TOOLS)] = None  # legacy ``tools``
    function_call: Literal["none", "auto"] | FunctionName | None = None  # legacy ``tool_choice``
    logprobs: bool | None = False
    top_logprobs: TopLogprobs = None
    safety_identifier: str | None = None
    musts: ClassVar = {**Sampling.musts, "tool_choice": "must be \"none\", \"auto\", \"required\" or {\"type\": "
                       "\"function\", \"function\": {\"name\": NAME}}",
                       "function_call": "must be \"none\", \"auto\" or {\"name\": NAME}"}
    paths: ClassVar = frozenset({"response_format", "tools", "tool_choice", "functions", "logit_bias"})

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, value, info):
        tools = info.data.get("tools")
        if value not in (None, "none") and not tools:
            fail("'tool_choice' needs 'tools'")
        if isinstance(value, NamedToolChoice) and value.function.name not in [t.function.name for t in tools]:
            fail(f"'tool_choice' names the function {value.function.name!r}, which is not one of 'tools'")
        return value

    @model_validator(mode="after")
    def _choices(self):
        if self.top_logprobs is not None and not self.logprobs:
            fail("'top_logprobs' needs 'logprobs': true")
        if self.functions is not None or self.function_call is not None:
            if self.tools is not None or self.tool_choice is not None:
                fail("'functions' / 'function_call' (the legacy form) and 'tools' / 'tool_choice' cannot both be "
                     "given")
            for name, value in zip(("tools", "tool_choice"), legacy_tools(self.functions, self.function_call)):
                object.__setattr__(self, name, value)  # answered in the legacy form too (message.function_call)
        return self

    def tool_dicts(self) -> list[dict] | None:  # as templates and grammars read them
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None


# --- TEI ------------------------------------------------------------------------------------------------

class EmbedRequest(Body):
    """TEI's ``POST /embed``."""

    inputs: Annotated[str | list[int] | list[str | list[int]], texts_or_ids("inputs")]
    normalize: bool = True
    truncate: bool | None = None
    truncation_direction: Direction = "Right"
    prompt_name: str | None = None
    dimensions: int | None = None
    model: Model = None
    context: Context = None
    musts: ClassVar = {"dimensions": "must be an integer"}


class HubParameters(Body):
    """The Hugging Face Inference API's text-classification parameters."""

    top_k: Annotated[int | None, Field(ge=1, le=MAX_INT)] = None
    function_to_apply: Literal["sigmoid", "softmax", "none"] | None = None
    musts: ClassVar = {"top_k": "must be a positive integer"}


class PredictRequest(Body):
    """TEI's ``POST /predict``: a string, a pair ``[a, b]`` or a batch ``[[a], [a, b], ...]``; with ``parameters``, the
    Hugging Face Inference API's text classification (a string, ``{"text", "text_pair"}``, or a list of them)."""

    parameters: HubParameters | None = None
    inputs: str | list[str] | list[list[str]] | dict[str, str] | list[dict[str, str] | str]
    raw_scores: bool = False
    truncate: bool | None = None
    truncation_direction: Direction = "Right"
    model: Model = None
    context: Context = None
    musts: ClassVar = {"top_k": "must be a positive integer"}

    @model_validator(mode="before")
    @classmethod
    def _inputs(cls, data):
        if isinstance(data, dict) and "inputs" in data:
            if "parameters" in data and data["parameters"] is None:
                data = {**data, "parameters": {}}  # the Inference API's request, with no parameters given
            predict_items(data["inputs"], hub="parameters" in data)
        return data


_SHAPES = "a string, a pair of strings [string, string] or a batch [[string], [string, string], ...]"


def predict_items(value: Any, hub: bool) -> tuple[list, bool]:
    """TEI's ``inputs``: a list of strings is one input (one string, or a pair of two), a list of lists a batch
    of them. The Inference API's (``hub``): a string, ``{"text", "text_pair"}``, or a list of them."""
    if hub:
        items = value if isinstance(value, list) else [value]
        if not items:
            fail("'inputs' is an empty list", Kind.EMPTY)
        return [_hub_item(item, i) for i, item in enumerate(items)], False
    if isinstance(value, str):
        return [text(value, "'inputs'")], True
    if not isinstance(value, list):
        fail(f"'inputs' must be {_SHAPES}, got {type(value).__name__}")
    if not value:
        fail("'inputs' is an empty list", Kind.EMPTY)
    if not isinstance(value[0], list):
        return [_sequence(value, "'inputs'")], True
    return [_sequence(v, f"inputs[{i}]") for i, v in enumerate(value)], False


def _sequence(value: Any, where: str):
    if not isinstance(value, list) or len(value) not in (1, 2):
        fail(f"{where} must be one string or a pair of two ('inputs' takes {_SHAPES})")
    if len(value) == 1:
        return text(value[0], f"{where}[0]")
    return tuple(text(v, f"{where}[{j}]", empty=True) for j, v in enumerate(value))


def _hub_item(item: Any, i: int):
    if isinstance(item, dict) and "text" in item:
        pair = item.get("text_pair")
        first = text(item["text"], f"inputs[{i}].text", empty=pair is not None)
        return first if pair is None else (first, text(pair, f"inputs[{i}].text_pair", empty=True))
    return text(item, f"inputs[{i}]")


class TeiRerankRequest(Body):
    """TEI's ``POST /rerank``."""

    query: Annotated[str, BeforeValidator(lambda v: text(v, "'query'"))]
    texts: Annotated[list[str], strings("texts", empty=True, none="`texts` cannot be empty")]
    raw_scores: bool = False
    return_text: bool = False
    truncate: bool | None = None
    truncation_direction: Direction = "Right"
    model: Model = None
    context: Context = None


# --- Cohere/Jina rerank, Infinity classify ----------------------------------------------------------------

class RerankRequest(Body):
    """``POST /v1/rerank`` (Cohere's, Jina's): documents are strings or ``{"text": ...}``."""

    query: Annotated[str, BeforeValidator(lambda v: text(v, "'query'"))]
    documents: Annotated[list[str | dict[str, Any]], strings("documents", empty=True, objects=True)]
    model: Model = None
    top_n: Positive = None
    return_documents: bool = False
    raw_scores: bool = False
    truncate: bool = True
    context: Context = None
    musts: ClassVar = {"top_n": "must be a positive integer"}


class ClassifyRequest(Body):
    """Infinity's ``POST /classify``."""

    input: Annotated[str | list[str], strings("input"), BeforeValidator(lambda v: v if isinstance(v, list) else [v])]
    model: Model = None
    raw_scores: bool = False
    truncate: bool = True
    context: Context = None


# --- Triton's generate extension, KServe v2 infer ----------------------------------------------------------

class GenerateRequest(Body):
    """``POST /v2/models/{m}/generate`` (and ``generate_stream``): fields at the top level or under
    ``parameters`` (both appear in the wild; the top level wins). ``temperature`` 0 (the default) is greedy."""

    text_input: Annotated[str | list[str], Field(description="the prompt (a batch of one, as tritonclient sends)")]
    max_tokens: Annotated[int | None, Field(ge=1, le=MAX_INT)] = 16
    temperature: Annotated[float | None, Field(ge=0, le=100)] = 0.0
    top_p: Annotated[float | None, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[int | None, Field(ge=0, le=MAX_INT)] = None
    repetition_penalty: Annotated[float | None, Field(ge=0.01, le=100)] = None
    stop: str | list[str] | None = None
    seed: Annotated[int | None, Field(ge=0, le=2**64 - 1)] = None
    ignore_eos: bool = False
    context: Context = None
    musts: ClassVar = {"stop": "must be a string or a list of strings", "text_input": "must be a string"}

    @model_validator(mode="before")
    @classmethod
    def _flatten(cls, data):
        if not isinstance(data, dict):
            return data
        inner = data.get("parameters") or {}
        if not isinstance(inner, dict):
            fail("'parameters' must be an object")
        merged = {**inner, **{k: v for k, v in data.items() if k != "parameters"}}
        for alias, name in (("stop_words", "stop"), ("random_seed", "seed")):
            if merged.get(name) is None and alias in merged:
                merged[name] = merged[alias]
        return merged


class InferTensor(BaseModel):
    name: str
    datatype: str
    shape: list[int]
    parameters: dict[str, Any] | None = None
    data: list[Any] | None = None


class InferBody(BaseModel):
    """KServe v2's ``POST /v2/models/{m}/infer`` JSON body (binary tensor data may follow it)."""

    id: str | None = None
    parameters: dict[str, Any] | None = None
    inputs: list[InferTensor]
    outputs: list[dict[str, Any]] | None = None


JSON_BODIES = [EmbeddingRequest, CompletionRequest, ChatRequest, EmbedRequest, PredictRequest, TeiRerankRequest,
               RerankRequest, ClassifyRequest, GenerateRequest, InferBody]


def openapi_body(model: type[BaseModel]) -> dict:
    """A route's ``openapi_extra``: its JSON body is ``model`` (read by the envelope, not by FastAPI, so that
    the body limit and the byte budget apply before a byte is parsed)."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def openapi_schemas(more: tuple = ()) -> dict:
    """The JSON schema of every request body (and ``more``, declared beside their routes) and of what they contain,
    for ``components.schemas``."""
    bodies = [*JSON_BODIES, *more]
    _, top = models_json_schema([(m, "validation") for m in bodies], ref_template="#/components/schemas/{model}")
    return top["$defs"]


# --- validation errors as one line -----------------------------------------------------------------------

_PHRASES = {"missing": "is required", "bool_type": "must be a boolean", "int_type": "must be an integer",
            "string_type": "must be a string", "float_type": "must be a number", "finite_number": "must be a number",
            "list_type": "must be a list", "dict_type": "must be an object", "model_type": "must be an object",
            "string_too_short": "is an empty string", "too_short": "is an empty list"}
_BOUNDS = {"greater_than_equal": ">=", "less_than_equal": "<=", "greater_than": ">", "less_than": "<"}


def parse(model: type[Body], body: bytes | str | dict, cap: int | None = None) -> Body:
    """``body`` (JSON text, or what it decoded to) as ``model``, or the first problem as a one-line ProtocolError
    naming its field. ``cap``: strings past it are read as their two ends (:func:`~attnx.runtime.wire.limits.cut_long_strings`)."""
    try:
        if isinstance(body, (bytes, bytearray)):
            return model.model_validate_json(cut_long_strings(body, cap))
        if isinstance(body, str):
            return model.model_validate_json(body)
        return model.model_validate(body)
    except ValidationError as e:
        raise _error(model, e.errors(include_url=False)[0]) from None


def _error(model: type[Body], error: ErrorDetails) -> ProtocolError:
    kind, loc = error["type"], [p for p in error["loc"] if isinstance(p, int) or not _tag(p)]
    if kind in {k.value for k in Kind}:  # our own checks said it in full
        return ProtocolError(Kind(kind), error["msg"], _param(loc))
    if kind == "json_invalid":
        return ProtocolError(Kind.BAD_INPUT, f"the body is not valid JSON ({error['ctx']['error']})")
    if not loc:
        return ProtocolError(Kind.BAD_INPUT, "the body must be a JSON object")
    path = str(loc[0]) + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc[1:])
    whole = len(loc) > 1 and loc[0] in getattr(model, "paths", ())  # tools[0].function.name, quoted
    name = f"'{path}'" if whole else f"'{loc[-1]}'" if all(isinstance(p, str) for p in loc) else path
    musts = getattr(model, "musts", {})
    if kind != "missing" and (str(loc[-1]) in musts or str(loc[0]) in musts):
        phrase = musts.get(str(loc[-1])) or musts[str(loc[0])]
    elif kind in _BOUNDS:
        phrase = f"must be {_BOUNDS[kind]} {next(iter(error['ctx'].values()))}"
    elif kind == "string_pattern_mismatch":
        phrase = "must be 1 to 64 letters, digits, '_' or '-'" if error["ctx"]["pattern"] == NAME_PATTERN else \
            f"must match {error['ctx']['pattern']}"
    elif kind == "too_long":
        phrase = f"must have at most {error['ctx'].get('max_length')} items"
    elif kind == "literal_error":
        phrase = f"must be one of [{error['ctx']['expected'].replace(' or ', ', ')}]"
    elif kind == "value_error":
        return ProtocolError(Kind.BAD_INPUT, str(error["ctx"]["error"]), _param(loc))
    else:
        phrase = _PHRASES.get(kind, error["msg"])
    got = "" if kind in ("missing", "too_short", "string_too_short") else f", got {_short(error.get('input'))}"
    return ProtocolError(Kind.EMPTY if kind == "too_short" else Kind.BAD_INPUT, f"{name} {phrase}{got}", _param(loc))


def _tag(part: str) -> bool:
    """A union member's tag in an error location (``str``, ``list[int]``, ``function-before[...]``)."""
    return part in ("str", "int", "float", "bool", "none") or "[" in part or "-" in part


def _param(loc: list) -> str | None:
    return str(loc[0]) if loc else None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
