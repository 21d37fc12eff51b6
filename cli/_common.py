"""Shared CLI plumbing: the working folder, "most recent export", one-line errors.

Every command wraps its body in :func:`guarded` so a user error is one line on
stderr and a non-zero exit; ``attnx --verbose ...`` shows the traceback.
"""

from __future__ import annotations

import functools
import os
import time
import traceback
from pathlib import Path
from typing import Callable, TypeVar

import typer
from rich.console import Console
from rich.markup import escape

#: Output that is not a terminal (CI logs, pipes) is laid out this wide: rich would assume 80 columns and cut
#: tables' numbers to "…", and those numbers are what such logs are kept for. Rules stay a line wide.
PIPE_WIDTH = 1000


class _Console(Console):
    """rich's Console, laid out at :data:`PIPE_WIDTH` columns when writing to a pipe or file (unless
    ``COLUMNS`` says otherwise), so tables print whole. (Progress lines are drawn on terminals only:
    ``Progress(disable=not console.is_terminal)``.)"""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        if not self.is_terminal and not os.environ.get("COLUMNS") and "width" not in kwargs:
            self.width = PIPE_WIDTH

    def rule(self, *args, **kwargs) -> None:
        from rich.rule import Rule

        self.print(Rule(*args, **kwargs), width=min(self.width, 100) if not self.is_terminal else None)


console = _Console()
err_console = _Console(stderr=True, soft_wrap=True)  # one-line errors stay one line

F = TypeVar("F", bound=Callable)


class StageLines:
    """One plain line per stage on stderr where progress bars are not drawn (CI logs, ``nohup``, pipes): each stage
    as it starts, then one line with every stage's time, so a 20-minute export says what it is doing."""

    def __init__(self, title: str):
        self.title, self.current, self.started, self.times = title, None, time.monotonic(), {}

    def __call__(self, label: str) -> None:
        if label == self.current:
            return
        self._close()
        err_console.print(f"{self.title}: {label}", highlight=False, markup=False)
        self.current, self.started = label, time.monotonic()

    def _close(self) -> None:
        if self.current is not None:
            self.times[self.current] = self.times.get(self.current, 0.0) + time.monotonic() - self.started

    def finish(self) -> None:
        self._close()
        self.current = None
        if self.times:
            took = ", ".join(f"{label} {seconds:.1f}s" for label, seconds in self.times.items())
            err_console.print(f"{self.title}: finished in {sum(self.times.values()):.1f}s ({took})",
                              highlight=False, markup=False)


class UserError(Exception):
    """An error the user can fix; printed as one line, exit code ``code``."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


class _State:
    verbose: bool = False


state = _State()


def tensorrt_problem() -> str | None:
    """Print the TensorRT backend, or why there is none, and return that reason (None: engines can be
    built). The demos go on without engines when there is a reason."""
    from attnx import engine as eng

    try:
        console.print(f"TensorRT backend: {eng.backend().describe()}")
    except eng.TensorRTError as e:
        problem = eng.explain(e)
        err_console.print(f"[yellow]no engines:[/yellow] {escape(problem)}")
        return problem
    return None


def workdir() -> Path:
    """The working folder for outputs: ``$ATTNX_WORKDIR`` or ``./attnx-out``."""
    return Path(os.environ.get("ATTNX_WORKDIR", "attnx-out"))


def latest(pattern: str, what: str, folder: Path | None = None) -> Path:
    """The most recently modified file matching ``pattern`` in the working folder."""
    folder = folder or workdir()
    found = sorted(folder.glob(pattern), key=lambda p: p.stat().st_mtime) if folder.is_dir() else []
    if not found:
        raise UserError(f"no {what} found in {folder}/ (pass a file, or run the step that makes it first)")
    path = found[-1]
    err_console.print(f"[dim]using the most recent {what}: {path}[/dim]")
    return path


def latest_export(folder: Path | None = None) -> Path:
    return latest("*.onnx", "ONNX export", folder)


def guarded(fn: F) -> F:
    """Turn exceptions into one-line messages and exit codes (tracebacks with --verbose)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except typer.Exit:
            raise
        except KeyboardInterrupt:
            err_console.print("interrupted")
            raise typer.Exit(130)
        except UserError as e:
            if state.verbose:
                traceback.print_exc()
            err_console.print(f"[bold red]error:[/bold red] {escape(str(e))}", highlight=False)
            raise typer.Exit(e.code)
        except Exception as e:  # noqa: BLE001 - every error is one line (a library's too); --verbose: traceback
            if state.verbose:
                traceback.print_exc()
            msg = str(e).strip().splitlines()[0][:300].rstrip() if str(e).strip() else type(e).__name__
            if not isinstance(e, ValueError):  # ValueErrors are our own input checks: the message says it all
                msg = f"{type(e).__name__}: {msg}"
            err_console.print(f"[bold red]error:[/bold red] {escape(msg)}", highlight=False)
            raise typer.Exit(1)

    return wrapper  # type: ignore[return-value]
