"""OpenAI's nested parts of a generation request, typed as OpenAI declares them: ``response_format``, ``tools``,
``tool_choice``, the legacy ``functions`` / ``function_call`` (used by
:class:`~attnx.runtime.apis.requests.ChatRequest`, whose error mapping names a problem by its whole path,
``tools[0].function.name``); and the rules of OpenAI's top-level fields: those attnx cannot honour, refused with a
400 naming them when asked for (:data:`REFUSED`), ``logit_bias`` (``{"token id": bias in [-100, 100]}``), and fields
outside the schema: ignored and logged once per name per process (:func:`log_unknown`), as vLLM ignores and logs
them (OpenAI refuses them; clients that send extensions to any server would break)."""

from __future__ import annotations

import logging
import threading
from typing import Annotated, Any, Literal, NoReturn

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from attnx.runtime.wire.errors import Kind

log = logging.getLogger("attnx.serve")
NAME_PATTERN, MAX_TOOLS = r"^[a-zA-Z0-9_-]{1,64}$", 128  # a function's name and the tools, as OpenAI takes them


class Part(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False, frozen=True)


class JsonSchemaFormat(Part):
    """``response_format.json_schema`` (``schema``'s size is bounded where it compiles: guided.check_schema)."""

    name: Annotated[str | None, Field(pattern=NAME_PATTERN)] = None
    description: str | None = None
    schema_: Annotated[dict[str, Any], Field(alias="schema")]
    strict: bool | None = None


class ResponseFormat(Part):
    """OpenAI's ``response_format``: ``text``, ``json_object`` or ``json_schema`` (with ``json_schema``)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise PydanticCustomError(Kind.BAD_INPUT.value, "'response_format.json_schema' is required with type "
                                      "\"json_schema\" ({\"name\", \"schema\"})")
        return self


class FunctionDefinition(Part):
    """A tool's ``function``: OpenAI's ``{"name", "description", "parameters" (a JSON schema object), "strict"}``."""

    name: Annotated[str, Field(pattern=NAME_PATTERN)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Part):
    """One of ``tools``: ``{"type": "function", "function": {...}}``."""

    type: Literal["function"]
    function: FunctionDefinition


class NamedToolChoice(Tool):
    """``tool_choice`` naming a function: ``{"type": "function", "function": {"name": NAME}}``."""


class FunctionName(Part):
    """The legacy ``function_call`` naming a function: ``{"name": NAME}``."""

    name: Annotated[str, Field(pattern=NAME_PATTERN)]


def legacy_tools(functions: list[FunctionDefinition] | None, function_call) -> tuple[list[Tool], Any]:
    """``functions`` / ``function_call`` (OpenAI's legacy form) as the ``tools`` / ``tool_choice`` they stand for."""
    if not functions:
        _fail("'function_call' needs 'functions'" if function_call is not None else "'functions' is an empty list")
    choice = function_call
    if isinstance(choice, FunctionName):
        if choice.name not in [f.name for f in functions]:
            _fail(f"'function_call' names the function {choice.name!r}, which is not one of 'functions'")
        choice = NamedToolChoice(type="function", function=FunctionDefinition(name=choice.name))
    return [Tool(type="function", function=f) for f in functions], choice


# --- the rules of OpenAI's top-level fields (requests.Sampling and its kinds) ------------------------------

def _fail(message: str) -> NoReturn:
    raise PydanticCustomError(Kind.BAD_INPUT.value, message)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


#: OpenAI's documented fields attnx cannot honour: field -> (the values that mean "not asked for", why not).
REFUSED: dict[str, tuple[tuple, str]] = {
    "suffix": ((None,), "attnx does not complete between a prompt and a suffix (fill-in-the-middle)"),
    "best_of": ((None, 1), "attnx returns the 'n' completions it makes, none chosen among more"),
    "audio": ((None,), "attnx generates text only"),
    "modalities": ((None, ["text"]), "attnx generates text only ([\"text\"])"),
    "store": ((None, False), "attnx stores no completions"),
    "metadata": ((None, {}), "it is kept with stored completions, and attnx stores none"),
    "moderation": ((None,), "attnx runs no moderation"),
    "prediction": ((None,), "attnx has no predicted outputs"),
    "prompt_cache_key": ((None,), "attnx keeps no prompt cache"),
    "prompt_cache_retention": ((None,), "attnx keeps no prompt cache"),
    "prompt_cache_options": ((None,), "attnx keeps no prompt cache"),
    "reasoning_effort": ((None,), "attnx's models have no reasoning-effort control"),
    "verbosity": ((None,), "attnx's models have no verbosity control"),
    "web_search_options": ((None,), "attnx does not search the web"),
    "service_tier": ((None, "auto", "default"), "attnx has one tier (\"auto\" / \"default\")"),
}


def refuse(value: Any, field: str) -> Any:
    allowed, why = REFUSED[field]
    if any(value == a and type(value) is type(a) for a in allowed):
        return value
    _fail(f"'{field}' is not supported: {why}; got {_short(value)}")


_unknown_logged: set[tuple[str, str]] = set()
_unknown_lock = threading.Lock()
MAX_UNKNOWN_LOGGED = 256  # distinct names logged per process: a client inventing names cannot fill the log


def log_unknown(body: str, data: Any, known) -> None:
    """Fields outside ``body``'s schema: ignored, each name logged once per process (vLLM logs and ignores them)."""
    if not isinstance(data, dict):
        return
    for key in data:
        if key in known or (body, key) in _unknown_logged:
            continue
        with _unknown_lock:
            if len(_unknown_logged) >= MAX_UNKNOWN_LOGGED or (body, key) in _unknown_logged:
                return
            _unknown_logged.add((body, key))
        log.warning("%s: field %s is not in its schema; ignored (logged once per field name)", body, _short(key))


def logit_bias(value: dict[str, float] | None) -> tuple[tuple[int, float], ...] | None:
    """OpenAI's ``{"token id": bias}`` as ``((id, bias), ...)``: ids written as decimal integers, biases in
    [-100, 100] (the vocabulary's size is checked by the model that serves the request)."""
    if value is None:
        return None
    out = []
    for key, bias in value.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 18):
            _fail(f"'logit_bias' keys must be token ids written as integers (\"50256\"), got {_short(key)}")
        if not -100 <= bias <= 100:
            _fail(f"'logit_bias' values must be in [-100, 100], got {bias} for token {key}")
        out.append((int(key), float(bias)))
    return tuple(out)


class OpenAIFields(Part):
    """What OpenAI's completions and chat share here: ``logit_bias``, and fields outside the schema logged once."""

    logit_bias: dict[str, float] | None = None

    @model_validator(mode="before")
    @classmethod
    def _unknown(cls, data):
        log_unknown(cls.__name__, data, cls.model_fields)
        return data

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value):
        return logit_bias(value)


class CompletionRefusals(Part):
    """The completions fields attnx refuses a value of (:data:`REFUSED`)."""

    suffix: Any = None
    best_of: Any = None

    @field_validator("suffix", "best_of", mode="before")
    @classmethod
    def _refused(cls, value, info):
        return refuse(value, info.field_name)


class ChatRefusals(Part):
    """The chat fields attnx refuses a value of (:data:`REFUSED`)."""

    audio: Any = None
    modalities: Any = None
    store: Any = None
    metadata: Any = None
    moderation: Any = None
    prediction: Any = None
    prompt_cache_key: Any = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    service_tier: Any = None

    @field_validator("audio", "modalities", "store", "metadata", "moderation", "prediction", "prompt_cache_key",
                     "prompt_cache_retention", "prompt_cache_options", "reasoning_effort", "verbosity",
                     "web_search_options", "service_tier", mode="before")
    @classmethod
    def _refused(cls, value, info):
        return refuse(value, info.field_name)
