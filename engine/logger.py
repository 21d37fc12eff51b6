"""The process-wide TensorRT logger, and :func:`native_stdout_to_stderr`.

:class:`Logger` forwards TensorRT's messages to Python's ``logging`` (logger ``attnx.tensorrt``;
TensorRT's INFO and VERBOSE at DEBUG) and keeps recent warnings/errors and every plugin message,
so that errors can quote them. One logger serves every builder and runtime: TensorRT-RTX's plugins
find the logger of the most recent builder/runtime, and a Python logger must outlive what uses it.
TensorRT-RTX 1.7's ``ILoggerFinder::findLogger`` returns null, so the plugins also keep their own
errors (:func:`attnx.plugins.plugin_errors`).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import sys
import threading
from collections import deque
from typing import Iterable

from attnx.contract import PLUGIN_NAMESPACE
from attnx.engine.discovery import BackendInfo, backend, lock

_log = logging.getLogger("attnx.tensorrt")

_SEVERITY_NAMES = ("internal_error", "error", "warning", "info", "verbose")
_SEVERITY_TO_LOGGING = {0: logging.CRITICAL, 1: logging.ERROR, 2: logging.WARNING, 3: logging.DEBUG, 4: logging.DEBUG}


class Logger:
    """The TensorRT logger (use :func:`get_logger`); ``native`` is what TensorRT APIs take."""

    def __init__(self, info: BackendInfo, keep: int = 1000):
        self.backend = info
        self._lock = threading.Lock()
        self._records: deque[tuple[int, str, str]] = deque(maxlen=keep)  # (seq, severity, message)
        self._seq = 0
        trt = info.module
        owner = self

        class _NativeLogger(trt.ILogger):  # type: ignore[misc, name-defined]
            def __init__(self):
                trt.ILogger.__init__(self)

            def log(self, severity, msg):  # called by TensorRT, possibly from its threads
                try:
                    owner._record(int(severity), str(msg))
                except Exception:  # never raise into TensorRT
                    pass

        self.native = _NativeLogger()

    def _record(self, severity: int, message: str) -> None:
        severity = min(max(severity, 0), 4)
        keep = severity <= 2 or PLUGIN_NAMESPACE in message
        with self._lock:
            self._seq += 1
            if keep:
                self._records.append((self._seq, _SEVERITY_NAMES[severity], message))
        _log.log(_SEVERITY_TO_LOGGING[severity], "%s", message)

    def mark(self) -> int:
        """A position; :meth:`messages` (since=mark) returns what was logged after it."""
        with self._lock:
            return self._seq

    def messages(self, since: int = 0, severities: Iterable[str] = ("internal_error", "error")) -> list[str]:
        wanted = set(severities)
        with self._lock:
            return [m for seq, sev, m in self._records if seq > since and sev in wanted]

    def plugin_messages(self, since: int = 0) -> list[str]:
        """What the attnx plugins logged (their messages name ``attnx::<Op>``)."""
        with self._lock:
            return [m for seq, _sev, m in self._records if seq > since and f"{PLUGIN_NAMESPACE}::" in m]


_logger: Logger | None = None


def get_logger() -> Logger:
    """The logger of the current backend (a new one after :func:`attnx.engine.reset_backend`)."""
    global _logger
    with lock:
        info = backend()
        if _logger is None or _logger.backend is not info:
            _logger = Logger(info)
        return _logger


@contextlib.contextmanager
def native_stdout_to_stderr():
    """Send what native code prints on stdout (TensorRT-RTX prints some warnings there, bypassing
    its logger) to stderr while the block runs, so stdout stays machine-readable."""
    try:
        out_fd = sys.stdout.fileno()
        err_fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # pytest capture, no real file descriptors
        yield
        return
    libc = None
    with contextlib.suppress(OSError):
        libc = ctypes.CDLL(None)
    sys.stdout.flush()
    saved = os.dup(out_fd)
    try:
        os.dup2(err_fd, out_fd)
        yield
    finally:
        if libc is not None:
            with contextlib.suppress(Exception):
                libc.fflush(None)
        sys.stdout.flush()
        os.dup2(saved, out_fd)
        os.close(saved)
