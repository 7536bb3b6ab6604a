"""An emulated xPyD cluster (`eldr emulate`): prefill and decode workers that speak vLLM's HTTP and PD
protocol, with step times from a measured cost model and expert unions from replayed trace picks.

**One asyncio process serving every worker on its own port** (not one process per worker): the
workers compute nothing heavy -- a step is one bitwise OR over the batch's replayed expert sets
(tens of microseconds) followed by a sleep until the step's deadline -- so 24 processes would only add
context switches on a 2-core machine, while one uvloop loop keeps every timer within a fraction of a
millisecond. Timing honesty is measured, not assumed: every decode step records how late its end
was against its deadline (``late_ms`` in the step log, ``eldr_emulator_step_late_ms`` in /metrics),
and the simulator (which has no event loop at all) reproduces the emulated median TPOT within 10%
(tests/test_bench_emulator.py). Steps are scheduled by absolute deadlines, so lateness never accumulates.

Protocol (vLLM NIXL-proxy style):
- POST /v1/completions and /v1/chat/completions, streaming (SSE, ``stream_options.include_usage``)
  or not; ``max_tokens``/``max_completion_tokens``; ``ignore_eos`` (without it a request stops at its
  trace row's captured output length);
- a prefill request carries ``kv_transfer_params.do_remote_decode = true``; the answer carries a
  top-level ``kv_transfer_params`` with ``do_remote_prefill``, ``remote_engine_id``,
  ``remote_block_ids``, ``remote_host``, ``remote_port`` and ``eldr_signature`` =
  ``handoff.encode_counts(prefill counts of the matched trace row)``, as the vLLM plugin returns;
- a decode request carries the prefill's ``kv_transfer_params`` (``do_remote_prefill = true``) and joins
  the worker's continuous batch; a request without transferred KV is decoded the same way (the
  emulator does not charge a prompt recompute);
- GET /health, /v1/models, /metrics (``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
  ``eldr_emulator_*``), /eldr/steps?since=N (the decode step log: batch, active experts, step ms, and
  the worker's running totals of requests, unmatched prompts and wrapped requests).

A request is a trace row: its prompt text names it, or, for rows without text (imported traces), the
prompt ``trace-row:<request_id>`` (see :mod:`eldr_cli.simulator.replay`). Decode past a row's captured steps
replays them again from the first and is counted (``wrapped``). With a roofline cost model a decode step
charges each running request's KV at its current context (prompt + generated tokens).

Modules: :mod:`~eldr_cli.emulator.workers` (prefill/decode timing), :mod:`~eldr_cli.emulator.app` (the
HTTP endpoints of one worker), :mod:`~eldr_cli.emulator.cluster` (all workers on one loop, ``eldr emulate``).
"""

from eldr_cli.emulator.app import make_app
from eldr_cli.emulator.cluster import EmulatedCluster, serve_cluster
from eldr_cli.emulator.workers import DecodeWorker, PrefillWorker, Worker

__all__ = ["DecodeWorker", "EmulatedCluster", "PrefillWorker", "Worker", "make_app", "serve_cluster"]
