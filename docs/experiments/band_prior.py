"""eldr-live's band prior on and off, per trace (issue 35): the table docs/routing.md quotes.

An experiment's read-out, not part of eldr. Each argument is ``LABEL=FIT,OFF,ON``: the routing artifact the
reports used (its calibration figure decides the prior, ``routing.live.band_prior_weight``) and two ``eldr
report`` directories on the same trace, cost model, SLO and seeds, with eldr-live's band prior 0 (OFF) and 0.5
(ON; a copy of the fit with ``params.band_prior`` set). Only eldr-live differs between them (the other routers'
capacities are the same to the digit, which it checks; eldr and the clairvoyant are read from whichever report
ran them). Prints a markdown table: the fit's mean cosine of its
calibration requests to their centroid, the weight the fit chose, eldr, eldr-live with the prior off and on
(capacity against the best load balancer), paired on = off (per seed), and the clairvoyant twin::

    python docs/experiments/band_prior.py demo=FIT,OFF,ON oic=FIT,OFF,ON
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from eldr_cli.routing.live import band_prior_weight
from eldr_cli.stats import paired_pct_ci


def _report(d: str) -> dict:
    return json.loads((Path(d) / "report.json").read_text())


def _rates(rep: dict, router: str) -> list[float | None]:
    return [r["rate_rps"] if r["status"] == "found" else None for r in rep["capacity"][router]]


def _gain(rep: dict, router: str) -> str:
    g = rep["verdict"]["capacity_gain_vs_best_lb_pct"].get(router)
    return "-" if g is None else f"{g['mean']:+.1f}% [{g['ci95'][0]:+.1f}, {g['ci95'][1]:+.1f}]"


def row(label: str, fit: str, off_dir: str, on_dir: str) -> str:
    p = json.loads((Path(fit) / "routing" / "manifest.json").read_text())["params"]
    off, on = _report(off_dir), _report(on_dir)
    for r in off["capacity"]:
        if r != "eldr-live" and r in on["capacity"] and _rates(off, r) != _rates(on, r):
            raise SystemExit(f"{label}: {r} differs between the two reports (not the same setting)")
    ci = paired_pct_ci(_rates(on, "eldr-live"), _rates(off, "eldr-live"))
    paired = "-" if ci is None else f"{ci.mean:+.1f}% [{ci.lo:+.1f}, {ci.hi:+.1f}]"
    w = band_prior_weight(p.get("drift"), p["tau"])
    cos = p["drift"]["centroid"]["mean"]
    eldr, twin = (_gain(off if r in off["capacity"] else on, r) for r in ("eldr", "clairvoyant"))
    cols = [_gain(off, "eldr-live"), _gain(on, "eldr-live")]
    cols[w > 0] = f"**{cols[w > 0]}**"  # what eldr fit chose
    return f"| {label} | {cos:.3f} | {w:g} | {eldr} | {cols[0]} | {cols[1]} | {paired} | {twin} |"


def main(argv: list[str]) -> int:
    print("| trace | cos to centroid | fit's weight | eldr | eldr-live, prior 0 | eldr-live, prior 0.5 | "
          "paired 0.5 / 0 | clairvoyant |")
    print("|---|---|---|---|---|---|---|---|")
    for a in argv:
        label, _, rest = a.partition("=")
        fit, off, on = rest.split(",")
        print(row(label, fit, off, on))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
