"""`eldr capture --from-trace` as a library call, under the name docs/library.md gave it: the import lives in
:mod:`eldr_cli.capture.import_trace`, beside the capture it feeds the same staging and trace artifact."""

from eldr_cli.capture.import_trace import import_trace, parse_trace_file

__all__ = ["import_trace", "parse_trace_file"]
