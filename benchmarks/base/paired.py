"""The paired before/after alternation: arms measured in rounds, the order reversed every other round
(A B, B A, A B, ...) so that drift in the machine's other load falls on every arm alike; the values of
one round are a pair, and the comparison is the mean of the per-round differences (or ratios) with a
t-interval over the rounds.

``python -m benchmarks.base --before CMD --after CMD --rounds 8`` times two shell commands that way
(:mod:`benchmarks.base.__main__`).
"""

from __future__ import annotations

import math
import os
import resource
import shlex
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def paired_interval(after: Sequence[float], before: Sequence[float], *, ratio: bool = False) -> dict[str, Any]:
    """Mean of the per-pair ``after - before`` (or ``after / before`` with ``ratio``) and its two-sided 95%
    t-interval over the pairs (:func:`eldr_cli.stats.mean_ci`, the interval every eldr comparison reports);
    NaN bounds with fewer than two pairs. ``verdict`` says whether the interval excludes no change (0, or 1
    for a ratio)."""
    from eldr_cli.stats import LEVEL, mean_ci

    if len(after) != len(before):
        raise ValueError(f"paired values need as many after ({len(after)}) as before ({len(before)})")
    d = [a / b if ratio else a - b for a, b in zip(after, before, strict=True)]
    iv = mean_ci(d)
    n = len(d)
    mean = iv.mean if iv is not None else math.nan
    lo, hi = (iv.lo, iv.hi) if iv is not None and iv.lo is not None and iv.hi is not None else (math.nan, math.nan)
    none = 1.0 if ratio else 0.0
    verdict = ("too few pairs" if n < 2 else "no measurable difference" if lo <= none <= hi
               else "higher after" if lo > none else "lower after")
    return {"kind": "ratio" if ratio else "difference", "pairs": n, "per_pair": d, "mean": mean,
            "ci": [lo, hi], "level": LEVEL, "verdict": verdict}


def order(names: Iterable[T], round_: int) -> list[T]:
    """The arms' order in round ``round_``: as given in even rounds, reversed in odd ones."""
    names = list(names)
    return names if round_ % 2 == 0 else names[::-1]


def alternate(arms: Mapping[str, Callable[[], T]], rounds: int) -> dict[str, list[T]]:
    """Call every arm once per round, in :func:`order`; -> each arm's values, one per round (the pairs)."""
    out: dict[str, list[T]] = {name: [] for name in arms}
    for r in range(rounds):
        for name in order(arms, r):
            out[name].append(arms[name]())
    return out


def command(argv: Sequence[str] | str, cwd: Path | None = None,
            env: Mapping[str, str] | None = None) -> Callable[[], dict[str, float]]:
    """A measurement that runs ``argv`` (a string runs through the shell) to its end and returns its wall
    seconds and CPU seconds (user + system of the process and what it waited for); a failing run stops
    the benchmark with its exit status and the tail of its output."""
    def run() -> dict[str, float]:
        ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        r = subprocess.run(argv, cwd=cwd, env=None if env is None else {**os.environ, **env},
                           shell=isinstance(argv, str), capture_output=True, text=True)
        wall = time.perf_counter() - t0
        ru = resource.getrusage(resource.RUSAGE_CHILDREN)
        if r.returncode != 0:
            shown = argv if isinstance(argv, str) else shlex.join(argv)
            raise SystemExit(f"`{shown}` exited with {r.returncode}:\n{(r.stderr or r.stdout)[-2000:]}")
        return {"wall_s": wall, "cpu_s": (ru.ru_utime - ru0.ru_utime) + (ru.ru_stime - ru0.ru_stime)}
    return run


def tree_at(rev: str | None, dst: Path) -> Path:
    """``eldr_cli`` of commit ``rev`` (with the folders its links point at) unpacked under ``dst`` (``git archive``;
    default: where this branch left main), for a "before" arm run with ``PYTHONPATH=dst``. -> ``dst``."""
    from benchmarks.base.env import ROOT

    base = rev or subprocess.run(["git", "merge-base", "HEAD", "main"], cwd=ROOT, capture_output=True, text=True,
                                 check=True).stdout.strip()
    dst.mkdir(parents=True)
    # eldr_cli/schemas and eldr_cli/kernels are links to top-level folders: those come along where they exist
    paths = ["eldr_cli", *(p for p in ("manifests", "kernels") if subprocess.run(
        ["git", "cat-file", "-e", f"{base}:{p}"], cwd=ROOT, capture_output=True).returncode == 0)]
    arch = subprocess.run(["git", "archive", base, *paths], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dst)], input=arch, check=True)
    return dst


def alternate_commands(before: Sequence[str] | str, after: Sequence[str] | str, rounds: int,
                       cwd: Path | None = None) -> dict[str, Any]:
    """Time ``before`` and ``after`` alternately for ``rounds`` rounds; per-run figures and, for wall and
    CPU seconds, the paired ratio after / before with its 95% interval."""
    runs = alternate({"before": command(before, cwd), "after": command(after, cwd)}, rounds)
    res: dict[str, Any] = {"rounds": rounds, "runs": runs}
    for key in ("wall_s", "cpu_s"):
        a, b = [x[key] for x in runs["after"]], [x[key] for x in runs["before"]]
        res[key] = {"before_median": sorted(b)[len(b) // 2], "after_median": sorted(a)[len(a) // 2],
                    "ratio_after_over_before": paired_interval(a, b, ratio=True)}
    return res
