"""Build ``libattnx_plugins.so`` with CMake + nvcc: find the tools, configure, compile, explain
failures (the cause first), and read what a build used (``attnx_plugins_build.json``)."""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections import deque
from pathlib import Path
from typing import Iterable, Sequence

from .locate import LIBRARY_NAME, _SOURCE_DIR, _is_checkout, default_build_dir, default_output_dir, hooked_library_path

DEFAULT_ARCHS: tuple[str, ...] = ("80", "86", "89", "90", "120")
ENTRY_POINTS: tuple[str, ...] = ("getCreators", "setLoggerFinder")
MIN_CMAKE = (3, 18)


class PluginBuildError(RuntimeError):
    """The plugin library could not be built (missing tool, headers, or a compile error)."""


def find_nvcc() -> Path | None:
    """nvcc from ``$CUDACXX``, ``$CUDA_HOME``/``$CUDA_PATH``, ``PATH`` or /usr/local/cuda."""
    candidates: list[str | None] = [os.environ.get("CUDACXX")]
    for var in ("CUDA_HOME", "CUDA_PATH", "CUDA_ROOT"):
        if os.environ.get(var):
            candidates.append(os.path.join(os.environ[var], "bin", "nvcc"))
    candidates += [shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"]
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return Path(c)
    return None


def _cmake_version(cmake: str) -> tuple[int, ...] | None:
    try:
        out = subprocess.run([cmake, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", out)
    return tuple(int(x) for x in m.groups() if x is not None) if m else None


def find_cmake() -> str | None:
    """cmake on PATH (or next to this Python, e.g. the ``cmake`` wheel)."""
    for c in (shutil.which("cmake"), os.path.join(os.path.dirname(sys.executable), "cmake")):
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


def _normalize_archs(archs: Iterable[str | int] | None) -> list[str]:
    out = []
    for a in (archs or DEFAULT_ARCHS):
        for part in str(a).replace(",", ";").split(";"):
            part = part.strip().lower()
            if not part:
                continue
            m = re.fullmatch(r"(?:sm_?|compute_?)?(\d{2,3}[a-z]?)", part)
            if not m:
                raise PluginBuildError(f"bad CUDA architecture {a!r}: use SM numbers like 89 or sm_89")
            out.append(m.group(1))
    if not out:
        raise PluginBuildError("no CUDA architectures given")
    return list(dict.fromkeys(out))


def _run(cmd: Sequence[str], *, cwd: Path | None, console, log: deque, verbose: bool, env=None) -> int:
    """Run a command, echo progress lines through Rich, keep the output tail in ``log``."""
    proc = subprocess.Popen(list(cmd), cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            bufsize=1, env=env)
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip("\n")
        log.append(line)
        if console is None:
            continue
        if verbose:
            console.print(line, highlight=False, markup=False)
        elif re.match(r"^\[\s*\d+%\]", line) or "attnx plugins:" in line or "error" in line.lower():
            console.print(f"[dim]{_escape(line)}[/dim]", highlight=False)
    return proc.wait()


def _escape(text: str) -> str:
    try:
        from rich.markup import escape
    except ImportError:  # pragma: no cover - rich is a dependency
        return text
    return escape(text)


def _explain_failure(log: Iterable[str]) -> str:
    """The cause first (CMake errors, compiler errors), then the tail of the log."""
    lines = list(log)
    causes: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("CMake Error"):
            body = []
            i += 1
            while i < len(lines) and lines[i].strip() and not lines[i].startswith("Call Stack"):
                body.append(lines[i].strip())
                i += 1
            causes.append(" ".join(body) or line)
            continue
        if re.search(r"\berror\b", line) and ("error:" in line or ": error" in line):
            causes.append(line.strip())
        i += 1
    causes = list(dict.fromkeys(causes))[:12]
    tail = "\n".join(lines[-25:])
    return ("\n".join(causes) + "\n--- last lines of the build log ---\n" + tail) if causes else tail


def configure_command(cmake: str, nvcc: Path, archs: Sequence[str], build_dir: Path, output_dir: Path,
                      tensorrt_include: Path | None = None, build_type: str = "Release") -> list[str]:
    """The CMake configure step of :func:`build` (it writes ``attnx_plugins_build.json``: what the
    build will compile for)."""
    configure = [
        cmake, "-S", str(_SOURCE_DIR), "-B", str(build_dir),
        f"-DCMAKE_BUILD_TYPE={build_type}",
        f"-DCMAKE_CUDA_COMPILER={nvcc}",
        f"-DPython3_EXECUTABLE={sys.executable}",
        f"-DATTNX_CUDA_ARCHS={';'.join(_normalize_archs(archs))}",
        f"-DATTNX_PLUGIN_OUTPUT_DIR={Path(output_dir).resolve()}",
    ]
    if tensorrt_include is not None:
        configure.append(f"-DTENSORRT_INCLUDE_DIR={tensorrt_include}")
    # Warnings are errors in a checkout (development, CI); not for users compiling an installed
    # package with whatever compiler they have. $ATTNX_PLUGINS_WERROR=0/1 overrides.
    werror = os.environ.get("ATTNX_PLUGINS_WERROR", "1" if _is_checkout() else "0").strip().lower()
    configure.append(f"-DATTNX_WERROR={'OFF' if werror in ('0', 'off', 'false', 'no', '') else 'ON'}")
    return configure


def build(*, archs: Iterable[str | int] | None = None, clean: bool = False, tensorrt_include: str | os.PathLike | None = None,
          build_dir: str | os.PathLike | None = None, output_dir: str | os.PathLike | None = None, jobs: int | None = None,
          console=None, verbose: bool = False, build_type: str = "Release") -> Path:
    """Compile ``libattnx_plugins.so`` with CMake + nvcc and return its path.

    ``archs``: SM numbers (default 80, 86, 89, 90, 120; PTX of the lowest is added).
    ``tensorrt_include``: TensorRT's include folder (else ``TENSORRT_INCLUDE_DIR`` /
    ``TensorRT_ROOT`` from the environment, a TensorRT install, or NVIDIA's public headers
    downloaded into the build folder). ``clean`` wipes the build folder first (keeping
    downloaded headers). Incremental otherwise. Raises :class:`PluginBuildError` with the
    cause when cmake, nvcc or the headers are missing or compilation fails.
    """
    cmake = find_cmake()
    if cmake is None:
        raise PluginBuildError("cmake not found: install CMake >= 3.18 (e.g. `apt-get install cmake` or "
                               "`pip install cmake`) and retry")
    version = _cmake_version(cmake)
    if version is not None and version < MIN_CMAKE:
        raise PluginBuildError(f"cmake {'.'.join(map(str, version))} is too old; attnx plugins need >= 3.18")
    nvcc = find_nvcc()
    if nvcc is None:
        raise PluginBuildError("nvcc (the CUDA compiler) not found: install the CUDA toolkit (12.x or 13.x) and put "
                               "nvcc on PATH, or set CUDA_HOME / CUDACXX (e.g. CUDACXX=/usr/local/cuda/bin/nvcc)")
    if tensorrt_include is not None:
        inc = Path(tensorrt_include).expanduser()
        if not (inc / "NvInferRuntime.h").is_file():
            raise PluginBuildError(f"--tensorrt-include {inc} has no NvInferRuntime.h (point it at TensorRT's include folder)")
        tensorrt_include = inc.resolve()
    arch_list = _normalize_archs(archs)
    bdir = Path(build_dir).expanduser() if build_dir else default_build_dir()
    odir = Path(output_dir).expanduser() if output_dir else default_output_dir()
    if clean and bdir.exists():
        for child in bdir.iterdir():
            if child.name == "_deps":
                continue  # downloaded headers: keep (offline rebuilds)
            shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
    bdir.mkdir(parents=True, exist_ok=True)
    odir.mkdir(parents=True, exist_ok=True)

    configure = configure_command(cmake, nvcc, arch_list, bdir, odir, tensorrt_include, build_type)
    jobs = jobs or max(1, os.cpu_count() or 1)
    compile_cmd = [cmake, "--build", str(bdir), "--parallel", str(jobs)]

    log: deque[str] = deque(maxlen=400)
    if console is not None:
        console.print(f"[bold]Building the attnx plugins[/bold] (nvcc {nvcc}, SM {', '.join(arch_list)}) in {bdir}")
    start = time.monotonic()
    if _run(configure, cwd=None, console=console, log=log, verbose=verbose) != 0:
        raise PluginBuildError("configuring the plugin build failed:\n" + _explain_failure(log))
    if _run(compile_cmd, cwd=None, console=console, log=log, verbose=verbose) != 0:
        raise PluginBuildError("compiling the plugins failed:\n" + _explain_failure(log))
    lib = odir / LIBRARY_NAME
    if not lib.is_file():
        raise PluginBuildError(f"the build finished but {lib} is missing:\n" + _explain_failure(log))
    missing = [name for name in ENTRY_POINTS if not _exports(lib, name)]
    if missing:
        raise PluginBuildError(f"{lib} does not export {', '.join(missing)}")
    if console is not None:
        console.print(f"[green]built[/green] {lib} in {time.monotonic() - start:.1f}s")
    return lib


def _exports(lib: Path, symbol: str) -> bool:
    try:
        handle = ctypes.CDLL(str(lib))
    except OSError:
        return False
    return hasattr(handle, symbol)


def build_info(path: str | os.PathLike | None = None) -> dict | None:
    """What the library at ``path`` (default: :func:`library_path`) was built with: TensorRT header
    version and source, CUDA version, architectures (``attnx_plugins_build.json`` next to it)."""
    lib = Path(path) if path else hooked_library_path()
    if lib is None:
        return None
    info = Path(lib).parent / "attnx_plugins_build.json"
    if not info.is_file():
        return None
    try:
        return json.loads(info.read_text())
    except (OSError, ValueError):
        return None
