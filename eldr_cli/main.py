"""The `eldr` command. Each subcommand lives in eldr_cli/commands/<name>.py and registers itself;
heavy libraries are imported inside the commands so `eldr --help` starts fast.

Exit codes: 0 success, 2 anything the user can fix (usage errors, bad files, refused outputs),
130 interrupted (Ctrl-C). typer vendors click as ``typer._click``; its exceptions are not the
``click`` package's, so both are caught here.
"""

from __future__ import annotations

import sys

import typer

from eldr_cli import typer_speedups
from eldr_cli.errors import EldrError, InvalidParameterError

app = typer.Typer(
    name="eldr",
    help="Expert-locality-aware decode routing for PD-disaggregated MoE serving on vLLM.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

# one module per subcommand (or group); each defines register(app)
COMMAND_MODULES = ["inspect", "synth", "fit", "model", "serve_proxy", "serve_dynamo", "place", "bench",
                   "bench_step", "emulate", "capture", "report", "dashboard"]

INTERRUPTED = 130


def _register() -> None:
    import importlib

    for name in COMMAND_MODULES:
        importlib.import_module(f"eldr_cli.commands.{name}").register(app)


def _print_version(value: bool) -> None:
    # eager: runs while parsing, before click asks for a subcommand
    if value:
        from eldr_cli import __version__

        typer.echo(f"eldr {__version__}")
        raise typer.Exit(0)


@app.callback()
def _main(
    version: bool = typer.Option(
        False, "--version", help="Print the version and exit.", is_eager=True, callback=_print_version
    ),
) -> None:
    pass


def _click_exception_types() -> tuple[tuple[type[BaseException], ...], tuple[type[BaseException], ...],
                                     tuple[type[BaseException], ...]]:
    """(ClickException, Exit, Abort) types of typer's vendored click and, if installed, of click."""
    from typer import _click
    from typer import exceptions as texc

    errors: list[type[BaseException]] = [_click.exceptions.ClickException]
    exits: list[type[BaseException]] = [texc.Exit]
    aborts: list[type[BaseException]] = [texc.Abort]
    try:  # a plugin or a library may still raise the real click's exceptions
        import click

        errors.append(click.exceptions.ClickException)
        exits.append(click.exceptions.Exit)
        aborts.append(click.exceptions.Abort)
    except ImportError:  # pragma: no cover
        pass
    return tuple(errors), tuple(exits), tuple(aborts)


def _interrupted() -> int:
    print("interrupted", file=sys.stderr)
    return INTERRUPTED


def _print_error(e: EldrError) -> int:
    from rich.console import Console
    from rich.markup import escape

    Console(stderr=True).print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
    return e.exit_code


def run(argv: list[str] | None = None) -> int:
    """Entry point: runs the app and returns the exit code.

    EldrError (any of eldr_cli.errors, chosen by type) -> one ``error: ...`` line (+ hint), exit 2;
    other exceptions are bugs and keep their traceback; click usage errors -> click's
    ``Error: ...`` with exit 2; Ctrl-C -> ``interrupted``, exit 130.
    """
    _register()
    args = sys.argv[1:] if argv is None else argv
    typer_speedups.apply(help_only=not args or "--help" in args)
    click_errors, click_exits, click_aborts = _click_exception_types()
    try:
        rv = app(args=argv, standalone_mode=False, prog_name="eldr")
    except InvalidParameterError as e:  # the library names the parameter; say the flag that set it
        from eldr_cli.commands._common import PARAM_FLAGS

        return _print_error(e.renamed(PARAM_FLAGS))
    except EldrError as e:
        return _print_error(e)
    except KeyboardInterrupt:
        return _interrupted()
    except click_errors as e:
        e.show()  # type: ignore[attr-defined]  # a ClickException of typer's click or of click
        return int(e.exit_code)  # type: ignore[attr-defined]
    except click_exits as e:
        code = int(e.exit_code)  # type: ignore[attr-defined]
        return _interrupted() if code == INTERRUPTED else code
    except click_aborts:  # click turns Ctrl-C at a prompt / EOF into Abort
        return _interrupted()
    except SystemExit as e:
        return int(e.code or 0) if not isinstance(e.code, str) else 2
    except BrokenPipeError:  # `eldr ... | head`
        return 0
    # In non-standalone mode typer catches KeyboardInterrupt, turns it into Exit(130) and
    # returns that code; commands themselves return None.
    if isinstance(rv, int) and not isinstance(rv, bool):
        return _interrupted() if rv == INTERRUPTED else rv
    return 0


def main() -> None:
    code = run()
    from eldr_cli.commands._common import teardown_skipped

    if code == 0 and teardown_skipped():
        import os

        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except BrokenPipeError:  # `eldr ... | head`
            pass
        os._exit(0)
    sys.exit(code)


if __name__ == "__main__":
    main()
