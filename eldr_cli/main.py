"""The `eldr` command. Each subcommand lives in eldr_cli/commands/<name>.py and registers itself;
heavy libraries are imported inside the commands so `eldr --help` starts fast."""

from __future__ import annotations

import sys

import typer

from eldr_cli.errors import EldrError

app = typer.Typer(
    name="eldr",
    help="Expert-locality-aware decode routing for PD-disaggregated MoE serving on vLLM.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

# one module per subcommand (or group); each defines register(app)
COMMAND_MODULES = ["inspect", "synth", "fit", "model", "serve_proxy", "place", "bench", "emulate", "capture"]


def _register() -> None:
    import importlib

    for name in COMMAND_MODULES:
        importlib.import_module(f"eldr_cli.commands.{name}").register(app)


@app.callback()
def _main(version: bool = typer.Option(False, "--version", help="Print the version and exit.")) -> None:
    if version:
        from eldr_cli import __version__

        typer.echo(f"eldr {__version__}")
        raise typer.Exit(0)


def run(argv: list[str] | None = None) -> int:
    """Entry point: runs the app, turning EldrError into one message and exit code 2."""
    _register()
    try:
        app(args=argv, standalone_mode=False)
    except EldrError as e:
        from rich.console import Console
        from rich.markup import escape

        Console(stderr=True).print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except SystemExit as e:  # typer.Exit inside commands
        return int(e.code or 0)
    except Exception as e:  # click usage errors carry their own exit codes
        import click

        if isinstance(e, click.exceptions.ClickException):
            e.show()
            return e.exit_code
        if isinstance(e, click.exceptions.Exit):
            return e.exit_code
        if isinstance(e, click.exceptions.Abort):  # click turns Ctrl-C into Abort
            print("interrupted", file=sys.stderr)
            return 130
        raise
    return 0


def main() -> None:
    sys.exit(run())


if __name__ == "__main__":
    main()
