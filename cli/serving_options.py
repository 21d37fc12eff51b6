"""The options of ``attnx serve`` and ``attnx bench`` that are serving settings, generated from the fields of
:class:`attnx.runtime.config.ServingConfig` (one loop: name, type, default, help, environment variable).

:func:`with_settings` gives a command one option per field (``max_body_mb`` -> ``--max-body-mb``) beside the
options it declares itself (model files, per-model folders), and hands the body the values as ``**settings``;
:func:`serving_config` builds the config from them, a refused value becoming the CLI's one-line error with the
flag's name.
"""

from __future__ import annotations

import inspect
import typing
from typing import Any, Callable, Mapping, TypeVar

import typer

from attnx.cli._common import UserError
from attnx.runtime.config import ConfigError, ServingConfig, settings

F = TypeVar("F", bound=Callable[..., Any])


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def with_settings(command: str, defaults: Mapping[str, Any] | None = None, help_prefix: str = "") -> Callable[[F], F]:
    """Give ``fn`` (whose signature ends in ``**settings``) an option per setting of ``command`` ("serve": every
    field; "bench": those of its in-process batcher), with ``defaults`` replacing the config's where the command's
    own differ. The command's first parameter stays first (Typer's argument), the settings follow it."""
    hints = typing.get_type_hints(ServingConfig)

    def decorate(fn: F) -> F:
        own = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
               for p in inspect.signature(fn).parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        generated = []
        for f, s in settings(command):
            default = (defaults or {}).get(f.name, f.default)
            option = typer.Option(default, flag(f.name), help=help_prefix + s.help, envvar=s.envvar,
                                  show_envvar=s.envvar is not None, show_default=not s.secret)
            generated.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=option,
                                               annotation=hints[f.name]))
        fn.__signature__ = inspect.Signature(own[:1] + generated + own[1:])  # type: ignore[attr-defined]
        return fn

    return decorate


def serving_config(settings: Mapping[str, Any], **overrides: Any) -> ServingConfig:
    """The config of a command's generated options; a refused value is one line naming its flag."""
    try:
        return ServingConfig(**{**settings, **overrides})
    except ConfigError as e:
        f = ServingConfig.__dataclass_fields__.get(e.field)
        if f is None:  # a layer's own check of several settings together
            raise UserError(str(e)) from None
        envvar = f.metadata["setting"].envvar
        raise UserError(f"{flag(e.field)}{f' / {envvar}' if envvar else ''} {e.reason}") from None
