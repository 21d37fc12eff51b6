"""Reference PyTorch modules of the attention variants (the math: variants.md).

A variant is one file (``mha``, ``cultural``, ``metaphor``, ``maw``, ``smal``) that ends with its
``VariantSpec`` (:mod:`attnx.models.spec`); the attention they build on is in ``attention``, the
block and stack in ``encoder``, the builders in ``build``.
"""

if not __name__.startswith("attnx."):  # one file, one module: src/attnx links this folder as attnx.models
    raise ImportError(f"import attnx.models, not {__name__}: the package is attnx (pip install -e .)")

from attnx.models.spec import VARIANTS, VariantSpec, get_spec, register, variant_names  # noqa: I001
from attnx.models import mha, cultural, metaphor, maw, smal  # noqa: F401  (each registers its spec)
from attnx.models.attention import attention_path, reference
from attnx.models.build import (
    build_encoder,
    build_variant,
    describe_variants,
    encoder_from_config,
    make_config,
    variant_options,
)

__all__ = ["VARIANTS", "VariantSpec", "register", "get_spec", "variant_names", "build_encoder", "build_variant",
           "encoder_from_config", "make_config", "variant_options", "describe_variants", "attention_path",
           "reference"]
