"""The package layers of docs/architecture.md, checked with import-linter (issue 31).

The contracts live in pyproject.toml (``[tool.importlinter]``): each package imports only the layers
below it (siblings written ``a | b`` not each other), function-local imports included, serving
(runtime, explain, deploy) never imports torch or transformers, and inside every package the modules
of one level import each other without a cycle (issue 47: a helper both sides need goes to a leaf module).

grimp, import-linter's graph builder, reads the package from ``src/attnx`` as it is in the checkout
(each top-level folder is linked there, issue 47). The probes, which must add a module, run on an
overlay: a temporary ``attnx`` whose entries link to the checkout's, the probed package a folder of
links plus the probe.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


SRC = ROOT / "src"


def overlay(dest: Path, *probed: str) -> Path:
    """A package tree under ``dest`` that reads the checkout's files through links, with real folders for
    the ``probed`` packages (``attnx/models``: links to each entry) so a probe module can be added there."""
    package = dest / "attnx"
    package.mkdir(parents=True)
    for entry in (SRC / "attnx").iterdir():
        if entry.name not in probed and entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry.resolve())
    for name in probed:
        (package / name).mkdir()
        for entry in (SRC / "attnx" / name).resolve().iterdir():
            if entry.name != "__pycache__":
                (package / name / entry.name).symlink_to(entry)
    return dest


def lint_imports(tree: Path) -> tuple[int, str]:
    """``lint-imports`` with pyproject's contracts over ``tree``: (exit status, report)."""
    code = ("import sys; from importlinter.cli import lint_imports; "
            "sys.exit(lint_imports(config_filename=sys.argv[1], no_cache=True, no_logo=True))")
    env = {**os.environ, "PYTHONPATH": str(tree), "COLUMNS": "200"}
    run = subprocess.run([sys.executable, "-c", code, str(ROOT / "pyproject.toml")], cwd=tree, env=env,
                         capture_output=True, text=True, timeout=300)
    return run.returncode, run.stdout + run.stderr


def test_every_package_imports_only_the_layers_below_it():
    status, report = lint_imports(SRC)
    assert status == 0, report
    for name in ("attnx's packages import only the layers below them",
                 "Serving and the explain page never import torch or transformers",
                 "runtime's layers import only the layers below them",
                 "no cycles between sibling modules"):
        assert re.search(rf"{re.escape(name)} KEPT", report), report
    assert "Contracts: 4 kept, 0 broken." in report, report


def test_an_upward_import_inside_a_function_is_reported(tmp_path):
    """The check can fail: a model module that imports the runtime, only when a function runs."""
    tree = overlay(tmp_path, "models")
    (tree / "attnx" / "models" / "_layer_probe.py").write_text(
        "def probe():\n    from attnx.runtime.core.loading import load\n\n    return load\n")
    status, report = lint_imports(tree)
    assert status != 0
    assert "attnx's packages import only the layers below them BROKEN" in report, report
    assert "attnx.models is not allowed to import attnx.runtime" in report, report
    assert "attnx.models._layer_probe -> attnx.runtime.core.loading (l.2)" in report, report


def test_a_cycle_between_siblings_and_torch_in_serving_are_reported(tmp_path):
    """Independent siblings stay independent (parity may not import deploy), and a function-local torch
    import in the runtime breaks the serving contract."""
    tree = overlay(tmp_path, "parity", "runtime")
    (tree / "attnx" / "parity" / "_layer_probe.py").write_text("import attnx.deploy.loadtest\n")
    (tree / "attnx" / "runtime" / "_layer_probe.py").write_text("def probe():\n    import torch\n\n    return torch\n")
    status, report = lint_imports(tree)
    assert status != 0
    assert "attnx.parity is not allowed to import attnx.deploy" in report, report
    assert "attnx.parity._layer_probe -> attnx.deploy.loadtest (l.1)" in report, report
    assert "Serving and the explain page never import torch or transformers BROKEN" in report, report
    assert "attnx.runtime._layer_probe -> torch (l.2)" in report, report


def test_the_core_importing_the_wire_is_reported(tmp_path):
    """runtime's inner layers (server > config > apis > serving > wire > core): a core module that names the
    wire breaks them. The probe goes in ``runtime/core``, made a folder of links on the overlay too."""
    tree = overlay(tmp_path, "runtime")
    core = tree / "attnx" / "runtime" / "core"
    core.unlink()  # a link to the checkout's core: replaced, so the probe is never written into the checkout
    core.mkdir()
    for entry in (SRC / "attnx" / "runtime" / "core").resolve().iterdir():
        if entry.name != "__pycache__":
            (core / entry.name).symlink_to(entry)
    (core / "_layer_probe.py").write_text("from attnx.runtime.wire.errors import KSERVE\n")
    status, report = lint_imports(tree)
    assert status != 0
    assert "runtime's layers import only the layers below them BROKEN" in report, report
    assert "attnx.runtime.core is not allowed to import attnx.runtime.wire" in report, report
    assert "attnx.runtime.core._layer_probe -> attnx.runtime.wire.errors (l.1)" in report, report
    # The package layers still hold: the probe breaks only the runtime's own.
    assert "attnx's packages import only the layers below them KEPT" in report, report


def test_two_modules_of_one_package_importing_each_other_are_a_cycle(tmp_path):
    """The check can fail: a helper that imports back the module orchestrating it, even inside a function."""
    tree = overlay(tmp_path, "parity")
    (tree / "attnx" / "parity" / "_cycle_run.py").write_text(
        "from attnx.parity._cycle_helper import helper\n\n\ndef run():\n    return helper()\n")
    (tree / "attnx" / "parity" / "_cycle_helper.py").write_text(
        "def helper():\n    from attnx.parity._cycle_run import run\n\n    return run\n")
    status, report = lint_imports(tree)
    assert status != 0
    assert "no cycles between sibling modules BROKEN" in report, report
    assert "No cycles are allowed in attnx.parity." in report, report
    assert re.search(r"- \._cycle_(run -> \._cycle_helper|helper -> \._cycle_run) \(1 import\)", report), report


def test_a_new_package_must_be_given_a_layer(tmp_path):
    tree = overlay(tmp_path)
    (tree / "attnx" / "newstep").mkdir()
    (tree / "attnx" / "newstep" / "__init__.py").write_text("")
    status, report = lint_imports(tree)
    assert status != 0
    assert "The following modules are not listed as layers" in report and "- attnx.newstep" in report, report


def test_the_architecture_doc_lists_the_checked_layers():
    """docs/architecture.md's layer table is the contract's, in the same order (top first)."""
    layers = next(c for c in CONFIG["tool"]["importlinter"]["contracts"] if c["id"] == "layers")["layers"]
    doc = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    block = re.search(r"<!-- layers: checked by tests/test_layers.py -->\n```\n(.*?)```", doc, re.S)
    assert block, "docs/architecture.md has no layer block"
    listed = [re.split(r"\s{2,}", line.strip())[0] for line in block.group(1).splitlines() if line.strip()]
    assert listed == layers


def test_the_architecture_doc_lists_the_runtime_layers():
    """docs/architecture.md's block of the runtime's inner layers is the runtime-layers contract's, top first."""
    layers = next(c for c in CONFIG["tool"]["importlinter"]["contracts"] if c["id"] == "runtime-layers")["layers"]
    doc = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    block = re.search(r"<!-- runtime layers: checked by tests/test_layers.py -->\n```\n(.*?)```", doc, re.S)
    assert block, "docs/architecture.md has no block of the runtime's layers"
    listed = [line.split()[0] for line in block.group(1).splitlines() if line.strip()]
    assert listed == layers
