"""What a loaded model holds in this process's memory, and where: Linux's ``/proc/self/smaps`` and ``madvise``.

Two things :func:`attnx.runtime.load` does with it after ONNX Runtime has made a CPU session:

- :func:`release_read_weights`: the pages of an export's external data that the load read but nothing keeps using
  leave the resident set.
- :func:`into_huge_pages`: the anonymous memory the load filled (the weights ONNX Runtime repacked, the tables it
  computed) is moved into 2 MB transparent huge pages (``MADV_COLLAPSE``, Linux 6.1+). A decode step streams every
  weight once; with 4 KB pages the CPU's prefetchers stop at each page boundary and a 1 GB model needs 256k TLB
  entries a token. Measured on the 1.56B Llama shape at int4, 2 threads: 1.13-1.27x faster decode
  (``benchmarks/bench_decoder_sizes.py``; docs/performance.md). Only a region the load mapped whose every page is
  already resident is collapsed, so the resident set does not grow; the contents are unchanged (the kernel
  copies them). Where the kernel or its memory cannot (no free 2 MB frames, an older kernel) the pages stay as
  they are. Off with ``ATTNX_HUGE_PAGES=0`` or ``load(path, huge_pages=False)``.
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Iterator

#: Set to 0 / false / no / off to keep a session's memory in 4 KB pages.
HUGE_PAGES_ENV = "ATTNX_HUGE_PAGES"
HUGE_PAGE = 2 << 20  # x86-64 and arm64 (4 KB base pages): a PMD
_CHUNK = 64 << 20  # one madvise call's range: a failure loses no more than this, and is retried once
_MADV_DONTNEED = 4
_MADV_COLLAPSE = 25


@dataclass
class Region:
    """One mapping of ``/proc/self/smaps``: ``[start, end)``, its permissions and name (a path, ``[heap]``, or ``""``
    for anonymous memory), and its ``Anonymous`` / ``AnonHugePages`` bytes."""

    start: int
    end: int
    perms: str
    name: str
    anonymous: int = 0
    anon_huge: int = 0

    @property
    def size(self) -> int:
        return self.end - self.start


def regions() -> list[Region]:
    """This process's mappings (empty where ``/proc/self/smaps`` cannot be read: not Linux)."""
    out: list[Region] = []
    try:
        with open("/proc/self/smaps") as smaps:
            for line in smaps:
                parts = line.split()
                if "-" in parts[0] and len(parts) >= 5 and ":" in parts[3]:  # a mapping's header line
                    start, end = (int(x, 16) for x in parts[0].split("-"))
                    out.append(Region(start, end, parts[1], parts[5] if len(parts) > 5 else ""))
                elif out and parts[0] == "Anonymous:":
                    out[-1].anonymous = int(parts[1]) << 10
                elif out and parts[0] == "AnonHugePages:":
                    out[-1].anon_huge = int(parts[1]) << 10
    except OSError:
        return []
    return out


@lru_cache(maxsize=1)
def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def release_read_weights(path: Path) -> int:
    """Drop from this process's resident set the pages of ``path``'s external data (``<file>.data``) that ONNX Runtime
    read while loading; returns the bytes dropped.

    ORT memory-maps the file; a ``MatMulNBits`` weight is repacked into memory of its own and its mapping released,
    but a table another node also reads (a tied embedding's, which the head's ``MatMulNBits`` repacks) stays mapped
    with every page the repacking read resident: the head counted twice. Only a region none of whose pages was
    copied on write (smaps' ``Anonymous: 0``) is dropped (``MADV_DONTNEED``: its pages are the file's, read again
    from the page cache when next used, e.g. an embedding row), so nothing the runtime holds changes. (smaps'
    ``*_Dirty`` also counts file pages not yet written back, so it says nothing here.) Linux only."""
    names = {str(f.resolve()) for f in path.parent.glob(path.name + "*.data")}  # attnx writes <name>.onnx.data
    if not names or not sys.platform.startswith("linux"):
        return 0
    dropped = 0
    for r in regions():
        if r.name in names and r.anonymous == 0 and _libc().madvise(r.start, r.size, _MADV_DONTNEED) == 0:
            dropped += r.size
    return dropped


def huge_pages_enabled(choice: bool | None = None) -> bool:
    """``choice`` where given, else ``ATTNX_HUGE_PAGES`` (default on); never off Linux."""
    if not sys.platform.startswith("linux"):
        return False
    if choice is not None:
        return choice
    return os.environ.get(HUGE_PAGES_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


@dataclass
class Collapsed:
    """What :func:`into_huge_pages` did: the bytes it asked the kernel to collapse, the bytes now in huge pages,
    and the errno names of the calls refused (``ENOMEM``: no free 2 MB frame; ``EINVAL``: a kernel without
    ``MADV_COLLAPSE``)."""

    asked: int = 0
    collapsed: int = 0
    refused: dict[str, int] = field(default_factory=dict)
    ranges: list[tuple[int, int]] = field(default_factory=list)
    finished: threading.Event = field(default_factory=threading.Event, repr=False)  # set once the above are final


def _collapsible(r: Region, before: set[tuple[int, int]]) -> tuple[int, int] | None:
    """The whole huge pages of ``r`` to collapse: a private writable anonymous mapping (or the heap) the load made
    or changed, every page of it resident already (so collapsing fills no hole), at least one huge page."""
    if (r.start, r.end) in before or r.name not in ("", "[heap]") or not r.perms.startswith("rw") \
            or r.perms[3:4] != "p" or r.anonymous < r.size:
        return None
    lo, hi = -(-r.start // HUGE_PAGE) * HUGE_PAGE, r.end // HUGE_PAGE * HUGE_PAGE
    return (lo, hi) if hi - lo >= HUGE_PAGE else None


def collapse_new(before: set[tuple[int, int]]) -> Collapsed:
    """Collapse into huge pages the fully resident anonymous regions not in ``before`` (``(start, end)`` pairs of
    :func:`regions` taken earlier)."""
    done = Collapsed()
    libc = _libc()
    for r in regions():
        span = _collapsible(r, before)
        if span is None:
            continue
        done.ranges.append(span)
        if r.anon_huge >= span[1] - span[0]:  # in huge pages already (THP "always")
            continue
        for start in range(span[0], span[1], _CHUNK):
            length = min(_CHUNK, span[1] - start)
            done.asked += length
            for _ in range(2):  # EAGAIN / ENOMEM can pass once the kernel has compacted
                if libc.madvise(start, length, _MADV_COLLAPSE) == 0:
                    break
                name = errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno()))
                done.refused[name] = done.refused.get(name, 0) + 1
                if name == "EINVAL":  # no MADV_COLLAPSE in this kernel: nothing more to try
                    return _measured(done)
    return _measured(done)


def _measured(done: Collapsed) -> Collapsed:
    spans = done.ranges
    done.collapsed = sum(r.anon_huge for r in regions() if any(lo < r.end and r.start < hi for lo, hi in spans))
    return done


@contextmanager
def into_huge_pages(enabled: bool = True, background: bool = False) -> Iterator[Collapsed]:
    """The anonymous memory the block maps and fills, collapsed into huge pages after it; the yielded
    :class:`Collapsed` is filled in then (``finished`` is set). ``background``: in a daemon thread, so the block's
    caller goes on at once (the kernel copies ~0.4-1.5 GB/s on this machine: a 1 GB int4 decoder is in huge pages
    0.5-2 s after its load; a run in the meantime reads the pages being moved as usual). A no-op where ``enabled``
    is false or not on Linux."""
    report = Collapsed()
    if not enabled or not sys.platform.startswith("linux"):
        report.finished.set()
        yield report
        return
    before = {(r.start, r.end) for r in regions()}
    yield report

    def collapse() -> None:
        try:
            done = collapse_new(before)
            report.asked, report.collapsed, report.refused, report.ranges = \
                done.asked, done.collapsed, done.refused, done.ranges
        finally:
            report.finished.set()

    if background:
        threading.Thread(target=collapse, name="attnx-huge-pages", daemon=True).start()
    else:
        collapse()
