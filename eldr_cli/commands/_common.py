"""Options and checks shared by several commands (kept tiny: imported by `eldr --help`)."""

from __future__ import annotations

from typing import Optional

import typer

SPLIT_NAMES = ("calibration", "evaluation", "all")

_done: dict[str, bool] = {"skip_teardown": False}


def skip_teardown() -> None:
    """Called by an offline command once its artifact is renamed into place and its summary printed:
    `eldr` then exits without the interpreter's teardown (tearing down zarr's I/O threads, polars,
    matplotlib and numba took ~0.2 s of a 3 s `eldr fit`). Only on success; nothing is left to flush
    but the standard streams, which are flushed first."""
    _done["skip_teardown"] = True


def teardown_skipped() -> bool:
    return _done["skip_teardown"]


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


# The method's parameter names (eldr_cli.stages) and the flags that set them.
PARAM_FLAGS = {"n_pairs": "--pairs", "n_clusters": "--decoders", "transform": "--transform", "ep_size": "--ep-size",
               "n_redundant": "--redundant-experts", "batch_size": "--batch-size", "tau": "--tau",
               "policy": "--policy", "split": "--split", "seed": "--seed"}


def translate_stage_error(e: Exception):
    """An EldrError (flag names, hint) for a ValueError/TypeError raised by the method's own code
    (``eldr_cli.stages``), or None for any other exception (a bug: it keeps its traceback)."""
    from eldr_cli.errors import EldrError
    from eldr_cli.stages.validation import InvalidParameterError

    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    raised_in = tb.tb_frame.f_globals.get("__name__", "") if tb is not None else ""
    if not raised_in.startswith("eldr_cli.stages"):
        return None
    msg, hint = str(e), None
    if isinstance(e, InvalidParameterError):
        flag = PARAM_FLAGS.get(e.param)
        if flag is not None:
            msg = flag + msg[len(e.param):] if msg.startswith(e.param + " ") else f"{flag}: {msg}"
        hint = e.hint
        for param, fl in PARAM_FLAGS.items():
            if hint:
                hint = hint.replace(param, fl)
    return EldrError(msg, hint=hint)
