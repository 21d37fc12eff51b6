"""Count before you build: what a raw JSON body holds, found with C-speed scans before it is parsed.

Parsing builds a Python object per JSON value (a 60 MB body of one-character strings is 15 million ``str``
objects, gigabytes), so a route's body is first checked against its :class:`~attnx.runtime.wire.limits.JsonBound`
(:meth:`~attnx.runtime.wire.limits.Limits.json_bound`): the strings it holds, its values and its lists, each
counted with ``bytes.count`` (no Python per byte). Strings are counted exactly: escaped backslashes and quotes are
removed first (only when the body has an escaped quote), and then every quote left opens or closes a string. Commas
and brackets inside strings are not structure: when the whole-body counts are over a bound, those inside the
strings (whose number is then known to be bounded) are subtracted, one ``count`` per string. The precise checks
(``--max-inputs``, ``max_messages``, ``n`` x prompts, tokens) still follow the parse, before any tokenising.
"""

from __future__ import annotations

import time

from attnx.runtime.wire.errors import Kind, ProtocolError
from attnx.runtime.wire.limits import JsonBound

#: Bytes counted per call between two releases of the GIL: the event loop waits for the GIL up to one call each
#: time it needs it, and a probe's answer needs it several times (4 MiB slices, ~40 ms each on a loaded machine,
#: stalled probes 0.5 s; 256 KiB: ~1 ms a call).
_SLICE = 256 << 10


def _count(body, byte: bytes, start: int = 0, end: int | None = None) -> int:
    end = len(body) if end is None else end
    if end - start <= _SLICE:
        return body.count(byte, start, end)
    total = 0
    for pos in range(start, end, _SLICE):
        total += body.count(byte, pos, min(end, pos + _SLICE))
        time.sleep(0)  # lets the event loop's thread have the GIL between slices
    return total


def _has(body, pair: bytes) -> bool:
    """``pair in body``, a slice at a time (slices overlap by a byte, so a pair across a boundary is seen)."""
    for pos in range(0, len(body), _SLICE):
        if body.find(pair, pos, pos + _SLICE + 1) >= 0:
            return True
        time.sleep(0)
    return False


def _unescaped(body):
    """``body`` with every escaped backslash and escaped quote removed: each quote left delimits a string."""
    if not _has(body, b'\\"'):
        return body
    return bytes(body).replace(b"\\\\", b"").replace(b'\\"', b"")


def _inside_strings(body, quotes: int, marks: tuple[bytes, ...]) -> list[int]:
    """How many of each of ``marks`` sit inside strings (``body`` unescaped; ``quotes`` of them, walked once)."""
    found = [0] * len(marks)
    pos = 0
    for _ in range(quotes // 2):
        start = body.find(b'"', pos)
        end = body.find(b'"', start + 1)
        if start < 0 or end < 0:
            break
        if end - start > 1:
            for k, mark in enumerate(marks):
                found[k] += _count(body, mark, start + 1, end)
        pos = end + 1
    return found


def check_json(body, bound: JsonBound, where: str) -> None:
    """``too_many`` (one line, naming the limits) for a raw JSON ``body`` holding more strings, values or lists than
    ``bound`` allows at ``where`` (a route); does nothing for a body too small to pass any bound."""
    smallest = min((b for b in bound[:3] if b is not None), default=None)
    if smallest is None or len(body) <= 2 * smallest:
        return  # every string, value or list takes two bytes at least
    plain = _unescaped(body)
    quotes = _count(plain, b'"')
    strings = quotes // 2
    if bound.strings is not None and strings > bound.strings:
        raise _over(f"{strings} strings", bound.strings, where, bound.limits)
    commas, lists, objects = (_count(plain, mark) for mark in (b",", b"[", b"{"))
    if (bound.values is None or commas + lists + objects < bound.values) and \
            (bound.lists is None or lists <= bound.lists):
        return
    in_commas, in_lists, in_objects = _inside_strings(plain, quotes, (b",", b"[", b"{"))
    values, lists = commas - in_commas + lists - in_lists + objects - in_objects + 1, lists - in_lists
    if bound.lists is not None and lists > bound.lists:
        raise _over(f"{lists} lists", bound.lists, where, bound.limits)
    if bound.values is not None and values > bound.values:
        raise _over(f"{values} values", bound.values, where, bound.limits)


def _over(what: str, most: int, where: str, limits: str) -> ProtocolError:
    return ProtocolError(Kind.TOO_MANY, f"the request body holds {what}, over the {most} a request to {where} may "
                                        f"hold (from {limits}); send fewer inputs per request")
