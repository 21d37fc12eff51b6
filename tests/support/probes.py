"""One probe for each thing a marked test needs, each run at most once per test process.

A probe returns ``None`` when the thing is there, else one line saying why not. ``tests/conftest.py``
turns the markers into skips (``gpu``, ``tensorrt``: hardware and packages this machine cannot have)
or, for tools ``make test`` installs or CI has (``rtx``, ``nvcc``, ``cxx``, ``chromium``, ``git``),
into failures when ``ATTNX_TEST_STRICT=1`` (set by ``make test``): a tool lost on CI must not turn
into a quiet skip.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: ``make test`` sets it: a tool the machine must have is a failure when missing, not a skip.
STRICT = os.environ.get("ATTNX_TEST_STRICT") == "1"


@functools.cache
def gpu() -> str | None:
    import torch

    return None if torch.cuda.is_available() else "needs an NVIDIA GPU (no CUDA device visible to PyTorch)"


@functools.cache
def tensorrt() -> str | None:
    """The full TensorRT package (users' production machines; PyPI's libraries are a stub here)."""
    from attnx.engine.discovery import TensorRTUnavailable, select_backend

    try:
        select_backend("tensorrt")
    except TensorRTUnavailable as e:
        return f"needs the full TensorRT package ({str(e).splitlines()[0][:120]})"
    return None


@functools.cache
def rtx() -> str | None:
    """TensorRT for RTX and the built plugin library (``make test`` installs the one and builds the other)."""
    from attnx import plugins
    from attnx.engine.discovery import TensorRTUnavailable, select_backend

    try:
        select_backend("rtx")
    except TensorRTUnavailable as e:
        return f"needs TensorRT for RTX ({str(e).splitlines()[0][:120]})"
    if plugins.library_path() is None:
        return "needs the attnx plugin library (`attnx plugins build`; `make test` builds it)"
    return None


@functools.cache
def nvcc() -> str | None:
    from attnx.plugins.builder import find_cmake, find_nvcc

    if find_nvcc() is None:
        return "needs nvcc (the CUDA toolkit) to compile the plugins"
    if find_cmake() is None:
        return "needs CMake to build the plugins"
    return None


@functools.cache
def cxx() -> str | None:
    return None if (shutil.which("c++") or shutil.which("g++")) else "needs a C++ compiler (c++ or g++)"


@functools.cache
def chromium() -> str | None:
    return None if shutil.which("chromium") else "needs Debian's chromium (`make test` installs it)"


@functools.cache
def git() -> str | None:
    if shutil.which("git") is None:
        return "needs git"
    run = subprocess.run(["git", "rev-parse", "--is-inside-work-tree"], cwd=ROOT, capture_output=True, text=True)
    return None if run.returncode == 0 and run.stdout.strip() == "true" else "needs a git checkout of attnx"


#: marker -> (probe, may it skip under ATTNX_TEST_STRICT=1?)
PROBES = {
    "gpu": (gpu, True),
    "tensorrt": (tensorrt, True),
    "rtx": (rtx, False),
    "nvcc": (nvcc, False),
    "cxx": (cxx, False),
    "chromium": (chromium, False),
    "git": (git, False),
}


def require(reason: str | None) -> None:
    """Inside a test: go on when ``reason`` is None, else skip (or, under :data:`STRICT`, fail) saying it."""
    import pytest

    if reason is None:
        return
    if STRICT:
        pytest.fail(f"{reason} (ATTNX_TEST_STRICT=1: a missing tool fails)", pytrace=False)
    pytest.skip(reason)


def tool(name: str) -> str:
    """The path of command ``name`` (a build tool the machine must have), else :func:`require` fails or skips."""
    path = shutil.which(name)
    require(None if path else f"needs the command {name}")
    return path
