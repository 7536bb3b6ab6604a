"""The library behind the CLI: artifact-to-artifact functions, one module per operation.

- :mod:`~eldr_cli.pipeline.fit`: fit-idf -> select-layers -> cluster (and fit, all three);
- :mod:`~eldr_cli.pipeline.refit`: fit --from-decision-log (new clusters on the signatures a proxy logged);
- :mod:`~eldr_cli.pipeline.place`: per-decoder expert placement (fit + vLLM EPLB export);
- :mod:`~eldr_cli.pipeline.evaluate`: replay held-out decode batches and score placements (METRO metric);
- :mod:`~eldr_cli.pipeline.capture`: prompts -> model backend -> trace;
- :mod:`~eldr_cli.pipeline.simulate`: trace + cost model + routing -> simulated bench result;
- :mod:`~eldr_cli.pipeline.replay`: trace + routing -> distinct active experts per decode step (Fig. 13);
- :mod:`~eldr_cli.pipeline.decision_replay`: a proxy's decision log as a trace (what refit and
  `eldr report --decision-log` read);
- :mod:`~eldr_cli.pipeline.checks`: the checks across artifacts (same trace, K, tau, batch size).

Each reads its input artifacts, calls the method (:mod:`eldr_cli.method`) and writes one artifact
atomically; the commands in :mod:`eldr_cli.commands` are thin wrappers around these functions.
`eldr report` is its own package (:mod:`eldr_cli.report`), the trace import lives with capture
(:mod:`eldr_cli.capture.import_trace`); ``pipeline.report.run_report`` and ``pipeline.import_trace.import_trace``
stay importable under the names docs/library.md gave them.
"""
