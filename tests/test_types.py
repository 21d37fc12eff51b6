"""Types, checked in ``make test``: mypy with pyproject's ``[tool.mypy]`` over its checked set (``attnx.contract``,
``attnx.feeds``, ``attnx.runtime``; docs/architecture.md, "Types") reports no error, in the checkout as it is; and
the check can fail: a runtime module with a type error is reported, on an overlay (``test_layers.overlay``: a
temporary ``attnx`` of links to the checkout's files, ``runtime`` a folder of links plus the probe).

mypy's cache lives outside the checkout (``$ATTNX_MYPY_CACHE``, default ``~/.cache/attnx/mypy``): a warm run reads
again only what changed (seconds); a cold one parses the checked set and what it imports (numpy, FastAPI, pydantic,
... : about 20 s of CPU here). The overlay's files are the checkout's, so its run is warm too.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from test_layers import CONFIG, overlay

ROOT = Path(__file__).resolve().parents[1]
CHECKED = ("attnx.contract", "attnx.feeds", "attnx.runtime")


def cache_dir() -> Path:
    root = os.environ.get("ATTNX_MYPY_CACHE") or Path.home() / ".cache" / "attnx" / "mypy"
    return Path(root)


def mypy(cwd: Path, search_path: Path | None = None) -> tuple[int, str]:
    """``python -m mypy`` with pyproject's configuration (its checked set) in ``cwd``: (exit status, report).
    ``search_path``: a tree whose ``attnx`` is found before the checkout's ``src/attnx`` (MYPYPATH comes first)."""
    env = {k: v for k, v in os.environ.items() if k != "MYPYPATH"}
    if search_path is not None:
        env["MYPYPATH"] = str(search_path)
    run = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
                          "--cache-dir", str(cache_dir()), "--no-color-output", "--no-pretty"],
                         cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    return run.returncode, run.stdout + run.stderr


def module_count(package_root: Path) -> int:
    """How many modules the checked set holds: contract.py, feeds.py and every module under runtime/ (links
    followed, as mypy follows them)."""
    return 2 + sum(name.endswith(".py") for _, _, names in os.walk(package_root / "runtime", followlinks=True)
                   for name in names)


def checked(report: str) -> int:
    """The number of source files mypy's summary line says it checked."""
    found = re.search(r"(?:checked|found in) (\d+) source files?\)?$", report.strip())
    assert found, report
    return int(found.group(1))


def test_the_checked_set_has_no_type_errors():
    status, report = mypy(ROOT)
    assert status == 0, report
    # Every module of the checked set was read: mypy resolved attnx.* from the plain checkout (src/attnx).
    assert checked(report) >= module_count(ROOT / "src" / "attnx"), report


def test_the_configuration_names_the_checked_set():
    """The packages the docs and this test speak of are the ones pyproject gives mypy."""
    assert tuple(CONFIG["tool"]["mypy"]["packages"]) == CHECKED
    doc = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = re.search(r"^## Types\n(.*?)^## ", doc, re.S | re.M)
    assert section, "docs/architecture.md has no Types section"
    assert all(f"`{name}`" in section.group(1) for name in CHECKED), section.group(1)


PROBE = '''"""A tokenizer's max length, used as if every tokenizer had one."""

from attnx.runtime.core.text import TextTokenizer


def with_special_tokens(tokenizer: TextTokenizer) -> int:
    return tokenizer.max_length + 2
'''


def test_a_type_error_in_a_new_runtime_module_is_reported(tmp_path):
    """The check can fail: a new module under runtime/ is in the checked set (no list to add it to), and the
    types it meets are the real ones (``TextTokenizer.max_length`` may be None)."""
    tree = overlay(tmp_path, "runtime")
    (tree / "attnx" / "runtime" / "_type_probe.py").write_text(PROBE)
    status, report = mypy(tree, search_path=tree)
    assert status == 1, report
    probe = [line for line in report.splitlines() if line.startswith("attnx/runtime/_type_probe.py:7: error:")]
    assert probe == ['attnx/runtime/_type_probe.py:7: error: Unsupported operand types for + ("None" and "int")  '
                     '[operator]'], report
    assert checked(report) >= module_count(tree / "attnx"), report
