"""attnx: research attention variants from PyTorch to production inference.

Public names (everything else lives in the subpackages):

- ``build_variant(name, **config)``: an attention module of one variant.
- ``build_encoder(variant, **config)``: the pre-LN encoder stack export and serving use.
- ``VARIANTS``: the registered variant names.
"""

__version__ = "0.1.0"

from attnx.models.registry import VARIANTS, build_encoder, build_variant  # noqa: E402

__all__ = ["__version__", "VARIANTS", "build_variant", "build_encoder"]
