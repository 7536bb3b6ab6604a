"""Startup speed-ups that reach into typer's internals, applied only to the typer versions they were
written and tested against (:data:`TESTED`); under any other typer ``eldr`` runs unpatched, slower
but correct. pyproject bounds typer to the same range, so an upgrade is a deliberate step: widen
:data:`TESTED` (and the bound) once ``tests/test_cli_errors.py::
test_given_option_values_convert_as_typer_converts_them`` passes against the new version.

Why patch at all: typer 0.29 converts every option through a pydantic ``TypeAdapter`` and offers
no public way around it (``parser=``/``click_type=`` build an adapter too), and its help renderer
imports ``rich.markdown``. Measured (issue 22, interleaved runs, load average ~8): unpatched,
``eldr fit --help`` took 1.01 s (median of 8) vs 0.66 s patched, and an error path
(``eldr fit --trace nope``) 1.23 s vs 0.77 s. The way without any patch is a CLI on plain click
(sqlite-utils' model): a rewrite of every command module, left for later.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path, PurePath

# typer versions whose internals the patches below were checked against
TESTED = ("0.29.",)


def apply(*, help_only: bool) -> bool:
    """Apply the speed-ups (``help_only``: the command line asks for help, where the markdown
    import is saved too); False, and nothing patched, under an untested typer."""
    import typer

    if not typer.__version__.startswith(TESTED):
        return False
    _no_type_for_flags()
    _no_adapter_for_plain_values()
    if help_only:
        _help_without_markdown()
    return True


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
