"""An export's files become visible as a whole, or not at all.

Every file is written into a staging folder beside the destination (the same filesystem, so renames
move it), ``.<name>.attnx-staging-<pid>``, locked (``flock``) while its run lives. Then :meth:`Staging.commit`:

- an export that is a folder (``--with-past``: model, weights, tokenizer, ``genai_config.json``) is
  exchanged with the previous folder in one step (``renameat2(RENAME_EXCHANGE)``, Linux; elsewhere two
  renames, between which the folder is absent). What the previous folder held that the export does
  not write (an engine built there, a report) is carried into the new one by hard links.
- files among others (``m.onnx``, ``m.onnx.data``, ``m.safetensors``, ``m.tokenizer/`` in a shared
  ``attnx-out/``): the previous model file leaves first, its companions are replaced, the new model
  file comes last. A journal lets a later run finish a commit that was killed halfway; until then no
  model file is there, never one beside another export's companions.

A staging folder whose lock is free was left by a run that died: the next run writing into that
folder finishes its commit (journal) or removes it. :func:`check_room` and the staging folder's
creation refuse an unwritable destination, or one without room, before any work.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
from pathlib import Path
from typing import Iterable

try:
    import fcntl
except ImportError:  # not POSIX: a staging folder is stale when its process is gone
    fcntl = None

MARK = ".attnx-staging-"
_LOCK, _JOURNAL, _NEW, _OLD = ".lock", "commit.json", "new", "old"


class NoRoom(ValueError):
    """The destination cannot take the export (unwritable, or not enough free space): one line for the user."""


def _human(n: float) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.0f} MB"


def prepare_dir(folder: Path) -> Path:
    """``folder`` created (with its parents) and writable, else :class:`NoRoom` in one line."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise NoRoom(f"cannot write to {folder}: a file of that name is in the way") from None
    except OSError as e:
        raise NoRoom(f"cannot create {folder}: {e.strerror or e}") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise NoRoom(f"cannot write to {folder}: permission denied")
    return folder


def check_room(folder: Path, needed: int, what: str = "the export") -> None:
    """:class:`NoRoom` when ``folder``'s filesystem has less than ``needed`` bytes (+5%) free."""
    try:
        st = os.statvfs(folder)
    except (AttributeError, OSError):  # no statvfs (Windows): the write itself will say
        return
    free = st.f_bavail * st.f_frsize
    if free < needed * 1.05:
        raise NoRoom(f"not enough room in {folder}: {what} needs about {_human(needed)}, {_human(free)} is free")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _locked_by_other(staging: Path) -> bool:
    """True while the run that owns ``staging`` lives."""
    lock = staging / _LOCK
    if fcntl is None or not lock.exists():
        try:
            return _alive(int(staging.name.rsplit(MARK, 1)[1]))
        except (IndexError, ValueError):
            return False
    try:
        fd = os.open(lock, os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # closing releases the lock we may have taken
    return False


def clean_stale(folder: Path) -> list[Path]:
    """Finish or remove the staging folders in ``folder`` that runs which died left; returns them."""
    cleaned = []
    if not folder.is_dir():
        return cleaned
    for staging in folder.glob(f".*{MARK}*"):
        if not staging.is_dir() or _locked_by_other(staging):
            continue
        journal = staging / _JOURNAL
        if journal.is_file():
            try:
                _roll_forward(staging, json.loads(journal.read_text()))
            except (OSError, ValueError, KeyError):
                pass  # a journal we cannot act on: remove the staging folder, the destination stays as it is
        shutil.rmtree(staging, ignore_errors=True)
        cleaned.append(staging)
    return cleaned


# --------------------------------------------------------------------------- renames

def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux ``renameat2(RENAME_EXCHANGE)``); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    AT_FDCWD, RENAME_EXCHANGE = -100, 2
    if renameat2(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _move_aside(path: Path, old: Path) -> None:
    """``path`` (a final name) into the staging folder's ``old/``, which is removed with it."""
    if path.exists() or path.is_symlink():
        old.mkdir(exist_ok=True)
        target = old / path.name
        if target.exists() or target.is_symlink():
            _remove(target)
        os.replace(path, target)


def _roll_forward(staging: Path, journal: dict) -> None:
    """The renames of a files commit, each done only if not done yet (a killed commit resumes here)."""
    folder, new, old = Path(journal["folder"]), staging / _NEW, staging / _OLD
    primary = journal["primary"]
    if journal.get("kind") == "folder":
        final = folder / journal["name"]
        if new.exists() and not final.exists():
            os.rename(new, final)
        return
    if (new / primary).exists():
        _move_aside(folder / primary, old)  # the previous model file leaves first
    for name in journal["companions"]:
        if (new / name).exists():
            _move_aside(folder / name, old)
            os.replace(new / name, folder / name)
    if (new / primary).exists():  # the previous export's files this one does not write
        for name in journal.get("remove", []):
            _move_aside(folder / name, old)
    if (new / primary).exists():
        os.replace(new / primary, folder / primary)


def _link_tree(src: Path, dst: Path) -> None:
    """``dst`` a copy of ``src`` made of hard links (a copy where the filesystem has none)."""
    if src.is_dir() and not src.is_symlink():
        dst.mkdir()
        for child in src.iterdir():
            _link_tree(child, dst / child.name)
        return
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:
        shutil.copy2(src, dst, follow_symlinks=False)


# --------------------------------------------------------------------------- the staging folder

class Staging:
    """Where one export writes (see the module doc).

    ``target``: the model file (files among others) or, with ``folder=True``, the export's folder.
    ``owned``: the final names this export replaces or removes (the model file's companions, the
    previous export's files); in folder mode, names of the old folder not carried over."""

    def __init__(self, target: str | os.PathLike, *, folder: bool = False, owned: Iterable[str] = ()):
        self.target = Path(target)
        self.folder_mode = folder
        self.dest = self.target.parent
        self.owned = set(owned)
        self.root = self.dest / f".{self.target.name}{MARK}{os.getpid()}"
        self._lock_fd: int | None = None
        self.committed = False

    def __enter__(self) -> "Staging":
        prepare_dir(self.dest)
        clean_stale(self.dest)
        shutil.rmtree(self.root, ignore_errors=True)  # our own pid's: a previous call in this process
        try:
            (self.root / _NEW).mkdir(parents=True)
            lock = self.root / _LOCK
            self._lock_fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            shutil.rmtree(self.root, ignore_errors=True)
            raise NoRoom(f"cannot write to {self.dest}: {e.strerror or e}") from None
        if fcntl is not None:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Remove the staging folder (whatever was not committed goes with it) and release the lock."""
        shutil.rmtree(self.root, ignore_errors=True)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    @property
    def staged_dir(self) -> Path:
        """Where the export's files go: the new folder's contents (folder mode) or the new files."""
        return self.root / _NEW

    def path(self, name: str) -> Path:
        """The staged location of the final ``<destination>/name``."""
        return self.staged_dir / name

    def final(self, name: str) -> Path:
        return (self.target / name) if self.folder_mode else (self.dest / name)

    def commit(self) -> None:
        """Make the staged files visible as a whole (module doc)."""
        if self.folder_mode:
            self._commit_folder()
        else:
            self._commit_files()
        self.committed = True
        self.close()

    def _commit_files(self) -> None:
        new = self.staged_dir
        primary = self.target.name
        if not (new / primary).exists():
            raise FileNotFoundError(f"nothing staged as {primary}")
        companions = sorted(p.name for p in new.iterdir() if p.name != primary)
        journal = {"kind": "files", "folder": str(self.dest.resolve()), "primary": primary,
                   "companions": companions, "remove": sorted(self.owned - set(companions) - {primary})}
        tmp = self.root / (_JOURNAL + ".tmp")
        tmp.write_text(json.dumps(journal))
        os.replace(tmp, self.root / _JOURNAL)
        _roll_forward(self.root, journal)

    def _commit_folder(self) -> None:
        new, final = self.staged_dir, self.target
        if final.is_dir():
            for entry in final.iterdir():  # an engine built there, a report: theirs, carried over
                if entry.name not in self.owned and not (new / entry.name).exists() and MARK not in entry.name:
                    _link_tree(entry, new / entry.name)
        elif final.exists() or final.is_symlink():
            raise NoRoom(f"cannot write the export folder {final}: a file of that name is in the way")
        if not final.exists():
            os.rename(new, final)
            return
        if _exchange(new, final):
            return
        journal = {"kind": "folder", "folder": str(self.dest.resolve()), "name": final.name, "primary": ""}
        (self.root / _JOURNAL).write_text(json.dumps(journal))
        os.rename(final, self.root / _OLD)
        os.rename(new, final)
