"""The tests' export cache (tests/support/cache.py): an entry is made once per key, and pruning keeps
what this checkout's exporter can still use."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from support import cache

DAY = 24 * 3600


def _entry(root: Path, name: str, code: str, age: float, now: float) -> Path:
    path = root / name
    path.mkdir()
    (path / "key.json").write_text(json.dumps({"name": "m.onnx", "key": {}, "code": code}))
    os.utime(path, (now - age, now - age))
    return path


def test_an_entry_is_made_once_per_key_and_appears_whole(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNX_TEST_CACHE", str(tmp_path / "cache"))
    made = []

    def make(out: Path) -> None:
        made.append(out)
        out.write_text("an export")

    first = cache.entry("m.onnx", make, kind="test", options={"a": 1})
    again = cache.entry("m.onnx", make, kind="test", options={"a": 1})
    other = cache.entry("m.onnx", make, kind="test", options={"a": 2})
    assert first == again != other and len(made) == 2 and first.read_text() == "an export"
    assert json.loads((first.parent / "key.json").read_text())["code"] == cache.code_hash()
    assert not list((tmp_path / "cache").glob(".staging-*"))


def test_prune_drops_old_entries_and_a_day_old_ones_of_other_exporter_sources(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNX_TEST_CACHE", str(tmp_path))
    now = time.time()
    ours = cache.code_hash()
    kept = [_entry(tmp_path, "ours-2d", ours, 2 * DAY, now), _entry(tmp_path, "other-1h", "0" * 16, 3600, now)]
    gone = [_entry(tmp_path, "ours-8d", ours, 8 * DAY, now), _entry(tmp_path, "other-2d", "0" * 16, 2 * DAY, now),
            _entry(tmp_path, ".staging-x", ours, 2 * 3600, now)]
    cache.prune(now)
    assert all(p.is_dir() for p in kept) and not any(p.exists() for p in gone)


def test_the_code_key_follows_the_code_not_its_comments_or_layout():
    code = 'def f(x):\n    """Doubles."""\n    return 2 * x\n'
    same = '# a note\ndef f(x):  # why\n    """Doubles."""\n    return (2 *\n            x)\n'
    assert cache.source_digest(code) == cache.source_digest(same)
    assert cache.source_digest(code) != cache.source_digest(code.replace("2 * x", "3 * x"))
    assert cache.source_digest(code) != cache.source_digest(code.replace("Doubles.", "Twice."))  # code may read it
