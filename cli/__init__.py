"""The `attnx` command line (Typer). Entry point: ``attnx.cli.main:main``."""
