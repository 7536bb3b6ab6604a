"""The SIMULATED cluster behind `eldr bench simulate` and `eldr report`: :mod:`eldr_cli.simulator.cluster`
runs one (router, rate) in virtual time (arrivals, prefill, the handoff decision, decode) over the
compiled decode engine of :mod:`eldr_cli.simulator.core`, replaying a trace's rows through
:class:`eldr_cli.simulator.replay.TraceReplay` (which experts each prompt and decode step activate, what a step
costs; the emulator replays through it too); :func:`eldr_cli.pipeline.simulate.run_simulate` turns a sweep of
runs into a bench artifact."""
