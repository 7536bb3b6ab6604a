"""Parameter checks of the estimators and policies, in scikit-learn style.

The method's classes check their own parameters (in ``__init__`` or ``fit``) and raise
:class:`InvalidParameterError`, a ``ValueError``/``TypeError`` that names the *parameter*
(``n_pairs``, ``n_clusters``, ``ep_size``), not a command-line flag: the library knows nothing
of the CLI. Problems with the data passed to ``fit`` are plain ``ValueError``. The CLI translates
both into one ``error:`` line with the flag's name (``eldr_cli.main``).
"""

from __future__ import annotations

import numbers
from typing import Iterable


class InvalidParameterError(ValueError, TypeError):
    """A parameter has a value the estimator cannot use; ``param`` is its name."""

    def __init__(self, param: str, message: str, *, hint: str | None = None):
        self.param = param
        self.hint = hint
        super().__init__(message)


def check_int(value, param: str, *, min: int | None = None, max: int | None = None) -> int:
    """``value`` as an int within [min, max]; booleans and floats are refused."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidParameterError(param, f"{param} must be an integer, got {value!r}")
    v = int(value)
    if (min is not None and v < min) or (max is not None and v > max):
        raise InvalidParameterError(param, f"{param} must be {_interval(min, max)}, got {v}")
    return v


def check_float(value, param: str, *, min: float | None = None, max: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or value != value:
        raise InvalidParameterError(param, f"{param} must be a number, got {value!r}")
    v = float(value)
    if (min is not None and v < min) or (max is not None and v > max):
        raise InvalidParameterError(param, f"{param} must be {_interval(min, max)}, got {v:g}")
    return v


def check_choice(value, param: str, choices: Iterable[str]) -> str:
    choices = tuple(choices)
    if value not in choices:
        raise InvalidParameterError(param, f"unknown {param} {value!r}; expected one of {', '.join(choices)}")
    return value


def _interval(lo, hi) -> str:
    if lo is not None and hi is not None:
        return f"in [{lo:g}, {hi:g}]"
    return f">= {lo:g}" if lo is not None else f"<= {hi:g}"
