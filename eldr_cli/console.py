"""Shared rich console for command output, and the one way tables are built.

Width: on a terminal, the terminal's width (tables are designed to fit 80 columns); when stdout
is not a terminal (a pipe, a file, CI logs) and ``COLUMNS`` is not set, lines are never wrapped or
cut, so nothing is lost; ``COLUMNS`` always wins.
"""

from __future__ import annotations

import os
import sys

from rich.console import Console
from rich.table import Table

# a table needs this many columns to show its optional ("wide") columns without --wide
WIDE_COLUMNS = 120
_UNLIMITED = 1000


def _width(stream) -> int | None:
    if os.environ.get("COLUMNS", "").strip().isdigit():
        return None  # rich reads COLUMNS itself
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):
        tty = False
    return None if tty else _UNLIMITED


console = Console(highlight=False, width=_width(sys.stdout))
err_console = Console(stderr=True, highlight=False, width=_width(sys.stderr))


def show_wide(wide: bool, con: Console | None = None) -> bool:
    """Show a table's optional columns: asked for, or room enough for them."""
    return wide or (con or console).width >= WIDE_COLUMNS


def table(*columns: str, title: str | None = None, numeric_from: int = 1, **kw) -> Table:
    """A table whose cells fold instead of being cut to "rou…" when the terminal is narrow.

    Columns from index ``numeric_from`` on are right-aligned (numbers)."""
    t = Table(title=title, **kw)
    for i, name in enumerate(columns):
        t.add_column(name, justify="right" if i >= numeric_from else "left", overflow="fold")
    return t
