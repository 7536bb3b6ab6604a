"""Every parameter's valid values, declared once (scikit-learn's ``_parameter_constraints``).

The estimators (``BalancedKMeans(n_clusters=...)``, ``LayerSelector(n_pairs=...)``), the pipeline's
checks, the CLI's options (``eldr_cli.commands._common.checked``), the proxy's config and its admin
endpoint all check a parameter against the one declaration below and word the refusal from it, so
they say the same thing without copies of the range:

>>> validate_parameter("tau", 3)
Traceback (most recent call last):
...
eldr_cli.errors.InvalidParameterError: tau must be a number in [0, 2], got 3

To add a parameter: declare it in :data:`PARAMETER_CONSTRAINTS` (its name is the library's,
``n_clusters``, not a flag's), call :func:`validate_parameter` where it is used, give its CLI option
``callback=checked(name)`` and map the name to its flag in ``commands/_common.PARAM_FLAGS``.
Imported by ``eldr --help``: standard library only.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any

from eldr_cli.errors import InvalidParameterError


@dataclass(frozen=True)
class Interval:
    """Numbers of ``type`` (numbers.Integral or numbers.Real) between ``left`` and ``right`` (None: unbounded);
    ``closed`` says which ends belong to it: "both", "left", "right" or "neither". Booleans and NaN are
    refused."""

    type: type
    left: float | None
    right: float | None
    closed: str = "both"

    def accepts(self, value: Any) -> bool:
        if isinstance(value, bool) or not isinstance(value, self.type) or value != value:
            return False
        v: Any = value  # a number (isinstance above narrows it to ``object``)
        left_in = self.closed in ("both", "left")
        right_in = self.closed in ("both", "right")
        if self.left is not None and not (v >= self.left if left_in else v > self.left):
            return False
        return self.right is None or (v <= self.right if right_in else v < self.right)

    def convert(self, value: Any) -> Any:
        return int(value) if self.type is numbers.Integral else float(value)

    def refusal(self, value: Any, what: str | None = None) -> str:
        """Why ``value`` is refused; ``what`` (the parameter's or the flag's name) leads the sentence."""
        return f"{what + ' ' if what else ''}must be {self}, got {value!r}"

    def __str__(self) -> str:
        kind = "an integer" if self.type is numbers.Integral else "a number"
        lo, hi = self.left, self.right
        if kind == "an integer" and hi is None and lo in (0, 1) and self.closed in ("both", "left"):
            return "a positive integer" if lo == 1 else "a non-negative integer"
        if lo is not None and hi is not None:
            opening = "[" if self.closed in ("both", "left") else "("
            closing = "]" if self.closed in ("both", "right") else ")"
            return f"{kind} in {opening}{lo:g}, {hi:g}{closing}"
        if lo is not None:
            return f"{kind} {'>=' if self.closed in ('both', 'left') else '>'} {lo:g}"
        if hi is not None:
            return f"{kind} {'<=' if self.closed in ('both', 'right') else '<'} {hi:g}"
        return kind


@dataclass(frozen=True)
class StrOptions:
    """One of a fixed set of strings."""

    options: tuple[str, ...]

    def accepts(self, value: Any) -> bool:
        return isinstance(value, str) and value in self.options

    def convert(self, value: Any) -> Any:
        return value

    def refusal(self, value: Any, what: str | None = None) -> str:
        if what is None:
            return f"{value!r} is not {self}"
        return f"unknown {what} {value!r}; expected {self}"

    def __str__(self) -> str:
        return "one of " + ", ".join(self.options)


Constraint = Interval | StrOptions

# §4.2.3 / Fig. 7: the six candidate signature transforms ("auto": score them all by rho, keep the best)
TRANSFORMS = ("count", "count-idf", "sqrt", "binary", "gate-prob", "gate-logit")

# Cosine similarities lie in [-1, 1], so a band wider than 2 changes nothing (§4.3.2); with non-negative
# (count) signatures any tau >= 1 already admits every worker (pure least-loaded).
TAU = Interval(numbers.Real, 0.0, 2.0, closed="both")

PARAMETER_CONSTRAINTS: dict[str, Constraint] = {
    "tau": TAU,
    # K, the number of decode workers (= centroids); also at most the number of signatures (data-dependent:
    # :func:`validate_n_clusters`)
    "n_clusters": Interval(numbers.Integral, 1, None),
    # Eq. 1's fixed-seed pair sample; fewer than 10 pairs make rho meaningless
    "n_pairs": Interval(numbers.Integral, 10, None),
    # decode concurrency per decoder (placement's 1-(1-p)^B, the replays)
    "batch_size": Interval(numbers.Integral, 1, None),
    "ep_size": Interval(numbers.Integral, 1, None),
    "n_redundant": Interval(numbers.Integral, 0, None),
    "transform": StrOptions(("auto", *TRANSFORMS)),
    "split": StrOptions(("calibration", "evaluation", "all")),
    # the proxy
    "port": Interval(numbers.Integral, 1, 65535),
    "workers": Interval(numbers.Integral, 1, 64),
}

# What a parameter is, in the words of messages that name no flag (the library's own errors)
DESCRIPTIONS = {"n_clusters": "the number of decoders K"}


def validate_parameter(name: str, value: Any, *, what: str | None = None) -> Any:
    """``value`` (converted to int/float) if the declaration of ``name`` accepts it; otherwise
    :class:`InvalidParameterError` naming ``name``, worded from the declaration ("``what`` must be ...";
    ``what`` defaults to the name)."""
    c = PARAMETER_CONSTRAINTS[name]
    if not c.accepts(value):
        raise InvalidParameterError(name, c.refusal(value, what or name))
    return c.convert(value)


def validate_params(params: dict[str, Any]) -> dict[str, Any]:
    """Each declared parameter of ``params`` checked (None: unset, left alone); the converted values."""
    return {k: v if v is None or k not in PARAMETER_CONSTRAINTS else validate_parameter(k, v)
            for k, v in params.items()}


def validate_n_clusters(value: Any, n_signatures: int, *, hint: str | None = None) -> int:
    """K within its declaration and at most the number of signatures it clusters."""
    c = PARAMETER_CONSTRAINTS["n_clusters"]
    if not c.accepts(value) or value > n_signatures:
        assert isinstance(c, Interval) and c.left is not None
        raise InvalidParameterError(
            "n_clusters", f"{DESCRIPTIONS['n_clusters']} must be between {c.left:g} and the number of "
                          f"calibration signatures N={n_signatures}, got {value!r}", hint=hint)
    return int(value)
