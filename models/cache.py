"""What a variant keeps in a decoder's KV cache besides k and v.

A decoder that generates runs its attention on the new tokens only: q for the new tokens, k and v
for every token so far (the host's KV cache). A variant whose attention reads more of the past than
k and v declares it, per layer, with the static ``cache_state(config)`` of its attention module
(:class:`CacheEntry` s, like ``context_inputs``); the with-past export then takes each entry as
``past_key_values.{i}.<name>`` and returns it as ``present.{i}.<name>``, and during a cached forward
the module finds them in ``mask.cache`` (a :class:`LayerCache`; None without a cache, so the
no-cache path is untouched).

Two kinds of entry:

- per key (its shape has the axis ``"past"``): one value per cached token, computed when the token
  enters and concatenated after the past ones (smal's key term ``k^T T k``, maw's per-depth keys);
- carried (no ``"past"`` axis): a fixed-size summary of every token so far, replaced each step
  (maw's running sum of the sequence its policy pools).

An empty cache (before the prompt) is zeros: zero past tokens, or a zero summary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: The cached positions (an input's grown axis) and past + new (the same axis of an output).
PAST = "past"
TOTAL = "total"


@dataclass(frozen=True)
class CacheEntry:
    """One tensor a layer keeps between decoding steps: dims are ints, ``"batch"`` and ``"past"``."""

    name: str
    shape: tuple
    doc: str = ""

    @property
    def axis(self) -> int | None:
        """The axis that grows by the new tokens each step (None: a carried summary)."""
        return self.shape.index(PAST) if PAST in self.shape else None

    def empty(self, batch: int, dtype=torch.float32, device=None) -> torch.Tensor:
        """The value before any token: zero cached positions, or a zero summary."""
        dims = [batch if d == "batch" else 0 if d == PAST else int(d) for d in self.shape]
        return torch.zeros(dims, dtype=dtype, device=device)


def cache_entries(attn) -> list[CacheEntry]:
    """The entries an attention module declares (none for plain attention)."""
    declare = getattr(type(attn), "cache_state", None)
    return list(declare(attn.config)) if declare is not None else []


class LayerCache:
    """One layer's cached state during one cached forward: ``past`` in, ``present`` out."""

    def __init__(self, past: dict[str, torch.Tensor] | None = None):
        self.past = dict(past or {})
        self.present: dict[str, torch.Tensor] = {}

    def _past(self, name: str) -> torch.Tensor:
        if name not in self.past:
            raise KeyError(f"the cache holds no {name!r} for this layer (it holds {sorted(self.past)}): the "
                           "cached forward must be given every entry the variant declares")
        return self.past[name]

    def append(self, name: str, new: torch.Tensor, axis: int) -> torch.Tensor:
        """A per-key entry: the past values followed by the new tokens' (what this step returns too)."""
        full = torch.cat([self._past(name).to(new.dtype), new], dim=axis)
        self.present[name] = full
        return full

    def carry(self, name: str, added: torch.Tensor) -> torch.Tensor:
        """A carried summary: the past value plus what the new tokens add."""
        total = self._past(name).to(added.dtype) + added
        self.present[name] = total
        return total
