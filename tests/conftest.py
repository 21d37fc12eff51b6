"""The test infrastructure in one place (what a test gets, and what it costs).

- **Markers** (declared here, acted on here): ``gpu``, ``tensorrt`` (full TensorRT), ``rtx``
  (TensorRT for RTX and the plugin library), ``nvcc``, ``cxx``, ``chromium``, ``git``; one probe each
  (``support/probes.py``). ``gpu`` / ``tensorrt`` tests skip with the probe's reason. The others need
  tools ``make test`` provides: with ``ATTNX_TEST_STRICT=1`` (``make test`` sets it) a missing one
  fails the test instead of skipping it. The summary line counts the skips by reason.
- **Exports** come from one cache on disk (``support/cache.py``) shared by every test, worker and run:
  ``exported(variant, ...)`` (attnx's small encoders), ``minilm_export(variant, ...)`` (the real
  all-MiniLM-L6-v2), ``pretrained_export(folder, ...)`` (any Hugging Face folder). Tests *of* the
  exporter call it themselves and export fresh.
- **The CLI** runs in process (``from support.cli import run as attnx``), real subprocesses
  (``support.cli.subprocess_run``) only where the process is under test.
- **The MiniLM reference** is one sentence-transformers model per process (``st_minilm``).
- Every test runs in its own temporary folder (the working directory), so nothing is written into
  the checkout; under pytest-xdist each worker gets its share of the CPUs and one thread per CPU.
"""

from __future__ import annotations

import collections
import os
import sys
import time
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

from support import cache, exports, probes  # noqa: E402

STRICT = probes.STRICT
MARKERS = {
    "gpu": "needs an NVIDIA GPU (skipped without one)",
    "tensorrt": "needs the full TensorRT package (skipped without it)",
    "rtx": "needs TensorRT for RTX and the plugin library (make test provides both)",
    "nvcc": "needs nvcc and CMake (make test's machine has both)",
    "cxx": "needs a C++ compiler",
    "chromium": "needs Debian's chromium (make test installs it)",
    "git": "needs a git checkout of attnx",
}
#: Not a requirement: the slowest tests (over ~20 s each in .ci/durations.txt), left out of a quick
#: local loop with ``-m "not slow"``; ``make test`` runs them.
SLOW = "slow: among the slowest tests (-m 'not slow' leaves them out of a quick loop; make test runs them)"


# ------------------------------------------------------------------------------------------- workers

def _share_cpus() -> None:
    """Under pytest-xdist, pin each worker to its share of the CPUs so two workers never run more
    threads than there are cores (ONNX Runtime sizes its pool by the affinity mask; torch is told)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not worker or count < 2 or not hasattr(os, "sched_setaffinity"):
        return
    cpus = sorted(os.sched_getaffinity(0))
    index = int(worker.removeprefix("gw"))
    share = cpus[index::count] if len(cpus) >= count else [cpus[index % len(cpus)]]
    os.sched_setaffinity(0, share)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(len(share))
    import torch

    torch.set_num_threads(len(share))


def pytest_configure(config):
    for name, doc in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {doc}")
    config.addinivalue_line("markers", SLOW)
    _share_cpus()
    if not hasattr(config, "workerinput"):  # the controller (or a run without xdist)
        cache.prune()


def pytest_collection_modifyitems(config, items):
    for item in items:
        for name in MARKERS:
            if item.get_closest_marker(name) is None and name not in item.fixturenames:
                continue  # a test asking for the ``rtx`` fixture is marked rtx
            probe, may_skip = probes.PROBES[name]
            reason = probe()
            if reason is None:
                continue
            if may_skip or not STRICT:
                item.add_marker(pytest.mark.skip(reason=reason))
            else:
                item.add_marker(pytest.mark.usefixtures("_missing_tool"))
                item.user_properties.append(("missing_tool", f"{reason} (ATTNX_TEST_STRICT=1: a missing tool fails)"))


@pytest.fixture
def _missing_tool(request):
    pytest.fail(dict(request.node.user_properties)["missing_tool"], pytrace=False)


_DURATIONS: dict[str, float] = collections.defaultdict(float)
_STARTED: list[float] = []


def pytest_sessionstart(session):
    _STARTED.append(time.time())


def pytest_runtest_logreport(report):
    _DURATIONS[report.nodeid] += report.duration


def _write_durations(path: str, config) -> None:
    """Every test's seconds (setup + call + teardown), slowest first: ``make test`` keeps
    ``.ci/durations.txt`` current this way."""
    wall = time.time() - _STARTED[0]
    workers = getattr(config.option, "numprocesses", None) or 1
    lines = [f"# seconds per test (setup + call + teardown), slowest first: {len(_DURATIONS)} tests, "
             f"{sum(_DURATIONS.values()):.0f} s in all over {workers} worker(s), {wall:.0f} s wall "
             f"({time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs)"]
    lines += [f"{d:8.2f}  {nodeid}" for nodeid, d in sorted(_DURATIONS.items(), key=lambda kv: -kv[1])]
    Path(path).write_text("\n".join(lines) + "\n")


def pytest_terminal_summary(terminalreporter, config):
    if os.environ.get("ATTNX_TEST_DURATIONS") and not hasattr(config, "workerinput") and _DURATIONS:
        _write_durations(os.environ["ATTNX_TEST_DURATIONS"], config)
    skipped = terminalreporter.stats.get("skipped", [])
    if not skipped:
        return
    reasons = collections.Counter()
    for report in skipped:
        longrepr = report.longrepr
        reasons[longrepr[2].removeprefix("Skipped: ") if isinstance(longrepr, tuple) else str(longrepr)] += 1
    terminalreporter.write_line(f"{len(skipped)} skipped, by reason:")
    for reason, n in reasons.most_common():
        terminalreporter.write_line(f"  {n:4d}  {reason}")


@pytest.fixture(autouse=True)
def _work_in_tmp(tmp_path, monkeypatch):
    """Each test's working folder is its own tmp folder: relative outputs (attnx-out/) land there."""
    monkeypatch.chdir(tmp_path)


# ------------------------------------------------------------------------------------------- exports

@pytest.fixture(scope="session")
def exported():
    """``exported(variant, lowering="plugin", fp16=False, n_layers=2, **overrides) -> CachedExport``:
    attnx's own small encoder (d_model 32, 4 heads unless overridden), from the export cache."""
    return exports.variant


@pytest.fixture(scope="session")
def pretrained_export():
    """``pretrained_export(folder, variant="mha", name=None, **kw) -> CachedExport``: ``attnx export
    --from-pretrained folder`` (keyword arguments of ``export_pretrained``), from the export cache."""
    return exports.pretrained


@pytest.fixture(scope="session")
def minilm_export():
    """``minilm_export(variant="mha", **kw) -> CachedExport``: the real all-MiniLM-L6-v2 with ``variant``
    placed (``lowering``, ``fp16``, ``layers``, ``attention_outputs``, ...: keyword arguments of
    ``export_pretrained``), from the export cache."""
    return exports.minilm


@pytest.fixture(scope="session")
def st_minilm():
    """sentence-transformers' own all-MiniLM-L6-v2 (the reference every text test compares with)."""
    return exports.minilm_reference()


# ------------------------------------------------------------------------------------------- other

@pytest.fixture(scope="session")
def plugin_lib() -> Path:
    """The built attnx plugin library (``make test`` builds it first; built here when missing)."""
    from attnx import plugins

    path = plugins.library_path()
    if path is None:
        probes.require(probes.nvcc())
        path = plugins.build()
    return path


@pytest.fixture(scope="session")
def rtx():
    """The TensorRT backend (TensorRT for RTX here); asking for it marks the test ``rtx``."""
    from attnx import engine

    return engine.backend()


@pytest.fixture(scope="module")
def toy_registered():
    """The toy variant (tests/toy_variant.py) registered for the module that asks, and unregistered after."""
    import importlib

    import toy_variant

    from attnx.models.spec import unregister, variant_names

    if "toy" not in variant_names():
        importlib.reload(toy_variant)
    yield
    unregister("toy")
