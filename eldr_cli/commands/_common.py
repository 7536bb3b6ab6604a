"""Options and checks shared by several commands (kept tiny: imported by `eldr --help`)."""

from __future__ import annotations

from typing import Optional

import typer

_done: dict[str, bool] = {"skip_teardown": False}


def skip_teardown() -> None:
    """Called by an offline command once its artifact is renamed into place and its summary printed:
    `eldr` then exits without the interpreter's teardown (tearing down zarr's I/O threads, polars,
    matplotlib and numba took ~0.2 s of a 3 s `eldr fit`). Only on success; nothing is left to flush
    but the standard streams, which are flushed first."""
    _done["skip_teardown"] = True


def teardown_skipped() -> bool:
    return _done["skip_teardown"]


def split_option(default: Optional[str], help: str = "Requests to use: calibration, evaluation or all."):
    return typer.Option(default, "--split", help=help, callback=checked("split"))


def tau_option(default: Optional[float] = None,
               help: str = "Locality band width (default: the routing artifact's)."):
    """--tau, checked against its declaration (eldr_cli.constraints)."""
    return typer.Option(default, "--tau", help=f"{help} {declared('tau')}", callback=checked("tau"))


def declared(name: str) -> str:
    """The declared values of parameter ``name``, for an option's help: ``(a number in [0, 2])``
    (rich markup would take a leading ``[`` for a tag)."""
    from eldr_cli.constraints import PARAMETER_CONSTRAINTS

    return f"({PARAMETER_CONSTRAINTS[name]})"


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


# The method's parameter names (eldr_cli.constraints, eldr_cli.method) and the flags that set them: an
# InvalidParameterError is printed in the flags' words (eldr_cli.main)
PARAM_FLAGS = {"n_pairs": "--pairs", "n_clusters": "--decoders", "transform": "--transform", "ep_size": "--ep-size",
               "n_redundant": "--redundant-experts", "batch_size": "--batch-size", "tau": "--tau",
               "policy": "--policy", "split": "--split", "seed": "--seed", "port": "--port", "workers": "--workers"}


def checked(name: str, *, optional: bool = True):
    """Option callback checking the value against the declaration of parameter ``name``
    (:mod:`eldr_cli.constraints`); click words the refusal as for any bad option value (exit 2)."""
    from eldr_cli.constraints import PARAMETER_CONSTRAINTS

    constraint = PARAMETER_CONSTRAINTS[name]

    def callback(value):
        if value is None and optional:
            return None
        if not constraint.accepts(value):
            raise typer.BadParameter(constraint.refusal(value))
        return constraint.convert(value)

    return callback


# the replicas' shared-state options, the same for serve-proxy and serve-dynamo
STATE_KEY_FILE = typer.Option(None, "--state-key-file", help="File (mode 600) with the key the replicas sign with.")
STATE_PASSWORD_FILE = typer.Option(None, "--state-password-file",
                                   help="File (mode 600) with the Redis password (or $ELDR_STATE_PASSWORD).")
STATE_CA_FILE = typer.Option(None, "--state-ca-file", help="CA bundle (PEM) verifying a rediss:// server.")
