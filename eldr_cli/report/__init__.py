"""`eldr report`: what ELDR buys a deployment, predicted from one trace for one cost model (SIMULATED).

The report's path, one module per step:

- :mod:`~eldr_cli.report.run`: :func:`run_report` chains what is missing (fit, cost model), builds the
  simulation setup, runs the study, judges it, adds the trace replay and writes the report atomically;
- :mod:`~eldr_cli.report.capacity`: the capacity search (bracket, then bisect) and the SLO and its defaults;
- :mod:`~eldr_cli.report.study`: the simulation setup and the study (capacity per router and seed, every
  router at each load point), the simulator called as a library;
- :mod:`~eldr_cli.report.sensitivity`: the headline gain again with the GPU's costs moved;
- :mod:`~eldr_cli.report.verdict`: the study judged: report.json's ``verdict``, its sentence, the figure;
- :mod:`~eldr_cli.report.render`: report.md and the self-contained report.html from the document;
- :mod:`~eldr_cli.report.decision_log`: the same report on the traffic of a proxy's decision log.

Intervals come from :mod:`eldr_cli.stats`.
"""

from eldr_cli.report.run import run_report

__all__ = ["run_report"]
