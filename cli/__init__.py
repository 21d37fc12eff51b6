"""The `attnx` command line (Typer). Entry point: ``attnx.cli.main:main``."""

if not __name__.startswith("attnx."):  # one file, one module: src/attnx links this folder as attnx.cli
    raise ImportError(f"import attnx.cli, not {__name__}: the package is attnx (pip install -e .)")
