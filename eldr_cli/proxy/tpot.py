"""The decoders' live TPOT, scraped with ``--scrape-metrics`` from vLLM's ``vllm:time_per_output_token_seconds``
histogram (its sum and count): the mean over each scrape interval, which the decision log records so that
`eldr report --decision-log` can hold the cost model's prediction to it."""

from __future__ import annotations

from typing import Any

TPOT = "vllm:time_per_output_token_seconds"


def update_tpot(w: Any, text: str) -> None:
    """A decoder's mean TPOT (ms) between its last two scrapes of ``vllm:time_per_output_token_seconds``
    (sum and count over its model names); unchanged when it has no new tokens, None without the metric."""
    tot = [0.0, 0.0]
    seen = False
    for line in text.splitlines():
        for i, name in enumerate((TPOT + "_sum", TPOT + "_count")):
            if line.startswith(name):
                try:
                    tot[i] += float(line.rsplit(" ", 1)[1])
                    seen = True
                except (IndexError, ValueError):
                    pass
    if not seen:
        w.scraped_tpot_ms, w.tpot_totals = None, None
        return
    prev, w.tpot_totals = w.tpot_totals, (tot[0], tot[1])
    if prev is not None and tot[1] > prev[1]:
        w.scraped_tpot_ms = 1e3 * (tot[0] - prev[0]) / (tot[1] - prev[1])
