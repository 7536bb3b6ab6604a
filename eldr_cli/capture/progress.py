"""The progress bar `eldr capture` shows, for a live capture and for a trace import alike."""

from __future__ import annotations


def progress_bar(enabled: bool):
    """The rich progress bar of a capture or an import (requests done, rates, time left); off when not
    ``enabled``."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        ProgressColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )
    from rich.text import Text

    from eldr_cli.console import err_console

    class Rates(ProgressColumn):
        def render(self, task):
            dt = task.fields.get("busy_s") or 0.0
            if dt <= 0:
                return Text("-- req/s  -- tok/s", style="progress.data.speed")
            return Text(f"{task.fields.get('reqs', 0) / dt:6.2f} req/s {task.fields.get('toks', 0) / dt:8.0f} tok/s",
                        style="progress.data.speed")

    return Progress(TextColumn("[bold]capture"), BarColumn(), MofNCompleteColumn(), Rates(), TimeElapsedColumn(),
                    TimeRemainingColumn(), console=err_console, disable=not enabled, transient=False)
