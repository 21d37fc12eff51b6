"""What the CLI prints into a pipe or a CI log (issue 26, friction): tables whole, never cut to 80 columns
with "…", lines never wrapped mid-number, no spinner line but one plain line per stage of a long command (issue 46:
export, check and quantization said nothing for 10-27 minutes in CI logs and under nohup); and `attnx inspect` knows
attnx's own ops."""

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
    stages = [line for line in run.stderr.splitlines() if line.startswith("check smal.onnx: ")]
    assert len(stages) >= 2 and stages[-1].startswith("check smal.onnx: finished in "), run.stderr
    assert len(set(stages)) == len(stages)  # each stage once, not a line per update


def test_export_into_a_pipe_prints_one_plain_line_per_stage(tmp_path):
    from attnx.cli.export_cmd import STEP_LABELS

    run = piped("export", "--variant", "mha", "--set", "d_model=32", "--set", "n_heads=4", "--layers", "1",
                "-o", tmp_path / "m.onnx", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    out = run.stdout + run.stderr
    assert not any(c in out for c in SPINNER) and "export mha: done" not in out  # no progress bar's lines
    stages = [line.split(": ", 1)[1] for line in run.stderr.splitlines() if line.startswith("export mha: ")]
    assert stages[-1].startswith("finished in ") and all(f"{label} " in stages[-1] for label in stages[:-1])
    assert stages[0] == STEP_LABELS["trace"] and STEP_LABELS["save"] in stages, stages
    assert len(set(stages)) == len(stages), stages  # each stage once, not a line per bytes-written update
    assert str(tmp_path / "m.onnx") in run.stdout
