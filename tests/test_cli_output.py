"""What the CLI prints into a pipe or a CI log (issue 26, friction): tables whole, never cut to 80 columns
with "…", lines never wrapped mid-number, no spinner line; and `attnx inspect` knows attnx's own ops."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from support.cli import subprocess_run

SPINNER = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"


def piped(*args, cwd: Path) -> subprocess.CompletedProcess:
    """The CLI as a real process with stdout and stderr going to pipes and no COLUMNS: what a CI job sees
    (the console's width is decided when the process starts, so only a process shows it)."""
    return subprocess_run(*args, cwd=cwd, unset=("COLUMNS", "LINES"))


@pytest.fixture(scope="module")
def smal(exported, tmp_path_factory):
    res = exported("smal", n_layers=1)
    folder = tmp_path_factory.mktemp("cli-out")
    shutil.copy(res.path, folder / "smal.onnx")
    shutil.copy(res.weights_path, folder / res.info.weights)
    return folder / "smal.onnx"


def test_inspect_into_a_pipe_prints_whole_rows_and_registered_schemas(smal, tmp_path):
    run = piped("inspect", smal, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "…" not in run.stdout  # rich cut nothing
    config = next(line for line in run.stdout.splitlines() if "attnx.config" in line)
    assert '"variant": "smal"' in config and len(config) > 160  # the value's first 157 characters, on one line
    row = next(line for line in run.stdout.splitlines() if "attnx::SmalAttention" in line)
    assert row.split("│")[4].strip() == "yes", row  # the schema column: registered before the lookup
    info = json.loads(piped("inspect", smal, "--json", cwd=tmp_path).stdout)
    assert [c["schema"] for c in info["custom_ops"]] == [True]


def test_check_into_a_pipe_keeps_every_line_whole_and_draws_no_spinner(smal, tmp_path):
    run = piped("check", smal, "--no-engine", cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout + run.stderr
    assert "…" not in out and not any(c in out for c in SPINNER)
    tolerances = next(line for line in run.stdout.splitlines() if line.startswith("tolerances"))
    assert tolerances.rstrip().endswith("mean abs <= 1e-05"), tolerances  # one line, not wrapped at 80
    assert any(line.startswith("PASS") for line in run.stdout.splitlines())


def test_export_into_a_pipe_prints_no_progress_line(tmp_path):
    run = piped("export", "--variant", "mha", "--set", "d_model=32", "--set", "n_heads=4", "--layers", "1",
                "-o", tmp_path / "m.onnx", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    out = run.stdout + run.stderr
    assert not any(c in out for c in SPINNER) and "export mha: done" not in out
    assert str(tmp_path / "m.onnx") in run.stdout
