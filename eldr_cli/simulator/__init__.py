"""The SIMULATED cluster behind `eldr bench simulate` and `eldr report`: :mod:`eldr_cli.simulator.cluster`
runs one (router, rate) in virtual time (arrivals, prefill, the handoff decision, decode) over the
compiled decode engine of :mod:`eldr_cli.simulator.core`; :func:`eldr_cli.pipeline.simulate.run_simulate`
turns a sweep of runs into a bench artifact."""
