"""Building attnx as pip does prints no setuptools deprecation boxes (issue 26, friction: the license
table, the plugin sources shipped as package data), and the wheel still carries every plugin source
`attnx plugins build` compiles."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_wheel_builds_without_deprecation_warnings_and_ships_the_plugin_sources(tmp_path):
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split("\n")
    src = tmp_path / "src"
    for name in filter(None, files):
        if (ROOT / name).is_symlink():  # src/attnx's links to the top-level folders
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            (src / name).symlink_to(os.readlink(ROOT / name))
        elif (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    run = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
                          "-w", str(tmp_path / "dist"), "-v"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    log = run.stdout + run.stderr
    assert "!!" not in log and "deprecated" not in log.lower() and "absent from the `packages`" not in log, \
        [line for line in log.splitlines() if "Warning" in line][:5]
    wheel = next((tmp_path / "dist").glob("attnx-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {n for n in names if n.startswith("attnx/plugins/") and not n.endswith(".py")}
    want = {"attnx/plugins/" + str(p.relative_to(ROOT / "plugins")) for p in (ROOT / "plugins").rglob("*")
            if p.suffix in (".cu", ".cuh", ".cpp", ".h", ".cmake") and "build" not in p.parts
            and p.relative_to(ROOT).as_posix() in files}
    assert want and want | {"attnx/plugins/CMakeLists.txt"} <= shipped
    assert "attnx/runtime/wire/http_guard.py" in names and "attnx/contract.py" in names
    meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
    assert "License-Expression: Apache-2.0" in zipfile.ZipFile(wheel).read(meta).decode()
