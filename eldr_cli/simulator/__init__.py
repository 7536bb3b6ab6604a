"""The discrete-event engine behind `eldr bench simulate` (:mod:`eldr_cli.simulator.core`); the
artifact-to-artifact function that drives it is :func:`eldr_cli.pipeline.simulate.run_simulate`."""
