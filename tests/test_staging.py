"""Issue 33: an export's files (and an engine with its sidecar) become visible as a whole, or not at all.

:mod:`attnx.export.staging` on its own, without an export in front of it: a process killed with SIGKILL
just before *each* filesystem step of a commit (every rename, exchange, link and removal it makes), in
each of the layouts it commits (files among others: an export, an engine and its sidecar; a with-past
folder exchanged whole, or moved in two renames where the filesystem cannot exchange), leaves the
previous complete export or the new one under the final names; the next run finishes or removes what
the killed one left, and no debris stays. ``tests/test_export_scale.py`` kills real exports at 20
moments of their run; here every step of the commit, where the files change, is hit.

An engine whose write fails (the file size limit reached part-way through the plan, as a full disk
does) leaves the previous engine and sidecar and no partial file.
"""

from __future__ import annotations

import importlib
import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from support.cli import ROOT

#: The child loads staging.py by its path: stdlib only, so each of the many runs starts in milliseconds.
CHILD = r"""
import importlib.util, json, os, signal, sys
from pathlib import Path

spec = importlib.util.spec_from_file_location("staging_under_test", sys.argv[1])
staging = importlib.util.module_from_spec(spec)
spec.loader.exec_module(staging)
scenario, kill_at = json.loads(sys.argv[2]), int(sys.argv[3])
steps = 0

def counted(fn):
    def step(*args, **kwargs):
        global steps
        steps += 1
        if steps == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return fn(*args, **kwargs)
    return step

for name in ("replace", "rename", "link", "unlink", "rmdir"):
    setattr(os, name, counted(getattr(os, name)))
exchange = staging._exchange if scenario["exchange"] else (lambda a, b: False)
staging._exchange = counted(exchange)

with staging.Staging(scenario["target"], folder=scenario["folder"], owned=scenario["owned"]) as stage:
    for rel, text in scenario["new"].items():
        path = stage.path(rel)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    stage.commit()
print(steps)
"""

EXPORT_OLD = {"m.onnx": "old", "m.onnx.data": "old", "m.safetensors": "old", "m.tokenizer/tokenizer.json": "old"}
EXPORT_NEW = {"m.onnx": "new", "m.safetensors": "new", "m.tokenizer/tokenizer.json": "new"}  # no external data
ENGINE_OLD = {"e.engine": "old", "e.engine.json": "old"}
ENGINE_NEW = {"e.engine": "new", "e.engine.json": "new"}
FOLDER_OLD = {"model.onnx": "old", "model.safetensors": "old", "genai_config.json": "old", "tokenizer.json": "old",
              "model.tokenizer/tokenizer.json": "old"}
FOLDER_NEW = {"model.onnx": "new", "model.safetensors": "new", "genai_config.json": "new", "tokenizer.json": "new",
              "model.tokenizer/tokenizer.json": "new"}
#: Beside the export and not its own: must stay untouched (another export; an engine built in the folder).
BYSTANDER = {"other.onnx": "theirs"}
FOREIGN = {"model.engine": "built here"}

SCENARIOS = {
    "export files": dict(primary="m.onnx", folder=False, exchange=True, old=EXPORT_OLD, new=EXPORT_NEW,
                         owned=["m.onnx", "m.onnx.data", "m.safetensors", "m.tokenizer"]),
    "engine and sidecar": dict(primary="e.engine", folder=False, exchange=True, old=ENGINE_OLD, new=ENGINE_NEW,
                               owned=["e.engine", "e.engine.json"]),
    "with-past folder, exchanged": dict(primary="wp", folder=True, exchange=True, old=FOLDER_OLD, new=FOLDER_NEW,
                                        owned=sorted({p.split("/")[0] for p in FOLDER_NEW})),
    "with-past folder, two renames": dict(primary="wp", folder=True, exchange=False, old=FOLDER_OLD,
                                          new=FOLDER_NEW, owned=sorted({p.split("/")[0] for p in FOLDER_NEW})),
}


def _write(root: Path, files: dict) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def _files(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_text() for p in sorted(root.rglob("*")) if p.is_file()}


def _generation(dest: Path, sc: dict) -> str | None:
    """``old`` or ``new`` where the final names hold that whole export (and the bystanders untouched);
    None where no model is there (only between the renames of a commit, until the next run)."""
    from attnx.export.staging import MARK

    final = {k: v for k, v in _files(dest).items() if MARK not in k.split("/")[0]}
    if sc["folder"]:
        inside = {k.split("/", 1)[1]: v for k, v in final.items() if k.startswith("wp/")}
        outside = {k: v for k, v in final.items() if not k.startswith("wp/")}
        assert outside == BYSTANDER, outside
        if not inside:
            return None
        gen = inside.get("model.onnx")
        assert gen in ("old", "new"), inside
        assert inside == {**(sc["old"] if gen == "old" else sc["new"]), **FOREIGN}, inside  # whole, and theirs kept
        return gen
    model = final.get(sc["primary"])
    if model is None:
        return None
    assert final == {**(sc["old"] if model == "old" else sc["new"]), **BYSTANDER}, final
    return model


def _run(dest: Path, sc: dict, kill_at: int) -> subprocess.CompletedProcess:
    scenario = {"target": str(dest / sc["primary"]), "folder": sc["folder"], "exchange": sc["exchange"],
                "owned": sc["owned"], "new": sc["new"]}
    return subprocess.run([sys.executable, "-c", CHILD, str(ROOT / "export" / "staging.py"), json.dumps(scenario),
                           str(kill_at)], capture_output=True, text=True, timeout=60)


def _prepare(dest: Path, sc: dict) -> None:
    _write(dest, BYSTANDER)
    if sc["folder"]:
        _write(dest / "wp", {**sc["old"], **FOREIGN})
    else:
        _write(dest, sc["old"])


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_kill_9_before_every_step_of_a_commit(tmp_path, name):
    from attnx.export.staging import MARK, clean_stale

    sc = SCENARIOS[name]
    # a run left alone: how many steps it takes, and the new export in place of the old
    dest = tmp_path / "clean"
    _prepare(dest, sc)
    done = _run(dest, sc, 0)
    assert done.returncode == 0, done.stderr
    steps = int(done.stdout.strip())
    assert _generation(dest, sc) == "new" and not [p for p in dest.iterdir() if MARK in p.name]
    assert steps >= 4, steps

    outcomes = []
    for kill_at in range(1, steps + 1):
        dest = tmp_path / f"kill-{kill_at}"
        _prepare(dest, sc)
        proc = _run(dest, sc, kill_at)
        assert proc.returncode == -signal.SIGKILL, (kill_at, proc.returncode, proc.stderr)
        right_after = _generation(dest, sc)  # checks what is there: a whole export, never a mix
        assert clean_stale(dest) or right_after is not None  # the next run finishes or removes the staging
        after = _generation(dest, sc)
        assert after in ("old", "new"), (kill_at, _files(dest))
        assert (right_after, after) != ("new", "old"), kill_at  # a visible new export is never taken back
        assert not [p for p in dest.iterdir() if MARK in p.name], (kill_at, sorted(os.listdir(dest)))  # no debris
        outcomes.append((right_after, after))
    # killed before the commit began: the old export; killed once it is decided (its journal written):
    # the new one, finished by the next run
    afters = [a for _, a in outcomes]
    assert afters[0] == "old" and afters[-1] == "new", outcomes
    assert afters == sorted(afters, key=["old", "new"].index), outcomes  # once new, never back


# --------------------------------------------------------------------------- build-engine's write

@pytest.fixture
def file_size_limit():
    """Set RLIMIT_FSIZE (writes past it fail with EFBIG, as writes on a full disk fail with ENOSPC) for the
    duration of a ``with``; restored after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the error, not the signal's default kill

    class Limit:
        def __init__(self, nbytes):
            self.nbytes = nbytes

        def __enter__(self):
            resource.setrlimit(resource.RLIMIT_FSIZE, (self.nbytes, hard))

        def __exit__(self, *exc):
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))

    try:
        yield Limit
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


def test_an_engine_write_that_fails_leaves_the_previous_engine(tmp_path, monkeypatch, file_size_limit):
    """``attnx build-engine`` writes the plan and its sidecar through :func:`attnx.engine.build.write_engine`:
    a write that fails part-way (the plan, then the sidecar) leaves the previous engine and sidecar as they
    were and no partial file (before issue 33: a partial ``e.engine.tmp``). Without TensorRT here, the plan is
    bytes; the build itself is covered by the rtx tests."""
    engine_build = importlib.import_module("attnx.engine.build")  # the module (attnx.engine.build is also a function)

    out = tmp_path / "out" / "e.engine"
    engine_build.write_engine(out, b"old plan", {"engine": "e.engine", "engine_bytes": 8})
    before = _files(tmp_path)
    assert sorted(before) == ["out/e.engine", "out/e.engine.json"]

    with file_size_limit(64 * 1024), pytest.raises(OSError) as failed:  # the plan's write stops at 64 KiB
        engine_build.write_engine(out, b"\x01" * (1 << 20), {"engine": "e.engine", "engine_bytes": 1 << 20})
    assert failed.value.errno == 27  # EFBIG: the write itself failed, part-way
    assert _files(tmp_path) == before

    def sidecar_fails(engine, data):  # the plan is written, then the disk is full
        Path(str(engine) + ".json").write_text('{"half')
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(engine_build, "write_sidecar", sidecar_fails)
    with pytest.raises(OSError, match="No space left"):
        engine_build.write_engine(out, b"new plan", {"engine": "e.engine", "engine_bytes": 8})
    assert _files(tmp_path) == before
    monkeypatch.undo()

    engine_build.write_engine(out, b"new plan", {"engine": "e.engine", "engine_bytes": 8})
    assert (out.parent / "e.engine").read_bytes() == b"new plan"
    assert json.loads((out.parent / "e.engine.json").read_text())["engine_bytes"] == 8
    assert sorted(os.listdir(out.parent)) == ["e.engine", "e.engine.json"]
