"""Does a request's soft prefill gate mass predict its decode better than its top-k prefill counts? (issue 35)

An experiment, not part of eldr. The trace's optional ``prefill_gate_prob`` [R, L, E] (the router's softmax
summed over the prompt's tokens, written by `eldr capture` unless ``--no-gate-sums``) sums to the prompt's
tokens per layer, as the counts sum to top-k times them; times top-k it takes the counts' place in eldr-live's
predictor (``gate``), or half of it (``mix``), while the signatures, prototypes and split stay the counts'.
Everything else is ``predictor_regret.py``'s (the fit's held-back split, its candidates, Brier, batch unions and
decision regret). ``counts`` is the served form, for comparison in the same run. docs/routing.md quotes it:

    python docs/experiments/gate_predictor.py artifacts/demo/trace --input gate
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import predictor_regret  # noqa: E402

from eldr_cli.artifacts.trace import read_trace  # noqa: E402
from eldr_cli.method.live import DecodeActivation  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", type=Path)
    ap.add_argument("--decoders", type=int, default=8)
    ap.add_argument("--input", choices=("counts", "gate", "mix"), default="gate")
    a = ap.parse_args()
    tr = read_trace(a.trace, with_picks=False)
    if tr.prefill_gate_prob is None:
        raise SystemExit("the trace has no prefill_gate_prob (captured with --no-gate-sums, or imported)")
    row_of = {tr.prefill_counts[i].tobytes(): i for i in range(len(tr.prefill_counts))}
    fit = DecodeActivation.fit

    def fit_on_gates(self, S, decode_counts, decode_steps, prefill_counts=None, top_k=1):
        pc = np.asarray(prefill_counts)
        rows = [row_of[r.astype(tr.prefill_counts.dtype).tobytes()] for r in pc]
        g = tr.prefill_gate_prob[rows].astype(np.float64) * top_k
        if a.input == "mix":
            g = 0.5 * g + 0.5 * pc
        return fit(self, S, decode_counts, decode_steps, g, top_k)

    if a.input != "counts":
        DecodeActivation.fit = fit_on_gates
    predictor_regret.main([str(a.trace), "--decoders", str(a.decoders)])


if __name__ == "__main__":
    main()
