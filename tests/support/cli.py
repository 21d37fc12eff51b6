"""``attnx`` run the way tests need it: in this process (Typer's test runner) unless the process itself
is under test.

In process, a command costs what it does, not a fresh interpreter importing torch, onnx and
transformers first (2-4 s a call here). :func:`run` gives the same view of the outcome a subprocess
gives (exit code, stdout, stderr), restores the environment, the working folder and the CLI's global
state afterwards, and runs the command in ``cwd`` (relative outputs such as ``attnx-out/`` land there).

Real subprocesses stay where the process is what a test checks: signals, exit status of the
interpreter, variants loaded from the environment at start-up, packaging, servers
(:func:`subprocess_run`, the one helper for those). A test that kills many commands part-way
(:func:`forked`) forks each from a server process that imported the CLI once: a real process to kill,
without paying a fresh interpreter's imports each time.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def errors(self) -> list[str]:
        """The ``error:`` lines a command printed (each user error is exactly one)."""
        return [line for line in self.stderr.splitlines() if line.startswith("error:")]


def run(*args, cwd: str | os.PathLike | None = None, env: Mapping[str, str] | None = None,
        input: str | None = None, timeout: float | None = None) -> Result:
    """``attnx ARGS`` in this process, in folder ``cwd`` (default: the test's own, see conftest), with
    ``env`` added to the environment. (``timeout`` is accepted for the subprocess form's sake: pytest-timeout
    bounds an in-process run.)"""
    from typer.testing import CliRunner

    from attnx.cli import _common
    from attnx.cli.main import app

    saved_env, saved_cwd, saved_verbose = dict(os.environ), os.getcwd(), _common.state.verbose
    saved_widths = [c.width for c in (_common.console, _common.err_console)]
    environ = dict(env or {})
    try:
        os.chdir(cwd or saved_cwd)
        # What a piped process gets (whatever COLUMNS the test run itself has): the consoles' pipe width.
        columns = int(environ.get("COLUMNS", _common.PIPE_WIDTH))
        _common.console.width = _common.err_console.width = columns
        result = CliRunner().invoke(app, [str(a) for a in args], env=environ, input=input, catch_exceptions=False)
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
        _common.state.verbose = saved_verbose
        _common.console.width, _common.err_console.width = saved_widths
    return Result(result.exit_code, result.stdout, result.stderr)


#: A long command's stage line off a terminal (``cli._common.StageLines``): ``export <what>: <stage>``.
STAGE_LINE = re.compile(r"^(export|check) [^:]+: ")


def one_line_error(result, *words: str, code: int | None = None, alone: bool = False) -> str:
    """The command (a :class:`Result` or a finished process) failed with exactly one ``error:`` line that
    contains every one of ``words`` (``alone``: and stderr holds nothing else but the stage lines a long command
    prints off a terminal); that line."""
    output = result.stdout + result.stderr
    assert result.returncode not in (0, None), output
    if code is not None:
        assert result.returncode == code, (result.returncode, output)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, output
    if alone:
        lines = [line for line in result.stderr.strip().splitlines() if not STAGE_LINE.match(line)]
        assert lines == errors, result.stderr
    assert "Traceback" not in output, output
    for word in words:
        assert word in errors[0], errors[0]
    return errors[0]


def subprocess_run(*args, cwd: str | os.PathLike | None = None, env: Mapping[str, str] | None = None,
                   timeout: float = 300, unset: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """``python -m attnx.cli.main ARGS`` as a real process (for what only a process can show), with ``env``
    added to this process's environment and the variables ``unset`` removed."""
    environ = {k: v for k, v in {**os.environ, "NO_COLOR": "1", **(env or {})}.items() if k not in unset}
    return subprocess.run([sys.executable, "-m", "attnx.cli.main", *map(str, args)], cwd=cwd, env=environ,
                          capture_output=True, text=True, timeout=timeout)


def subprocess_popen(*args, env: Mapping[str, str] | None = None, **kwargs) -> subprocess.Popen:
    """``python -m attnx.cli.main ARGS`` started in the background (servers); the caller stops it."""
    environ = {**os.environ, "NO_COLOR": "1", **(env or {})}
    kwargs.setdefault("stdout", subprocess.PIPE)
    kwargs.setdefault("stderr", subprocess.PIPE)
    kwargs.setdefault("text", True)
    return subprocess.Popen([sys.executable, "-m", "attnx.cli.main", *map(str, args)], env=environ, **kwargs)


ROOT = Path(__file__).resolve().parents[2]


# What an export imports before its first step: the forkserver imports it once, every forked command starts past it.
_FORK_PRELOAD = ["attnx.cli.main", "attnx.export.pretrained", "attnx.export.exporter", "attnx.models.onnx_ops",
                 "torch.onnx._internal.exporter._core", "torch.export._trace", "torch._functorch.aot_autograd",
                 "torch._export.passes", "torch._inductor.codegen", "onnxscript.function_libs.torch_lib.ops",
                 "onnxscript.rewriter", "networkx", "transformers.models.bert.modeling_bert", "tokenizers",
                 "safetensors.torch"]


def _cli_in_child(args: list[str]) -> None:
    """The child's body: ``attnx ARGS`` with stdout and stderr to /dev/null (a killed command's output is not
    what is checked); its exit code is the command's."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    os.environ["NO_COLOR"] = "1"
    from attnx.cli.main import app

    app(args=args, prog_name="attnx")


def forked(*args) -> multiprocessing.process.BaseProcess:
    """``attnx ARGS`` started as a real process forked from a server that has the CLI imported (the caller
    kills or joins it; ``exitcode`` is the command's)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_FORK_PRELOAD)
    proc = ctx.Process(target=_cli_in_child, args=([str(a) for a in args],), daemon=True)
    proc.start()
    return proc
