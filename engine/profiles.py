"""Optimization profiles: ``--shapes`` (parsed by the contract) and the per-input profile shapes of a file.

Dynamic dims are named in the ONNX file (``batch``, ``seq``: :data:`attnx.contract.AXES`); a
profile gives each name ``(min, opt, max)``, by default the file's ``attnx.profiles`` metadata.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from attnx.contract import AXES, ContractError, check_profile, graph_io, load_onnx, parse_shapes as _parse, read_profiles
from attnx.engine.errors import BuildError
from attnx.engine.network import network_inputs

ProfileShapes = dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]


def parse_shapes(items: Iterable[str] | None) -> dict[str, tuple[int, int, int]]:
    """``["batch=1,4,16", "seq=1:64:256"]`` -> ``{"batch": (1, 4, 16), "seq": (1, 64, 256)}``.

    Several axes may share one item separated by ``;`` or whitespace; one value is a fixed size
    (``seq=128``). Keys are the dynamic axes (``batch``, ``seq``). Raises ContractError."""
    fixed = [re.sub(r"=\s*(\d+)(?=$|[;\s])", r"=\1,\1,\1", str(item).strip()) for item in items or ()]
    out = _parse(fixed)
    unknown = [axis for axis in out if axis not in AXES]
    if unknown:
        raise ContractError(f"--shapes: unknown axis {unknown[0]!r}; the dynamic axes are {', '.join(AXES)}")
    return out


def _ranges(profiles: Mapping[str, Sequence[int]] | None, props: Mapping[str, str], where: Path) -> dict:
    try:
        if profiles is None:
            return read_profiles(props)
        return {name: check_profile(name, rng) for name, rng in profiles.items()}
    except ContractError as e:
        raise BuildError(f"{where.name}: {e}") from None


def resolve_profiles(onnx_path: str | os.PathLike, *, profiles: Mapping[str, Sequence[int]] | None = None,
                     shapes: Mapping[str, Sequence[Sequence[int]]] | None = None, network=None) -> ProfileShapes:
    """Optimization-profile shapes per input: ``{input: (min_shape, opt_shape, max_shape)}``.

    ``profiles`` gives each dim name ``(min, opt, max)`` and defaults to the file's
    ``attnx.profiles``; ``shapes`` overrides whole inputs. Inputs without dynamic dims are left out."""
    path = Path(onnx_path)
    proto = load_onnx(path)
    ranges = _ranges(profiles, {p.key: p.value for p in proto.metadata_props}, path)
    out: ProfileShapes = {}
    net_shapes = {t.name: t.shape for t in network_inputs(network)} if network is not None else {}
    for name, _dtype, dim_list in graph_io(proto)[0]:
        if shapes and name in shapes:
            given = [tuple(int(v) for v in s) for s in shapes[name]]
            if len(given) != 3:
                raise BuildError(f"shapes[{name!r}] must be (min_shape, opt_shape, max_shape)")
            out[name] = (given[0], given[1], given[2])
            continue
        known = net_shapes.get(name)
        if not any(isinstance(d, str) or d is None for d in dim_list) and not (known and -1 in known):
            continue
        per_axis = []
        for axis, d in enumerate(dim_list):
            if isinstance(d, int) and d > 0:
                per_axis.append((d, d, d))
            elif isinstance(d, str) and d in ranges:
                per_axis.append(ranges[d])
            else:
                label = f"dynamic dim {d!r}" if d else f"unnamed dynamic dim {axis}"
                raise BuildError(f"no optimization-profile range for the {label} of input {name!r}; pass "
                                 f"profiles={{'{d or 'name'}': (min, opt, max)}} or shapes={{'{name}': (min, opt, max)}}")
        lo, opt, hi = zip(*per_axis) if per_axis else ((), (), ())
        out[name] = (tuple(lo), tuple(opt), tuple(hi))
    return out
