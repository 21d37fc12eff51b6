"""What a model gives the exporter: :class:`Exportable`, and :class:`CachedExportable` for a decoder with its KV cache.

:func:`attnx.export.exporter.export_encoder` takes any ``torch.nn.Module`` that has the signature of
:mod:`attnx.models.signature` (:class:`Exportable`: declared inputs and outputs, ``forward_named`` by name, its
config and variant). attnx's encoders (:class:`attnx.models.encoder.Encoder`) and the pretrained hosts
(:class:`attnx.pretrained.host.Host`) are such models. A decoder exported with its cache
(:class:`attnx.pretrained.cached.CachedHost`) is a :class:`CachedExportable` besides: it has dims beyond
``batch``/``seq`` (``past``, ``total``), so it gives its own trace examples and dims, the cache's metadata
(``attnx.cache``) and the inputs the file gives defaults (``logits_to_keep``).

The models satisfy the protocols structurally (``models`` and ``pretrained`` sit below ``export`` in the layer
order, so they cannot name them); the type checker holds them to it (the assignments under ``TYPE_CHECKING``
below) and :func:`check_exportable` refuses anything else in one line, before anything is traced.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from attnx.models.signature import InputSpec, OutputSpec


@runtime_checkable
class Exportable(Protocol):
    """A model the exporter can trace (:mod:`attnx.models.signature`); also a ``torch.nn.Module``."""

    @property
    def variant(self) -> str: ...  # the attention variant (attnx.models.spec), named in attnx.variant

    def input_specs(self) -> list[InputSpec]: ...

    def output_specs(self) -> list[OutputSpec]: ...

    def config_dict(self) -> dict[str, Any]: ...  # attnx.config: what rebuilds the reference

    def forward_named(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...


@runtime_checkable
class CachedExportable(Exportable, Protocol):
    """A decoder exported with its KV cache (``--with-past``)."""

    def example_inputs(self) -> dict[str, torch.Tensor]: ...  # trace examples with a non-empty cache

    def export_dims(self) -> dict[str, Any]: ...  # dim name -> torch.export.Dim, past/total among them

    def cache_metadata(self) -> dict[str, Any]: ...  # attnx.cache

    def input_defaults(self) -> list[tuple[InputSpec, torch.Tensor]]: ...  # inputs the file fills when left out


_EXPORTABLE = ("variant", "input_specs", "output_specs", "config_dict", "forward_named")
_CACHED = ("example_inputs", "export_dims", "cache_metadata", "input_defaults")


def check_exportable(model: object) -> None:
    """A one-line :class:`TypeError` naming what ``model`` lacks, unless it is :class:`Exportable`; a model with some
    but not all of :class:`CachedExportable`'s members is refused too (the exporter would mix two kinds)."""
    name = type(model).__name__
    missing = [m for m in _EXPORTABLE if not hasattr(model, m)]
    if missing or not callable(getattr(model, "parameters", None)):
        missing += [] if callable(getattr(model, "parameters", None)) else ["parameters (a torch.nn.Module)"]
        raise TypeError(f"cannot export {name}: it lacks {', '.join(missing)} (an exportable model has "
                        f"{', '.join(_EXPORTABLE)}: attnx.export.protocol.Exportable)")
    present = [m for m in _CACHED if hasattr(model, m)]
    if present and len(present) < len(_CACHED):
        lacking = [m for m in _CACHED if m not in present]
        raise TypeError(f"cannot export {name}: it has {', '.join(present)} but lacks {', '.join(lacking)} (a decoder "
                        "exported with its cache has all of attnx.export.protocol.CachedExportable)")


def is_cached(model: object) -> bool:
    """Whether the exporter treats ``model`` as a decoder with its cache (after :func:`check_exportable`)."""
    return isinstance(model, CachedExportable)


if TYPE_CHECKING:  # the models attnx exports satisfy the protocols (checked by mypy, nothing runs)
    from attnx.models.encoder import Encoder
    from attnx.pretrained.cached import CachedHost
    from attnx.pretrained.host import Host

    _encoder: type[Exportable] = Encoder
    _host: type[Exportable] = Host
    _cached: type[CachedExportable] = CachedHost
