"""The entry points docs/library.md names keep importing from where it first put them (issue 36 moved them)."""

from __future__ import annotations


def test_moved_entry_points_are_the_same_objects_under_their_documented_names():
    from eldr_cli.capture.import_trace import import_trace
    from eldr_cli.pipeline.import_trace import import_trace as documented_import
    from eldr_cli.pipeline.report import run_report as documented_report
    from eldr_cli.report import run_report

    assert documented_import is import_trace and documented_report is run_report
