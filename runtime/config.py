"""The serving configuration: every setting of ``attnx serve`` in one frozen dataclass, :class:`ServingConfig`.

Each field carries its default, its help and its check (a :class:`Setting` in the field's metadata). ``attnx
serve`` and ``attnx bench`` generate their options from the fields (``attnx.cli.serving_options``: the flag is the
field's name with dashes), :class:`~attnx.runtime.server.InferenceServer` takes the config whole, and each layer
gets its part as the value type it already had: :attr:`ServingConfig.batching` (core's ``BatcherConfig``),
:attr:`ServingConfig.limits` (wire's ``Limits``), :attr:`ServingConfig.http_limits` (wire's ``HttpLimits``).
Fields are in the flags' units (``max_body_mb``: MiB); 0 means "no limit" where the help says so. A bad value is a
one-line :class:`ConfigError` naming the field, raised on construction, before any model loads.

What is per model (files, tokenizer folders, axes, chat templates, embedding dimensions) is keyed by model name
and given beside the config, not in it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator

if TYPE_CHECKING:  # imported when a part is asked for: the CLI reads the fields without loading the layers
    from attnx.runtime.core.batcher import BatcherConfig
    from attnx.runtime.wire.http_guard import HttpLimits
    from attnx.runtime.wire.limits import Limits

__all__ = ["ServingConfig", "Setting", "ConfigError", "settings"]


class ConfigError(ValueError):
    """A setting's value refused: ``str()`` is one line, ``"<field> <reason>"``."""

    def __init__(self, name: str, reason: str):
        super().__init__(f"{name} {reason}")
        self.field, self.reason = name, reason


@dataclass(frozen=True)
class Setting:
    """What a field of :class:`ServingConfig` says about itself (``field.metadata["setting"]``)."""

    help: str
    check: Callable[[Any], str | None] | None = None  #: why a value is refused (None: accepted)
    part: str | None = None  #: the layer's value it sets: "batching", "limits" or "http"
    key: str | None = None  #: that value's field (default: the same name)
    scale: int = 1  #: the part's unit per the flag's (MiB -> bytes)
    zero_is_none: bool = False  #: 0 here is None there ("no limit")
    bench: bool = False  #: also an option of ``attnx bench`` (its in-process batcher)
    envvar: str | None = None
    secret: bool = False  #: its value is never shown (help, repr)


def _at_least(low: float) -> Callable[[Any], str | None]:
    return lambda v: None if v is None or v >= low else f"must be >= {low}, got {v}"


def _positive(v: Any) -> str | None:
    return None if v is None or v > 0 else f"must be positive, got {v}"


def _port(v: Any) -> str | None:
    return None if v is None or 0 <= v <= 65535 else f"must be 0..65535, got {v}"


def _one_of(*choices: str) -> Callable[[Any], str | None]:
    return lambda v: None if v in choices else f"must be one of {', '.join(choices)}, got {v!r}"


def _ratio(v: Any) -> str | None:
    return None if v == 0 or v >= 1 else f"must be >= 1 (or 0: pad anything), got {v}"


def _api_key(v: Any) -> str | None:
    from attnx.runtime.wire.auth import ApiKey

    try:
        if v is not None:
            ApiKey(v)
    except ValueError as e:
        return f"is refused: {e}"
    return None


def _s(default: Any, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"setting": Setting(help, **kw)}, repr=not kw.get("secret"))


@dataclass(frozen=True)
class ServingConfig:
    """How models are served (module doc); ``ServingConfig()`` is ``attnx serve``'s defaults."""

    # --- listening --------------------------------------------------------------------------------------------
    host: str = _s("127.0.0.1", "Address to listen on (loopback by default).")
    port: int = _s(8000, "TCP port (0 = any free port).", check=_port)
    grpc_port: int | None = _s(None, "Also serve KServe v2 over gRPC on this port (0 = any free port).", check=_port)
    log_level: str = _s("warning", "uvicorn log level: critical, error, warning, info, debug or trace.",
                        check=_one_of("critical", "error", "warning", "info", "debug", "trace"))
    graceful_timeout_s: float = _s(30.0, "Seconds in-flight requests and generations get to finish on shutdown.",
                                   check=_at_least(0))
    api_key: str | None = _s(
        None, "Require 'Authorization: Bearer KEY' on every route but the health checks (HTTP and gRPC). Prefer the "
              "environment variable: a flag shows in ps.", check=_api_key, envvar="ATTNX_API_KEY", secret=True)
    # --- running models ---------------------------------------------------------------------------------------
    device: str = _s("auto", "ONNX Runtime device: auto, cpu or cuda.", check=_one_of("auto", "cpu", "cuda"),
                     bench=True)
    threads: int | None = _s(None, "Intra-op threads per model (default: all CPUs).", check=_at_least(1), bench=True)
    # --- batching (core's BatcherConfig) ----------------------------------------------------------------------
    max_batch: int = _s(32, "Max rows per batch (1 disables batching).", check=_at_least(1), part="batching",
                        key="max_batch_size", bench=True)
    max_delay_ms: float = _s(2.0, "Max time a request waits for others.", check=_at_least(0), part="batching",
                             key="max_queue_delay_ms", bench=True)
    max_queue: int = _s(1024, "Waiting requests per model before 503.", check=_at_least(1), part="batching",
                        key="max_queue_size", bench=True)
    timeout_ms: float = _s(30000.0, "Max time a request may wait in queue (0 = no limit).", check=_at_least(0),
                           part="batching", zero_is_none=True)
    max_length_ratio: float = _s(1.5, "Longest/shortest sequence in one batch (0 = pad anything).", check=_ratio,
                                 part="batching", zero_is_none=True, bench=True)
    max_batch_tokens: int = _s(
        8192, "Cap on rows x padded length per batch (0 = none). On a CPU, requests this long gain nothing from "
              "sharing a run, and their activations add up; raise it on a GPU.", check=_at_least(0),
        part="batching", zero_is_none=True, bench=True)
    # --- what one request may ask (wire's Limits) -------------------------------------------------------------
    max_body_mb: float = _s(64.0, "Largest request body accepted (MiB).", check=_positive, part="limits",
                            key="max_body_bytes", scale=1 << 20)
    body_timeout_s: float = _s(
        10.0, "Seconds an HTTP request body may take, plus 1 s per --min-body-rate-kb KiB received; 408 and closed "
              "beyond.", check=_positive, part="limits")
    min_body_rate_kb: float = _s(16.0, "KiB/s a body must keep up past --body-timeout-s (0: that is a total "
                                       "deadline).", check=_at_least(0), part="limits", key="min_body_rate",
                                 scale=1 << 10, zero_is_none=True)
    max_seq: int | None = _s(None, "Longest seq accepted (default: profile max).", check=_at_least(1), part="limits")
    max_inputs: int = _s(1024, "Most texts in one request (all APIs).", check=_at_least(1), part="limits",
                         key="max_texts")
    max_messages: int = _s(2048, "Most messages in one chat request.", check=_at_least(1), part="limits")
    max_request_tokens: int | None = _s(
        300_000, "Most tokens in one request, summed over its texts (413 beyond).", check=_at_least(1),
        part="limits")
    max_tensor_elements: int = _s(16 << 20, "Most elements in one input tensor (checked on its declared shape).",
                                  check=_at_least(1), part="limits")
    max_request_elements: int = _s(32 << 20, "Most tensor elements in one request, summed over its inputs.",
                                   check=_at_least(1), part="limits")
    max_decode_mb: float | None = _s(
        None, "MiB of big request bodies read and decoded at once, over all requests (default: the larger of "
              "--max-body-mb and 64).", check=_positive, part="limits", key="max_decode_bytes", scale=1 << 20)
    decode_wait_s: float = _s(10.0, "Seconds a body waits for room in that budget before the request is refused "
                                    "as overloaded.", check=_at_least(0), part="limits")
    max_positions: int | None = _s(
        None, "Generating models: most positions (prompt + generated tokens) per sequence, which bounds the KV "
              "cache (vLLM's --max-model-len); 400 beyond.", check=_at_least(2), part="limits")
    max_new_tokens: int | None = _s(
        None, "Generating models: most tokens one completion generates; the default when a request sets no "
              "max_tokens, and larger ones are clamped to it (as vLLM's max_new_tokens override; finish_reason "
              "'length').", check=_at_least(1))
    # --- connections (wire's HttpLimits) ----------------------------------------------------------------------
    max_header_kb: float = _s(64.0, "Largest HTTP request head (request line + headers, KiB); 431 beyond.",
                              check=_positive, part="http", key="max_header_bytes", scale=1 << 10)
    max_headers: int = _s(100, "Most HTTP request headers; 431 beyond.", check=_at_least(1), part="http")
    head_timeout_s: float = _s(10.0, "Seconds a connection may take to send a complete request head; 408 and "
                                     "closed beyond.", check=_positive, part="http")

    def __post_init__(self) -> None:
        for f, setting in settings():
            value = getattr(self, f.name)
            wanted = _TYPES[str(f.type)]
            if not (value is None and "None" in f.type) and (
                    not isinstance(value, wanted) or isinstance(value, bool)):
                raise ConfigError(f.name, f"must be {_TYPE_NAMES[wanted]}, got {value!r}")
            reason = setting.check(value) if setting.check is not None else None
            if reason is not None:
                raise ConfigError(f.name, reason)
        for part in ("batching", "limits", "http_limits"):  # what the layers themselves refuse, refused now
            try:
                getattr(self, part)
            except ValueError as e:
                raise ConfigError(part, f"(from these settings): {e}") from None

    # --- each layer's part ------------------------------------------------------------------------------------
    @property
    def batching(self) -> BatcherConfig:
        """:class:`~attnx.runtime.core.batcher.BatcherConfig` of every encoder's batcher."""
        from attnx.runtime.core.batcher import BatcherConfig

        return BatcherConfig(**self._part("batching"))

    @property
    def limits(self) -> Limits:
        """:class:`~attnx.runtime.wire.limits.Limits`: what one request may ask."""
        from attnx.runtime.wire.limits import Limits

        return Limits(**self._part("limits"))

    @property
    def http_limits(self) -> HttpLimits:
        """:class:`~attnx.runtime.wire.http_guard.HttpLimits`: each connection's request head."""
        from attnx.runtime.wire.http_guard import HttpLimits

        return HttpLimits(**self._part("http"))

    def _part(self, part: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f, s in settings():
            if s.part == part:
                value = getattr(self, f.name)
                value = None if value is None or (s.zero_is_none and not value) else \
                    int(value * s.scale) if s.scale != 1 else value
                out[s.key or f.name] = value
        return out

    @classmethod
    def from_parts(cls, *, batching: BatcherConfig | None = None, limits: Limits | None = None,
                   http_limits: HttpLimits | None = None, **values: Any) -> ServingConfig:
        """A config from the layers' own values (``BatcherConfig``, ``Limits``, ``HttpLimits``, as code that
        holds them has them) and fields by name; the inverse of the properties above."""
        for part, given in (("batching", batching), ("limits", limits), ("http", http_limits)):
            for f, s in settings():
                if given is not None and s.part == part:
                    value = getattr(given, s.key or f.name)
                    value = 0 if value is None and s.zero_is_none else \
                        value / s.scale if value is not None and s.scale != 1 else value
                    values.setdefault(f.name, value)
        return cls(**values)


#: The Python types a field's annotation names (the module's annotations are strings).
_TYPES: dict[str, type | tuple[type, ...]] = {"str": str, "str | None": str, "int": int, "int | None": int,
                                              "float": (int, float), "float | None": (int, float)}
_TYPE_NAMES: dict[type | tuple[type, ...], str] = {str: "a string", int: "an integer", (int, float): "a number"}


def settings(command: str | None = None) -> Iterator[tuple[dataclasses.Field[Any], Setting]]:
    """Every field of :class:`ServingConfig` with its :class:`Setting`, in order (``command="bench"``: those
    ``attnx bench`` takes)."""
    for f in dataclasses.fields(ServingConfig):
        setting = f.metadata["setting"]
        if command != "bench" or setting.bench:
            yield f, setting
