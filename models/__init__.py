"""Reference PyTorch modules of the five attention variants (the math: variants.md).

One variant, one file: ``mha``, ``cultural``, ``metaphor``, ``maw``, ``smal``;
shared pieces in ``common`` and ``encoder``; names -> builders in ``registry``;
interpretability (caches, hooks, patching) in ``hooks``.
"""

from attnx.models.registry import (
    VARIANTS,
    build_encoder,
    build_variant,
    encoder_from_config,
    make_config,
    variant_options,
)

__all__ = ["VARIANTS", "build_encoder", "build_variant", "encoder_from_config", "make_config", "variant_options"]
