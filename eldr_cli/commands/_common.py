"""Options and checks shared by several commands (kept tiny: imported by `eldr --help`)."""

from __future__ import annotations

from typing import Optional

import typer

SPLIT_NAMES = ("calibration", "evaluation", "all")


def _split(value: Optional[str]) -> Optional[str]:
    if value is not None and value not in SPLIT_NAMES:
        raise typer.BadParameter(f"{value!r} is not one of {', '.join(SPLIT_NAMES)}")
    return value


def split_option(default: Optional[str], help: str = "Requests to use: calibration, evaluation or all."):
    return typer.Option(default, "--split", help=help, callback=_split)


def force_option():
    return typer.Option(False, "--force", help="Replace --out even if it holds an artifact of another kind.")


def replacing(out, force: bool):
    """Context in which the artifact writer may replace ``out`` if it holds another kind (``--force``)."""
    from eldr_cli.artifacts.guard import replacing as _replacing

    return _replacing(out, allow=force)


def positive(value):
    """Option callback: a number > 0 (typer has no open ranges)."""
    if value is not None and not value > 0:
        raise typer.BadParameter(f"{value:g} is not > 0")
    return value


def fraction(value):
    """Option callback: a number in [0, 1)."""
    if value is not None and not 0 <= value < 1:
        raise typer.BadParameter(f"{value:g} is not in [0, 1)")
    return value
