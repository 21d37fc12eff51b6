"""The errors of :mod:`attnx.engine`, and :func:`explain`: any of them as one line (what the CLI prints).

Each carries its cause in the message: :class:`TensorRTUnavailable` (neither package importable;
says which extra to install), :class:`PluginLoadError`, :class:`ParseError` (the parser's and the
plugins' own messages), :class:`BuildError`, :class:`EngineUnavailable` (no GPU, or not the one
the engine was built for). :class:`EngineBuildError` is a user-fixable request (a missing
``--plugins`` file, a bad ``--workspace``); it is a :class:`attnx.contract.ContractError`, like
the contract's own errors (bad profiles, a corrupt engine, an unreadable ONNX file).
"""

from __future__ import annotations

from typing import Iterable, Sequence

from attnx.contract import ContractError


class TensorRTError(RuntimeError):
    """Base class of TensorRT's failures as attnx reports them."""


class TensorRTUnavailable(TensorRTError):
    """Neither ``tensorrt`` nor TensorRT for RTX can be imported (or the chosen one cannot)."""


class PluginLoadError(TensorRTError):
    """The attnx plugin library is missing, TensorRT's registry refused it, or it lacks an op a model uses."""


class _Diagnosed(TensorRTError):
    def __init__(self, message: str, errors: Sequence[str] = ()):
        super().__init__(message)
        self.errors = list(errors)


class ParseError(_Diagnosed):
    """The ONNX parser failed; ``errors`` holds the parser's and the plugins' messages."""


class BuildError(_Diagnosed):
    """The engine build failed (or was asked for something this backend cannot do)."""


class EngineUnavailable(TensorRTError):
    """An engine cannot be deserialized or run here (no GPU, or a GPU it was not built for)."""


class EngineBuildError(ContractError):
    """A user-fixable problem with a build request (a missing plugin library file, a bad size, ...)."""


def one_line(text: object) -> str:
    return " ".join(str(text).split())


def unique(lines: Iterable[str]) -> list[str]:
    """Non-empty lines, stripped, each once, in order."""
    return list(dict.fromkeys(line.strip() for line in lines if line and line.strip()))


_PREFIXES = ((PluginLoadError, "plugin library: "), (ParseError, "cannot map the model to TensorRT: "),
             (BuildError, "engine build failed: "))


def explain(exc: BaseException) -> str:
    """One line for any build-time error (TensorRT's included)."""
    text = one_line(exc) or type(exc).__name__
    for kind, prefix in _PREFIXES:
        if isinstance(exc, kind):
            return prefix + text
    return text
