"""The library behind the CLI: artifact-to-artifact functions, one module per operation.

- :mod:`~eldr_cli.pipeline.fit`: fit-idf -> select-layers -> cluster (and fit, all three);
- :mod:`~eldr_cli.pipeline.place`: per-decoder expert placement (fit + vLLM EPLB export);
- :mod:`~eldr_cli.pipeline.evaluate`: replay held-out decode batches and score placements (METRO metric);
- :mod:`~eldr_cli.pipeline.capture`: prompts -> model backend -> trace;
- :mod:`~eldr_cli.pipeline.import_trace`: public Orders-in-Chaos traces -> trace;
- :mod:`~eldr_cli.pipeline.simulate`: trace + cost model + routing -> simulated bench result.

Each reads its input artifacts, calls the method (:mod:`eldr_cli.method`) and writes one artifact
atomically; the commands in :mod:`eldr_cli.commands` are thin wrappers around these functions.
"""
