"""`eldr serve-dynamo`: eldr as the decode router inside NVIDIA Dynamo (library: eldr_cli.dynamo; docs/dynamo.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

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
    discovery_backend: str = typer.Option("etcd", "--discovery-backend",
                                          help="Dynamo's discovery: etcd (ETCD_ENDPOINTS), kubernetes, file "
                                               "(DYN_FILE_KV) or mem; the frontend's and the workers' must match."),
    request_plane: str = typer.Option("tcp", "--request-plane", help="Dynamo's request plane: tcp or nats."),
    wait_s: float = typer.Option(30.0, "--wait-s", help="How long a request waits for a first decode instance."),
    log_level: str = typer.Option("info", "--log-level", help="debug, info, warning or error."),
) -> None:
    """Choose each request's decode instance inside Dynamo by its expert signature and live load."""
    import logging

    from eldr_cli.dynamo.component import ComponentConfig, check_endpoint, run
    from eldr_cli.dynamo.router import DecisionLogRecorder, InstanceRouter
    from eldr_cli.errors import EldrError
    from eldr_cli.proxy.base import default_policy, load_step_cost
    from eldr_cli.routing import RoutingModel

    if discovery_backend not in ("etcd", "kubernetes", "file", "mem"):
        raise EldrError(f"--discovery-backend {discovery_backend!r}: expected etcd, kubernetes, file or mem")
    if request_plane not in ("tcp", "nats"):
        raise EldrError(f"--request-plane {request_plane!r}: expected tcp or nats")
    if log_level not in ("debug", "info", "warning", "error"):
        raise EldrError(f"--log-level {log_level!r}: expected debug, info, warning or error")
    check_endpoint(endpoint, "--endpoint")
    check_endpoint(decode_endpoint, "--decode-endpoint")
    model = RoutingModel.load(routing) if routing else None
    cost = load_step_cost(str(cost_model) if cost_model else None, model)
    if policy is None:
        if model is None:
            raise EldrError("--routing is needed: the default policy eldr-live decides with a routing artifact",
                            hint="eldr fit writes one; or choose a load balancer with --policy (jsq, p2c, ...)")
        policy = default_policy(model, str(routing))
    recorder = None
    if decision_log:
        from eldr_cli.proxy.config import check_decision_log_path

        check_decision_log_path(decision_log)
        recorder = DecisionLogRecorder(decision_log)
    router = InstanceRouter(policy, model=model, cost=cost, tau=tau, seed=seed, recorder=recorder)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = ComponentConfig(model_path, model_name, endpoint, decode_endpoint, wait_s)
    try:
        run(cfg, router, discovery_backend, request_plane)
    finally:
        if recorder is not None:
            recorder.close()


def register(app: typer.Typer) -> None:
    app.command("serve-dynamo")(serve_dynamo_cmd)
