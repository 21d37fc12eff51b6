"""Every command's --help renders (Rich markup in a help string once broke `attnx explain --help`)."""

from __future__ import annotations

import pytest
import typer
from attnx.cli.main import app
from support.cli import run as attnx

COMMANDS = [c.name or c.callback.__name__ for c in app.registered_commands] + \
           [g.name for g in app.registered_groups]


def test_the_command_list_is_what_users_expect():
    for name in ("export", "check", "build-engine", "serve", "bench", "explain", "triton-repo", "demo", "variants",
                 "generate"):
        assert name in COMMANDS


@pytest.mark.parametrize("command", COMMANDS)
def test_help_renders(command):
    result = attnx(command, "--help", env={"COLUMNS": "120"})
    assert result.returncode == 0, result.output
    assert "Usage" in result.output and "--help" in result.output
    command_obj = typer.main.get_command(app)
    assert command_obj.get_command(None, command) is not None
