"""The ELDR method, importable without the CLI: signatures, IDF, layer selection, balanced
clustering, the routing decision and placement. Each learner follows scikit-learn's contract."""
