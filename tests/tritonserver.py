"""A real Triton server for the tests: the ``tritonserver`` binary that nvidia-pytriton bundles (Triton 2.51).

Only the binary is used, not pytriton's Python API. :class:`TritonServer` starts it on free loopback
ports (HTTP, gRPC, metrics) with a model repository, waits until every model is ready, and stops it by
its PID (SIGTERM, then SIGKILL of its process group: the Python-backend stubs are its children), also
when the start fails. What the binary needs, all made under the test's own folder:

- the wheel's bundled libraries on ``LD_LIBRARY_PATH`` (the backend library is copied out of the wheel,
  away from its RPATH);
- a backend folder with the Python backend and the stub built for this Python (the installed wheel is
  not modified);
- a Python environment for the stub, whose ``bin/`` goes first on ``PATH``: the stub's embedded
  interpreter takes its packages from there. Triton 2.51's stub reads numpy 2 arrays wrongly, so this
  environment puts numpy 1.26 (``make venv`` installs it in ``.venv/triton-stub-numpy``) in front of
  this venv's packages.

The server runs on a CPU-only machine: it logs that the CUDA driver is missing and goes on. It has
the Python backend and ensembles, no ONNX Runtime or TensorRT backend.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import site
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def _pytriton_folder() -> Path:
    """Where nvidia-pytriton is installed (found, not imported: its Python API's own dependencies are not
    installed). It is a dev dependency: its absence is an error here, not a skip."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("nvidia-pytriton is not installed (a dev dependency: `make venv` installs it)")
    return Path(list(spec.submodule_search_locations)[0]).resolve()


HOME = _pytriton_folder() / "tritonserver"
LIBS = HOME.parent.parent / "nvidia_pytriton.libs"
STUB_NUMPY = Path(sys.prefix) / "triton-stub-numpy"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stub_python(folder: Path) -> Path:
    """A Python environment for the stub: numpy 1 first, then this venv's packages (``.pth`` lines)."""
    if not (STUB_NUMPY / "numpy").is_dir():
        raise FileNotFoundError(f"{STUB_NUMPY} is missing: run `make venv` (it installs numpy 1.26 there for "
                                "Triton's Python-backend stub)")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True)
    packages = folder / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    ours = [p for p in site.getsitepackages() if Path(p).is_dir()]
    (packages / "attnx-triton-stub.pth").write_text(
        f"{STUB_NUMPY}\n" + "".join(f"import site; site.addsitedir({p!r})\n" for p in ours))
    return folder


def backend_folder(folder: Path) -> Path:
    """Triton's backend folder: the Python backend, with the stub for this Python copied beside it."""
    python = folder / "python"
    python.mkdir(parents=True)
    for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
        shutil.copy2(HOME / "backends" / "python" / name, python / name)
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = HOME / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise FileNotFoundError(f"nvidia-pytriton has no Python-backend stub for Python {version}")
    shutil.copy2(stub, python / stub.name)
    return folder


class TritonServer:
    """``with TritonServer(repo, tmp) as server:`` ``server.http`` / ``server.grpc`` are ``host:port``
    as tritonclient takes them; ``server.log()`` is what it printed."""

    def __init__(self, repository: Path, workdir: Path, *, start_timeout: float = 180.0):
        self.repository, self.workdir, self.start_timeout = Path(repository), Path(workdir), start_timeout
        self.process: subprocess.Popen | None = None
        self.log_path = self.workdir / "tritonserver.log"

    def __enter__(self) -> "TritonServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        backends = backend_folder(self.workdir / "backends")
        python = stub_python(self.workdir / "stub-python")
        self.ports = {"http": free_port(), "grpc": free_port(), "metrics": free_port()}
        env = {**os.environ,
               "LD_LIBRARY_PATH": os.pathsep.join(filter(None, [str(LIBS), os.environ.get("LD_LIBRARY_PATH")])),
               "PATH": os.pathsep.join([str(python / "bin"), os.environ.get("PATH", "")])}
        command = [str(HOME / "bin" / "tritonserver"), f"--model-repository={self.repository}",
                   f"--backend-directory={backends}", "--model-control-mode=none", "--exit-on-error=true",
                   "--strict-readiness=true", "--allow-gpu-metrics=false", "--log-verbose=0",
                   "--exit-timeout-secs=10"]
        for kind, port in self.ports.items():
            command += [f"--{kind}-address=127.0.0.1", f"--{kind}-port={port}"]
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        url = f"http://{self.http}/v2/health/ready"
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"tritonserver exited ({self.process.returncode}) during start-up:\n{self.log()[-4000:]}")
            try:
                with urllib.request.urlopen(url, timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"tritonserver was not ready in {self.start_timeout:.0f} s:\n{self.log()[-4000:]}")

    @property
    def http(self) -> str:
        return f"127.0.0.1:{self.ports['http']}"

    @property
    def grpc(self) -> str:
        return f"127.0.0.1:{self.ports['grpc']}"

    @property
    def metrics(self) -> str:
        return f"http://127.0.0.1:{self.ports['metrics']}/metrics"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.is_file() else ""

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM to the server (it unloads its models and ends their stubs), then SIGKILL to its group."""
        process, self.process = self.process, None
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(process.pid, signal.SIGKILL)  # its own group (start_new_session): stubs left behind too
        except ProcessLookupError:
            pass
        process.wait()
