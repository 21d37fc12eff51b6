"""What the CPU attention-core benchmarks share (``bench_maw_inference.py``, ``bench_smal_rewrite.py``):
timing (best of a few runs), memory tracking (peak bytes of the tensors aten ops produce, and the
largest tensor rank), the ``--lengths`` / ``--quick`` options and the result table.

Not a benchmark itself; the scripts import it as ``_common`` (their own folder is on ``sys.path``).
"""

from __future__ import annotations

import argparse
import time
import weakref
from typing import Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from attnx.models import maw, smal

#: A first run slower than this (seconds) is not repeated.
SLOW_S = 3.0


# ----------------------------------------------------------------------------- memory tracking


class TensorTracker(TorchDispatchMode):
    """Peak bytes of live tensors produced by aten ops inside the block (storages counted once, freed
    when their last tensor dies) and the largest rank produced (``rank5_ops``: the ops that produced
    rank >= 5). Descends into the attnx custom ops."""

    _impls = {"attnx.tta_distance.default": smal.tta_distance._init_fn,
              "attnx.maw_depth_gather.default": maw.maw_depth_gather._init_fn}

    def __init__(self, state=None):
        super().__init__()
        self.state = state if state is not None else {"live": {}, "current": 0, "peak": 0, "max_rank": 0,
                                                      "rank5_ops": []}

    @property
    def peak(self) -> int:
        return self.state["peak"]

    @property
    def max_rank(self) -> int:
        return self.state["max_rank"]

    def _release(self, key):
        live = self.state["live"]
        nbytes, count = live[key]
        if count > 1:
            live[key] = (nbytes, count - 1)
        else:
            del live[key]
            self.state["current"] -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        impl = self._impls.get(str(func))
        if impl is not None:
            with TensorTracker(self.state):
                out = impl(*args, **(kwargs or {}))
        else:
            out = func(*args, **(kwargs or {}))
        st, live = self.state, self.state["live"]
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            st["max_rank"] = max(st["max_rank"], t.dim())
            if t.dim() >= 5:
                st["rank5_ops"].append(str(func))
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key == 0:
                continue
            if key in live:
                live[key] = (live[key][0], live[key][1] + 1)
            else:
                live[key] = (storage.nbytes(), 1)
                st["current"] += storage.nbytes()
                st["peak"] = max(st["peak"], st["current"])
            weakref.finalize(t, self._release, key)
        return out


def self_check_tracker() -> None:
    """The tracker counts what is alive at once, and frees what dies."""
    x = torch.randn(256, 256)  # 256 KiB per result
    with TensorTracker() as mem:
        a = x @ x
        b = a * 2
        del a
        c = b + 1
        del b, c
    assert mem.peak == 2 * 256 * 256 * 4, mem.peak
    assert mem.state["current"] == 0


# ----------------------------------------------------------------------------- timing


def _repeat(fn, args, first: float, slow_s: float) -> list[float]:
    """More timed runs: none for a slow call, two for a medium one, and for a fast one as many as fit
    in ~1.5 s (at most 30); the minimum is reported (the machine may be shared)."""
    times = [first]
    if first > slow_s:
        return times
    budget, limit = (1.5, 30) if first < 0.3 else (0.0, 2)
    spent = 0.0
    while len(times) <= limit and (spent < budget or len(times) <= 2):
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
        spent += times[-1]
    return times


def measure(fn, args):
    """``(best seconds, TensorTracker, output)``. The tracked run is timed too; fast calls are
    re-run untracked and the best time is kept."""
    with TensorTracker() as tracker:
        t0 = time.perf_counter()
        out = fn(*args)
        first = time.perf_counter() - t0
    times = _repeat(fn, args, first, SLOW_S)
    return min(times), tracker, out


# ----------------------------------------------------------------------------- command line and output


def parse_lengths(description: str) -> list[int]:
    """The sequence lengths to measure, from ``--lengths`` (default 128 256 512 1024) or ``--quick``."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 256, 512, 1024])
    ap.add_argument("--quick", action="store_true", help="L = 64, 128 only (smoke test)")
    args = ap.parse_args()
    return [64, 128] if args.quick else args.lengths


def print_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """A blank line, then right-aligned columns."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print()
    print("  ".join(h.rjust(w) for h, w in zip(header, widths)))
    for r in rows:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
