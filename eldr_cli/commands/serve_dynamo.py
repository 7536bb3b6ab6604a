"""`eldr serve-dynamo`: eldr as the decode router inside NVIDIA Dynamo (library: eldr_cli.dynamo; docs/dynamo.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, List, Optional

import typer

from eldr_cli.commands._common import STATE_CA_FILE, STATE_KEY_FILE, STATE_PASSWORD_FILE
from eldr_cli.routing.registry import policy_help


def serve_dynamo_cmd(
    model_path: str = typer.Option(..., "--model-path",
                                   help="The served model's directory or Hugging Face id (the frontend's tokenizer "
                                        "and model card come from it; no weights are loaded)."),
    model_name: Optional[str] = typer.Option(None, "--model-name", help="Served model name (default: --model-path)."),
    routing: Optional[Path] = typer.Option(None, "--routing", help="Routing (or fit) artifact from `eldr fit`."),
    policy: Optional[str] = typer.Option(None, "--policy", help=policy_help(default="eldr-live")),
    cost_model: Optional[Path] = typer.Option(None, "--cost-model",
                                              help="Cost-model artifact eldr-live predicts step times with "
                                                   "(default: a relative shape of the paper's Fig. 2)."),
    tau: Optional[float] = typer.Option(None, "--tau", help="Locality band width (default: the artifact's tau)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the random policies."),
    endpoint: str = typer.Option("dynamo.eldr.generate", "--endpoint",
                                 help="NAMESPACE.COMPONENT.ENDPOINT this router serves as the model's decode tier "
                                      "(NAMESPACE: the one the frontend watches)."),
    decode_endpoint: str = typer.Option("eldr-decode.backend.generate", "--decode-endpoint",
                                        help="NAMESPACE.COMPONENT.ENDPOINT of the real decode workers (another "
                                             "namespace, which the frontend does not watch)."),
    decision_log: Optional[str] = typer.Option(None, "--decision-log", help="FILE.jsonl or FILE.parquet."),
    shadow: List[str] = typer.Option([], "--shadow", help="A policy deciding beside --policy, logged only "
                                                          "(repeatable; as serve-proxy --shadow)."),
    metrics_port: Optional[int] = typer.Option(None, "--metrics-port",
                                               help="Serve GET /metrics (the proxy's Prometheus metrics) on this "
                                                    "port (0: any free port; default: not served)."),
    metrics_host: str = typer.Option("127.0.0.1", "--metrics-host", help="Address --metrics-port listens on."),
    discovery_backend: str = typer.Option("etcd", "--discovery-backend",
                                          help="Dynamo's discovery: etcd (ETCD_ENDPOINTS), kubernetes, file "
                                               "(DYN_FILE_KV) or mem; the frontend's and the workers' must match."),
    request_plane: str = typer.Option("tcp", "--request-plane", help="Dynamo's request plane: tcp or nats."),
    wait_s: float = typer.Option(30.0, "--wait-s", help="How long a request waits for a first decode instance."),
    log_level: str = typer.Option("info", "--log-level", help="debug, info, warning or error."),
    state: Optional[str] = typer.Option(None, "--state",
                                        help="local (default) or redis\\[s]://\\[USER@]HOST:PORT\\[/DB]: share "
                                             "in-flight counts and live sets with the other router replicas, "
                                             "signed with $ELDR_STATE_KEY or --state-key-file (as serve-proxy)."),
    state_key_file: Optional[str] = STATE_KEY_FILE,
    state_password_file: Optional[str] = STATE_PASSWORD_FILE,
    state_ca_file: Optional[str] = STATE_CA_FILE,
    state_prefix: str = typer.Option("eldr-dynamo", "--state-prefix",
                                     help="Namespace of the Redis keys and channels."),
    state_reserve_ms: float = typer.Option(50.0, "--state-reserve-ms",
                                           help="Reserve each decode slot atomically in Redis, waiting at most "
                                                "this long before deciding locally (0: off)."),
) -> None:
    """Choose each request's decode instance inside Dynamo by its expert signature and live load."""
    import logging

    from eldr_cli.dynamo.component import ComponentConfig, run
    from eldr_cli.dynamo.metrics_http import bind_metrics
    from eldr_cli.dynamo.shared import make_state
    from eldr_cli.errors import EldrError
    from eldr_cli.proxy.config import refuse_command_line_secrets

    _check_choices(discovery_backend, request_plane, log_level, endpoint, decode_endpoint)
    refuse_command_line_secrets(None, state)
    if state_reserve_ms < 0:
        raise EldrError(f"--state-reserve-ms {state_reserve_ms:g} must be >= 0")
    shared = make_state(state, key_file=state_key_file, password_file=state_password_file, ca_file=state_ca_file,
                        prefix=state_prefix, reserve_ms=state_reserve_ms)
    # GET /metrics bound now: a port in use fails before the decision log or the runtime start
    sock = bind_metrics(metrics_host, metrics_port) if metrics_port is not None else None
    try:
        router = _router(routing, policy, cost_model, tau, seed, shared, shadow, decision_log)  # the log: last
        logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        try:
            run(ComponentConfig(model_path, model_name, endpoint, decode_endpoint, wait_s, sock), router,
                discovery_backend, request_plane)
        finally:
            if router.log is not None:
                router.log.close()
    finally:
        if sock is not None:
            sock.close()


def _check_choices(discovery_backend: str, request_plane: str, log_level: str, endpoint: str,
                   decode_endpoint: str) -> None:
    from eldr_cli.dynamo.component import check_endpoint
    from eldr_cli.errors import EldrError

    if discovery_backend not in ("etcd", "kubernetes", "file", "mem"):
        raise EldrError(f"--discovery-backend {discovery_backend!r}: expected etcd, kubernetes, file or mem")
    if request_plane not in ("tcp", "nats"):
        raise EldrError(f"--request-plane {request_plane!r}: expected tcp or nats")
    if log_level not in ("debug", "info", "warning", "error"):
        raise EldrError(f"--log-level {log_level!r}: expected debug, info, warning or error")
    check_endpoint(endpoint, "--endpoint")
    check_endpoint(decode_endpoint, "--decode-endpoint")


def _router(routing: Optional[Path], policy: Optional[str], cost_model: Optional[Path], tau: Optional[float],
            seed: int, shared: Any, shadow: list[str], decision_log: Optional[str]) -> Any:
    """The InstanceRouter of these options (its routing artifact, cost model, policy and shadows checked first;
    the decision log opened last)."""
    from eldr_cli.dynamo.router import InstanceRouter
    from eldr_cli.errors import EldrError
    from eldr_cli.proxy.base import default_policy, load_step_cost
    from eldr_cli.proxy.config import check_decision_log_path
    from eldr_cli.proxy.decisionlog import DecisionLog
    from eldr_cli.routing import RoutingModel

    model = RoutingModel.load(routing) if routing else None
    cost = load_step_cost(str(cost_model) if cost_model else None, model)
    if policy is None:
        if model is None:
            raise EldrError("--routing is needed: the default policy eldr-live decides with a routing artifact",
                            hint="eldr fit writes one; or choose a load balancer with --policy (jsq, p2c, ...)")
        policy = default_policy(model, str(routing))
    router = InstanceRouter(policy, model=model, cost=cost, tau=tau, seed=seed, shared=shared, shadows=shadow)
    router.routing_path = str(routing) if routing else None
    if decision_log:
        check_decision_log_path(decision_log)
        router.attach_log(DecisionLog(decision_log))
    return router


def register(app: typer.Typer) -> None:
    app.command("serve-dynamo")(serve_dynamo_cmd)
