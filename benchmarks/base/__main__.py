"""Two shell commands timed in alternation (the code before and after a change, say): wall and CPU seconds
of every run, and after / before as the mean of the per-round ratios with a 95% t-interval.

    python -m benchmarks.base --before "PYTHONPATH=/work/base eldr fit ..." --after "eldr fit ..." --rounds 8
"""

from __future__ import annotations

import sys

from benchmarks.base.env import environment, parser, write_result
from benchmarks.base.paired import alternate_commands


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, "bench-results/paired.json")
    ap.add_argument("--before", required=True, help="the shell command of the code before")
    ap.add_argument("--after", required=True, help="the shell command of the code after")
    ap.add_argument("--rounds", type=int, default=6, help="rounds of the two (default: %(default)s)")
    a = ap.parse_args(argv)
    if a.rounds < 2:
        ap.error("--rounds must be at least 2 for an interval")
    env = environment()
    res = alternate_commands(a.before, a.after, a.rounds)
    res.update(before=a.before, after=a.after)
    for key in ("wall_s", "cpu_s"):
        p = res[key]["ratio_after_over_before"]
        print(f"{key}: before {res[key]['before_median']:.3f}, after {res[key]['after_median']:.3f} (medians); "
              f"after / before {p['mean']:.3f} [{p['ci'][0]:.3f}, {p['ci'][1]:.3f}] over {a.rounds} paired "
              f"rounds: {p['verdict']}")
    print(f"wrote {write_result(a.out, res, env)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
