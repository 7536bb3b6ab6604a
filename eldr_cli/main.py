"""The `eldr` command. Each subcommand lives in eldr_cli/commands/<name>.py and registers itself;
heavy libraries are imported inside the commands so `eldr --help` starts fast.

Exit codes: 0 success, 2 anything the user can fix (usage errors, bad files, refused outputs),
130 interrupted (Ctrl-C). typer vendors click as ``typer._click``; its exceptions are not the
``click`` package's, so both are caught here.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path, PurePath

import typer

from eldr_cli.errors import EldrError, InvalidParameterError

app = typer.Typer(
    name="eldr",
    help="Expert-locality-aware decode routing for PD-disaggregated MoE serving on vLLM.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

# one module per subcommand (or group); each defines register(app)
COMMAND_MODULES = ["inspect", "synth", "fit", "model", "serve_proxy", "place", "bench", "emulate", "capture", "report"]

INTERRUPTED = 130


def _register() -> None:
    import importlib

    for name in COMMAND_MODULES:
        importlib.import_module(f"eldr_cli.commands.{name}").register(app)


def _no_type_for_flags() -> None:
    """typer 0.29 shows ``<bool>`` after flags such as ``--vanilla`` that take no value; show nothing."""
    from typer.core import TyperOption

    if getattr(TyperOption.display_type_rich, "_eldr", False):
        return
    shown = TyperOption.display_type_rich

    def display_type_rich(self: TyperOption, ctx):
        return None if self.is_flag and self.metavar is None else shown(self, ctx)

    display_type_rich._eldr = True  # type: ignore[attr-defined]
    TyperOption.display_type_rich = display_type_rich  # type: ignore[method-assign]


_PLAIN_NUMBER = {int: re.compile(r"-?(0|[1-9][0-9]*)"), float: re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?")}


def _plain_value(param, ctx, value):
    """A given option value converted the way typer's pydantic adapter would, for the plain cases
    (a str; an int or float written as plain digits, within its bounds; a Path with no path_type),
    or None: then typer converts it (and words any error) itself."""
    from typer._param_types import coerce_cli_path

    info, kind = param.type_descriptor.parameter_info, param.type_descriptor.annotation
    if not isinstance(value, str) or param.nargs != 1 or param.multiple or info.parser is not None:
        return None
    if kind is str:
        return value
    if kind in _PLAIN_NUMBER:
        if info.clamp or not _PLAIN_NUMBER[kind].fullmatch(value):
            return None
        v = kind(value)
        inside = (info.min is None or v >= info.min) and (info.max is None or v <= info.max)
        return v if inside else None
    if isinstance(kind, type) and issubclass(kind, Path) and info.path_type is None and value:
        return coerce_cli_path(kind(value), info, path_type=kind, param=param, ctx=ctx)  # typer's own checks
    return None


def _no_adapter_for_plain_values() -> None:
    """typer 0.29 builds a pydantic TypeAdapter for each option it processes, also for options that
    were not given: value None, which its coercion passes through unchanged without the adapter, or
    the option's own default (a group's options are processed before ``group sub --help``).
    Importing pydantic for that was ~0.15 s of every ``eldr ... --help``; building the adapters
    of the options given, another ~0.1 s of every command. Those values go through typer's
    pass-through coercion instead: eldr's defaults are plain values of the declared type, and a
    given value is converted first when it is plain (:func:`_plain_value`); any other value is
    coerced, or refused, by typer as before."""
    try:
        from typer._coercion import PassThroughRuntimeParam
        from typer.core import _TyperParameter
        from typer.models import OptionInfo
    except ImportError:  # pragma: no cover - another typer: leave it alone
        return
    if getattr(_TyperParameter.process_value, "_eldr", False):
        return
    process = _TyperParameter.process_value

    def process_value(self: _TyperParameter, ctx, value):
        kind = self.type_descriptor.annotation
        plain_default = (value is self.default and isinstance(value, (bool, int, float, str, PurePath))
                         and isinstance(kind, type) and isinstance(value, kind))
        if self._runtime_param is not None:
            return process(self, ctx, value)
        if not (value is None or plain_default):
            converted = _plain_value(self, ctx, value)
            if converted is None:
                return process(self, ctx, value)
            value, plain_default = converted, True
        # typer's pass-through: returns a value of the declared type (or None) unchanged
        self._runtime_param = PassThroughRuntimeParam(parameter_info=OptionInfo(),
                                                      annotation=kind if plain_default else object)
        try:
            return process(self, ctx, value)
        finally:
            self._runtime_param = None

    process_value._eldr = True  # type: ignore[attr-defined]
    _TyperParameter.process_value = process_value  # type: ignore[method-assign]


def _help_without_markdown() -> None:
    """Import typer's help renderer without ``rich.markdown`` (markdown-it, ~50 ms of every --help):
    eldr's help text is rich markup, never markdown, so typer's ``Markdown`` is never built. A
    stand-in is visible only while typer.rich_utils imports; should it ever be built, it imports the
    real class."""
    import types

    if "typer.rich_utils" in sys.modules or "rich.markdown" in sys.modules:
        return

    class Markdown:
        def __new__(cls, *args, **kwargs):
            from rich.markdown import Markdown as real

            return real(*args, **kwargs)

    stand_in = types.ModuleType("rich.markdown")
    stand_in.Markdown = Markdown  # type: ignore[attr-defined]
    sys.modules["rich.markdown"] = stand_in
    try:
        import typer.rich_utils  # noqa: F401
    finally:
        if sys.modules.get("rich.markdown") is stand_in:
            del sys.modules["rich.markdown"]


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
    _no_type_for_flags()
    _no_adapter_for_plain_values()
    args = sys.argv[1:] if argv is None else argv
    if not args or "--help" in args:
        _help_without_markdown()
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
