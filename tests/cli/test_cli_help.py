"""`--help` works for every `treadle` subcommand (help texts come from config docstrings, which
argparse %-formats: a `90%` once crashed `treadle serve --help`)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from treadle.cli.main import build_parser, main

TREADLE = str(Path(sys.executable).parent / "treadle")


def _commands(
    parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()
) -> list[tuple[str, ...]]:
    """Every command path, e.g. ("bench", "serve"), found by walking the subparsers."""
    found = [prefix]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _commands(sub, (*prefix, name))
    return found


COMMANDS = _commands(build_parser())


def test_every_subcommand_is_found() -> None:
    assert {("generate",), ("serve",), ("bench",), ("bench", "serve")} <= set(COMMANDS)


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "treadle")
def test_help_of_every_subcommand(
    command: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: treadle")
    assert "--help" in out


def test_serve_help_shows_the_percent_sign_from_a_docstring() -> None:
    """The real entry point, in a fresh process."""
    result = subprocess.run(
        [TREADLE, "serve", "--help"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "90% of free device memory" in " ".join(result.stdout.split())
    assert "--kv-cache-memory" in result.stdout
