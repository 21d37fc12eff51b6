"""The serving stack's error taxonomy: every refusal is a :class:`ProtocolError` of one :class:`Kind`.

Defined here, in the core, because the core refuses requests itself (:mod:`attnx.runtime.core.pacing`'s admission by
work) and never imports the wire. The core's own exceptions that refuse a request (``InputError``, ``TooLong``,
``QueueFullError``, ``RequestTimeoutError``, ``BatcherClosedError``, the scheduler's ``SchedulerFull`` and
``SchedulerClosed``) are :class:`Refusal` s: each carries its kind, and :meth:`Refusal.refused` is the one
translation of them (a chat template's ``ChatError`` is not: its module is also the render worker's script, which
imports nothing of attnx).
:mod:`attnx.runtime.wire.errors` re-exports these names and holds the one status table per wire shape, the only
place a kind becomes a status.
"""

from __future__ import annotations

import enum


class Kind(str, enum.Enum):
    BAD_INPUT = "bad_input"
    EMPTY = "empty"
    TOO_MANY = "too_many"
    TOO_LARGE = "too_large"
    UNPROCESSABLE = "unprocessable"
    NOT_FOUND = "not_found"
    UNAUTHENTICATED = "unauthenticated"
    OVERLOADED = "overloaded"
    TIMEOUT = "timeout"
    BODY_TIMEOUT = "body_timeout"
    SHUTTING_DOWN = "shutting_down"
    UNIMPLEMENTED = "unimplemented"
    CLIENT_GONE = "client_gone"
    INTERNAL = "internal"


class ProtocolError(Exception):
    """A request the server refuses: its :class:`Kind`, a one-line message, the field at fault (``param``)."""

    def __init__(self, kind: Kind, message: str, param: str | None = None):
        message = " ".join(str(message).split())
        super().__init__(message)
        self.kind, self.message, self.param = Kind(kind), message, param

    def __repr__(self) -> str:
        return f"ProtocolError({self.kind.value}, {self.message!r})"


class Refusal(Exception):
    """A core exception that is a refusal of the request (bad feeds, a full queue, a deadline passed...): it carries
    its :class:`Kind`, so the server translates every one the same way (:meth:`refused`), never by its class."""

    kind: Kind = Kind.BAD_INPUT

    def refused(self, where: str = "", param: str | None = None) -> ProtocolError:
        """This refusal in the server's words: ``where`` (the input at fault) before the message."""
        return ProtocolError(self.kind, where + str(self), param)


def bad_input(message: str, param: str | None = None) -> ProtocolError:
    return ProtocolError(Kind.BAD_INPUT, message, param)


def too_large(message: str, param: str | None = None) -> ProtocolError:
    return ProtocolError(Kind.TOO_LARGE, message, param)


def not_found(message: str, param: str | None = None) -> ProtocolError:
    return ProtocolError(Kind.NOT_FOUND, message, param)


def overloaded(message: str) -> ProtocolError:
    return ProtocolError(Kind.OVERLOADED, message)
