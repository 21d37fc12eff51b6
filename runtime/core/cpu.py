"""What this CPU gives ONNX Runtime's integer GEMM, for int8 files (``attnx export --int8``).

ONNX Runtime multiplies uint8 activations by int8 weights (U8S8) with the widest integer dot product the CPU has. On
x86 with AVX2 (or AVX-512BW) but no VNNI that is ``vpmaddubsw``, which adds two u8 x s8 products into a *saturating*
int16: with full-range 8-bit weights (255 * 127 * 2 > 32767) large products clip and accuracy drops. VNNI
(``vpdpbusd``) and AMX accumulate in int32, as do ARM's dot-product kernels: nothing clips. attnx therefore writes
7-bit weights by default (exact everywhere) and 8-bit weights only when asked (``--int8-weight-bits 8``), and warns
when such a file is loaded on a CPU that would clip it.
"""

from __future__ import annotations

import platform
from functools import lru_cache
from pathlib import Path

#: /proc/cpuinfo flags of the int32-accumulating x86 dot products, best first.
_VNNI = (("amx_int8", "AMX"), ("avx512_vnni", "AVX-512 VNNI"), ("avx_vnni", "AVX-VNNI"))


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux ``/proc/cpuinfo``); empty where they cannot be read."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):  # x86 | ARM
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def _is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")


def int8_dot_product(flags: frozenset[str] | None = None, x86: bool | None = None) -> str:
    """The integer dot product ONNX Runtime's U8S8 GEMM gets here, in words (for benchmarks and warnings)."""
    flags = cpu_flags() if flags is None else flags
    x86 = _is_x86() if x86 is None else x86
    if not x86:
        return f"{platform.machine() or 'non-x86'} (int32 accumulation)"
    for flag, name in _VNNI:
        if flag in flags:
            return name
    if "avx2" in flags or "avx512bw" in flags:
        return "AVX2 without VNNI (u8 x s8 pair sums saturate in int16)"
    return "SSE (int16 widening, no saturation)"


def saturates_8bit_weights(flags: frozenset[str] | None = None, x86: bool | None = None) -> bool:
    """True where ONNX Runtime's U8S8 kernel clips products of full-range int8 weights (see the module doc)."""
    flags = cpu_flags() if flags is None else flags
    x86 = _is_x86() if x86 is None else x86
    return x86 and ("avx2" in flags or "avx512bw" in flags) and not any(f in flags for f, _ in _VNNI)
