"""`eldr report` as a library call, under the name docs/library.md gave it: the report lives in the
:mod:`eldr_cli.report` package (study, verdict, render)."""

from eldr_cli.report.run import run_report

__all__ = ["run_report"]
