"""Each parameter's constraint is declared once (eldr_cli.constraints); the estimators, the CLI options, the
proxy config and the admin endpoint all refuse the same values with words generated from it; the CLI
chooses how to print an error by its type (eldr_cli.errors)."""

from __future__ import annotations

import math
import numbers

import pytest
import typer

from eldr_cli.commands._common import PARAM_FLAGS, checked
from eldr_cli.constraints import (
    PARAMETER_CONSTRAINTS,
    Interval,
    StrOptions,
    validate_n_clusters,
    validate_parameter,
    validate_params,
)
from eldr_cli.errors import EldrError, InvalidDataError, InvalidParameterError


@pytest.mark.parametrize("closed,inside,outside", [
    ("both", [0, 1, 2, 0.5], [-0.1, 2.1]),
    ("left", [0, 1.99], [2, -1]),
    ("right", [2, 0.01], [0, 3]),
    ("neither", [1], [0, 2]),
])
def test_interval_ends(closed, inside, outside):
    c = Interval(numbers.Real, 0, 2, closed=closed)
    assert all(c.accepts(v) for v in inside) and not any(c.accepts(v) for v in outside)
    assert not c.accepts(True) and not c.accepts(math.nan) and not c.accepts("1")


def test_interval_and_options_words():
    assert str(Interval(numbers.Real, 0, 2)) == "a number in [0, 2]"
    assert str(Interval(numbers.Real, 0, 1, closed="left")) == "a number in [0, 1)"
    assert str(Interval(numbers.Integral, 1, None)) == "a positive integer"
    assert str(Interval(numbers.Integral, 0, None)) == "a non-negative integer"
    assert str(Interval(numbers.Integral, 10, None)) == "an integer >= 10"
    assert str(Interval(numbers.Real, 0, None, closed="neither")) == "a number > 0"
    assert not Interval(numbers.Integral, 1, None).accepts(1.0)
    assert StrOptions(("a", "b")).refusal("c", "mode") == "unknown mode 'c'; expected one of a, b"


def test_validate_parameter_converts_and_names_the_parameter():
    assert validate_parameter("tau", 1) == 1.0 and isinstance(validate_parameter("tau", 1), float)
    with pytest.raises(InvalidParameterError) as e:
        validate_parameter("n_pairs", 5)
    assert e.value.param == "n_pairs" and str(e.value) == "n_pairs must be an integer >= 10, got 5"
    assert isinstance(e.value, (ValueError, EldrError))
    assert validate_params({"tau": None, "n_pairs": 10, "seed": 3}) == {"tau": None, "n_pairs": 10, "seed": 3}
    with pytest.raises(InvalidParameterError, match="K must be between 1 and .* N=5, got 6"):
        validate_n_clusters(6, 5)


def test_renamed_puts_the_flag_in_the_parameters_place():
    e = InvalidParameterError("n_pairs", "n_pairs must be an integer >= 10, got 5", hint="raise n_pairs")
    err = e.renamed(PARAM_FLAGS)
    assert type(err) is EldrError and err.message == "--pairs must be an integer >= 10, got 5"
    assert err.hint == "raise --pairs"
    other = InvalidParameterError("transform", "unknown transform 'x'").renamed(PARAM_FLAGS)
    assert other.message == "--transform: unknown transform 'x'"


@pytest.mark.parametrize("value", [-0.5, 2.5, True, "0.1"])
def test_tau_is_refused_alike_everywhere(value):
    """The CLI option, the proxy config, the admin endpoint and the pipeline all word it from TAU."""
    from eldr_cli.pipeline.checks import check_tau
    from eldr_cli.proxy.admin import validate_policy_change
    from eldr_cli.proxy.config import ProxyConfig

    expected = PARAMETER_CONSTRAINTS["tau"].refusal(value)  # "must be a number in [0, 2], got ..."
    with pytest.raises(typer.BadParameter, match=expected.replace("[", r"\[")):
        checked("tau")(value)
    cfg = ProxyConfig(prefill=["http://127.0.0.1:1"], decode=["http://127.0.0.1:2"], policy="jsq", tau=value)
    for call in (cfg.validate, lambda: validate_policy_change({"tau": value}, policy="eldr", tau=None),
                 lambda: check_tau(value)):
        with pytest.raises(InvalidParameterError) as e:
            call()
        assert str(e.value).endswith(expected), str(e.value)


def test_admin_policy_change_keeps_what_the_body_leaves_out():
    from eldr_cli.proxy.admin import validate_policy_change

    assert validate_policy_change({}, policy="eldr", tau=0.3) == ("eldr", 0.3)
    assert validate_policy_change({"tau": 1}, policy="jsq", tau=None) == ("jsq", 1.0)
    assert validate_policy_change({"tau": None, "policy": "p2c"}, policy="eldr", tau=0.3) == ("p2c", None)
    with pytest.raises(InvalidParameterError):
        validate_policy_change({"policy": 3}, policy="eldr", tau=None)


def test_cli_prints_the_family_by_type_and_keeps_tracebacks_of_bugs(monkeypatch, capsys, tmp_path):
    """No traceback inspection: an InvalidDataError raised anywhere is one error line; a ValueError
    that is not in the family is a bug and propagates."""
    from eldr_cli import main
    from eldr_cli.commands import fit

    def boom(exc):
        def run_fit_idf(*args, **kwargs):
            raise exc
        return run_fit_idf

    import eldr_cli.pipeline.fit as pipeline_fit

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(pipeline_fit, "run_fit_idf", boom(InvalidDataError("IDF needs prefill counts")))
    assert main.run(["fit-idf", "--trace", "t", "--out", "o"]) == 2
    assert capsys.readouterr().err.strip() == "error: IDF needs prefill counts"
    monkeypatch.setattr(pipeline_fit, "run_fit_idf", boom(ValueError("a bug")))
    with pytest.raises(ValueError, match="a bug"):
        main.run(["fit-idf", "--trace", "t", "--out", "o"])
    assert fit.fit_idf_cmd  # the command module stays a thin wrapper over pipeline.fit

