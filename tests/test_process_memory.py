"""A loaded decoder's memory in 2 MB pages (:mod:`attnx.runtime.core.process_memory`, Linux).

- Real mappings made inside :func:`into_huge_pages`: one filled, one touched on a single page, one from before the
  block. The filled one is collapsed (smaps' ``AnonHugePages`` says so) or the kernel's refusal is named; its bytes
  are unchanged; the sparse one is not filled in (its resident pages stay one); the old one is not touched.
- Which mappings qualify (:func:`_collapsible`): private, writable, anonymous or the heap, new, fully resident, at
  least one whole huge page.
- :func:`attnx.runtime.load` on a with-past export: the collapse runs in the background and finishes; off with
  ``huge_pages=False`` or ``ATTNX_HUGE_PAGES=0``; the logits are the same either way.
"""

from __future__ import annotations

import ctypes
import sys

import numpy as np
import pytest

import generation_fixtures as gf

from attnx.runtime.core import process_memory as pm

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps and madvise: Linux")

PAGE = 4096
SIZE = 12 << 20  # at least five whole 2 MB pages wherever it lands
_PROT_NONE, _PROT_RW, _PROT_RWX = 0, 3, 7
_MAP_PRIVATE_ANONYMOUS = 0x02 | 0x20


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


class Mapping:
    """``SIZE`` bytes of private anonymous memory between two PROT_NONE guard pages (so the kernel cannot merge it
    with a neighbour into one region the test does not control)."""

    def __init__(self, prot: int = _PROT_RW):
        self.libc = _libc()
        base = self.libc.mmap(None, SIZE + 2 * PAGE, prot, _MAP_PRIVATE_ANONYMOUS, -1, 0)
        assert base not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
        self.base, self.start = base, base + PAGE
        assert self.libc.mprotect(base, PAGE, _PROT_NONE) == 0
        assert self.libc.mprotect(self.start + SIZE, PAGE, _PROT_NONE) == 0
        self.array = np.ctypeslib.as_array((ctypes.c_uint8 * SIZE).from_address(self.start))

    def region(self) -> pm.Region:
        return next(r for r in pm.regions() if r.start == self.start)

    def close(self) -> None:
        del self.array
        self.libc.munmap(self.base, SIZE + 2 * PAGE)


def _pattern() -> np.ndarray:
    return (np.arange(SIZE, dtype=np.uint64) * 2654435761 % 251).astype(np.uint8)


def test_what_the_block_filled_goes_into_huge_pages_and_nothing_else():
    old = Mapping()
    old.array[:] = 7
    try:
        with pm.into_huge_pages() as report:
            filled, sparse = Mapping(), Mapping(_PROT_RWX)
            filled.array[:] = _pattern()
            sparse.array[0] = 1
        assert report.finished.is_set()
        spans = {lo: hi for lo, hi in report.ranges}
        region = filled.region()
        lo = -(-region.start // pm.HUGE_PAGE) * pm.HUGE_PAGE
        assert spans.get(lo) == region.end // pm.HUGE_PAGE * pm.HUGE_PAGE, report.ranges
        assert old.start not in spans and sparse.start not in spans
        assert not any(a < sparse.start + SIZE and sparse.start < b for a, b in report.ranges), report.ranges
        if report.refused:  # the kernel may lack MADV_COLLAPSE, or free 2 MB frames: it must say which
            assert set(report.refused) <= {"EINVAL", "ENOMEM", "EAGAIN", "EBUSY"}, report.refused
        else:
            assert region.anon_huge == spans[lo] - lo, (region, report)
            assert report.collapsed >= spans[lo] - lo
        np.testing.assert_array_equal(filled.array, _pattern())
        assert sparse.region().anonymous == PAGE  # not filled in to make a huge page
        assert old.region().anon_huge == 0 and (old.array == 7).all()
        filled.close()
        sparse.close()
    finally:
        old.close()


@pytest.mark.parametrize("region, qualifies", [
    (pm.Region(0, 8 << 20, "rw-p", "", anonymous=8 << 20), True),
    (pm.Region(0, 8 << 20, "rw-p", "[heap]", anonymous=8 << 20), True),
    (pm.Region(0, 8 << 20, "rw-p", "", anonymous=(8 << 20) - PAGE), False),  # a hole would be filled
    (pm.Region(0, 8 << 20, "rw-s", "", anonymous=8 << 20), False),  # shared
    (pm.Region(0, 8 << 20, "r--p", "", anonymous=8 << 20), False),
    (pm.Region(0, 8 << 20, "rw-p", "/x/model.onnx.data", anonymous=8 << 20), False),  # a file's pages
    (pm.Region(0, 8 << 20, "rw-p", "[stack]", anonymous=8 << 20), False),
    (pm.Region(PAGE, 3 << 20, "rw-p", "", anonymous=(3 << 20) - PAGE), False),  # no whole 2 MB page inside
])
def test_which_regions_qualify(region, qualifies):
    assert (pm._collapsible(region, set()) is not None) == qualifies
    assert pm._collapsible(region, {(region.start, region.end)}) is None  # there before the load: not its memory


def test_load_moves_a_decoders_memory_in_the_background_and_can_be_turned_off(monkeypatch):
    from attnx.runtime import load
    from attnx.runtime.core.decoding import Decoder

    path = gf.export(gf.folder("llama"), "mha")
    on, off = load(path, device="cpu"), load(path, device="cpu", huge_pages=False)
    assert on.huge_pages.finished.wait(60)
    assert off.huge_pages.finished.is_set() and off.huge_pages.asked == 0
    monkeypatch.setenv(pm.HUGE_PAGES_ENV, "0")
    assert not pm.huge_pages_enabled() and pm.huge_pages_enabled(True)
    env_off = load(path, device="cpu")
    assert env_off.huge_pages.finished.is_set() and env_off.huge_pages.asked == 0
    prompt = [5, 9, 2, 7]
    first_on, _ = Decoder(on).start(prompt)
    first_off, _ = Decoder(off).start(prompt)
    np.testing.assert_array_equal(first_on, first_off)
