"""What the benchmarks share: arguments, the record of the machine a run saw, JSON output into
bench-results/ (:mod:`.env`); the paired before/after alternation with its interval (:mod:`.paired`);
processes, the load generator, stub clusters and the decision fixture of the serving benchmarks
(:mod:`.procs`, :mod:`.loadgen`, :mod:`.stubs`, :mod:`.decisions`)."""

from benchmarks.base.env import BIN, PY, ROOT, environment, parser, snapshot, write_result
from benchmarks.base.paired import alternate, alternate_commands, command, order, paired_interval, tree_at

__all__ = ["BIN", "PY", "ROOT", "alternate", "alternate_commands", "command", "environment", "order",
           "paired_interval", "parser", "snapshot", "tree_at", "write_result"]
