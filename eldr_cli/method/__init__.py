"""The fit-time ELDR method, importable without the CLI: signatures (Eq. 1-2), IDF, greedy layer
selection, balanced clustering, eldr-live's decode-activation model and per-decoder expert placement.
Each learner follows scikit-learn's contract. The serving-time decision is in :mod:`eldr_cli.routing`."""
