"""IDF weights of (layer, expert) cells (ELDR §4.2.2 step 2)."""

from __future__ import annotations

import numpy as np

from eldr_cli.errors import InvalidDataError


class ExpertIDF:
    """w(l, e) = log((|C| + 1) / (df(l, e) + 1)), df = requests in which e fires at least once at l.

    fit(prefill_counts int [R, L, E]) -> self, with ``idf_`` float64 [L, E], ``df_`` int64 [L, E],
    ``n_requests_``. transform(counts [..., L, E]) -> counts * idf_.
    """

    def fit(self, prefill_counts: np.ndarray) -> "ExpertIDF":
        c = np.asarray(prefill_counts)
        if c.ndim != 3 or c.shape[0] == 0:
            raise InvalidDataError(f"IDF needs prefill counts [R, L, E] with R >= 1, got shape {c.shape}")
        self.n_requests_ = int(c.shape[0])
        self.df_ = (c > 0).sum(axis=0).astype(np.int64)
        self.idf_ = np.log((self.n_requests_ + 1.0) / (self.df_ + 1.0))
        return self

    def transform(self, counts: np.ndarray) -> np.ndarray:
        return np.asarray(counts, dtype=np.float64) * self.idf_
