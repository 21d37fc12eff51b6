"""attnx: research attention variants from PyTorch to production inference.

Public names (everything else lives in the subpackages):

- ``build_variant(name, **config)``: an attention module of one variant.
- ``build_encoder(variant, **config)``: the pre-LN encoder stack export and serving use.
- ``VARIANTS``: the registered variant names.

They are imported lazily so ``attnx.runtime`` (serving) does not pull in torch.
"""

__version__ = "0.1.0"

__all__ = ["__version__", "VARIANTS", "build_variant", "build_encoder"]


def __getattr__(name: str):
    if name in ("VARIANTS", "build_variant", "build_encoder"):
        import attnx.models

        return getattr(attnx.models, name)
    raise AttributeError(f"module 'attnx' has no attribute {name!r}")
