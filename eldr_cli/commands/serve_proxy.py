"""`eldr serve-proxy`: the OpenAI-compatible PD routing proxy (library: eldr_cli.proxy)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, List, Optional

import typer

from eldr_cli.commands._common import STATE_CA_FILE, STATE_KEY_FILE, STATE_PASSWORD_FILE
from eldr_cli.routing.registry import policy_help


def serve_proxy_cmd(
    routing: Optional[Path] = typer.Option(None, "--routing", help="Routing (or fit) artifact from `eldr fit`."),
    prefill: List[str] = typer.Option([], "--prefill", help="Prefill worker URL (repeatable)."),
    decode: List[str] = typer.Option([], "--decode", help="Decode worker URL (repeatable); position i = centroid i."),
    policy: Optional[str] = typer.Option(None, "--policy",
                                         help=policy_help(default="eldr-live")),
    cost_model: Optional[Path] = typer.Option(None, "--cost-model",
                                              help="Cost-model artifact eldr-live predicts step times with "
                                                   "(default: a relative shape of the paper's Fig. 2)."),
    shadow: List[str] = typer.Option([], "--shadow", help="A policy deciding beside --policy, logged only."),
    tau: Optional[float] = typer.Option(None, "--tau", help="Locality band width (default: the artifact's tau)."),
    host: Optional[str] = typer.Option(None, "--host", help="Bind address (default 127.0.0.1)."),
    port: Optional[int] = typer.Option(None, "--port", help="Port (default 8000)."),
    admin_token: Optional[str] = typer.Option(None, "--admin-token",
                                              help="Refused (a command line is visible to every user): set "
                                                   "$ELDR_ADMIN_TOKEN or use --admin-token-file."),
    admin_token_file: Optional[str] = typer.Option(None, "--admin-token-file",
                                                   help="File (mode 600) with the bearer token for /admin/* "
                                                        "(or $ELDR_ADMIN_TOKEN; unset: admin disabled)."),
    config: Optional[Path] = typer.Option(None, "--config", help="YAML or TOML file with the same keys."),
    decision_log: Optional[str] = typer.Option(None, "--decision-log", help="FILE.jsonl or FILE.parquet."),
    decision_log_replay: Optional[bool] = typer.Option(None, "--decision-log-replay/--no-decision-log-replay"),
    scrape_metrics: Optional[bool] = typer.Option(None, "--scrape-metrics/--no-scrape-metrics",
                                                  help="Combine in-flight with workers' vllm:num_requests_running."),
    max_body_bytes: Optional[int] = typer.Option(None, "--max-body-bytes",
                                                 help="Answer 413 above this body size (default 4 MiB)."),
    log_level: Optional[str] = typer.Option(None, "--log-level", help="debug, info, warning or error (default info)."),
    state: Optional[str] = typer.Option(None, "--state",
                                        help="local (default) or redis\\[s]://\\[USER@]HOST:PORT\\[/DB]: share "
                                             "in-flight counts and admin changes with other replicas (signed with "
                                             "$ELDR_STATE_KEY or --state-key-file)."),
    state_key_file: Optional[str] = STATE_KEY_FILE,
    state_password_file: Optional[str] = STATE_PASSWORD_FILE,
    state_ca_file: Optional[str] = STATE_CA_FILE,
    state_prefix: Optional[str] = typer.Option(None, "--state-prefix",
                                               help="Namespace of the Redis keys and channels (default eldr)."),
    state_reserve_ms: Optional[float] = typer.Option(
        None, "--state-reserve-ms", help="Reserve each decode slot atomically in Redis, waiting at most this "
                                         "long before deciding locally (default 50; 0: off)."),
    workers: Optional[int] = typer.Option(None, "--workers",
                                          help="Processes behind one port (SO_REUSEPORT); they share state "
                                               "through --state, or a private redis-server without it."),
) -> None:
    """Route each request's decode leg by its expert signature and live load (ELDR §4.3.2)."""
    from eldr_cli.proxy import build_config, serve
    from eldr_cli.proxy.config import refuse_command_line_secrets

    refuse_command_line_secrets(admin_token, state)
    cfg = build_config(config, routing=str(routing) if routing else None, prefill=prefill, decode=decode,
                       cost_model=str(cost_model) if cost_model else None, policy=policy, shadow=shadow, tau=tau,
                       host=host, port=port, admin_token_file=admin_token_file, decision_log=decision_log,
                       decision_log_replay=decision_log_replay, scrape_metrics=scrape_metrics,
                       max_body_bytes=max_body_bytes, log_level=log_level, state=state, workers=workers,
                       state_key_file=state_key_file, state_password_file=state_password_file,
                       state_ca_file=state_ca_file, state_prefix=state_prefix, state_reserve_ms=state_reserve_ms)
    from eldr_cli.proxy.app import create_app
    from eldr_cli.proxy.server import bind_socket, serve_workers

    app = create_app(cfg)  # fail fast (routing artifact, K vs decode pool) before binding
    if cfg.state != "local":  # a refused password or an unverifiable certificate: before the banner
        from eldr_cli.proxy.replicas.conn import check_state_reachable

        check_state_reachable(app.state.shared.conn)  # type: ignore[attr-defined]
    if cfg.workers > 1 and cfg.state == "local":
        from eldr_cli.proxy.replicas.redis_server import require_redis_server

        require_redis_server(f"--workers {cfg.workers} without --state shares state through a private redis-server")
    sock = bind_socket(cfg.host, cfg.port, reuse_port=cfg.workers > 1)  # a busy port fails before the banner
    _banner(cfg)
    if cfg.workers > 1:
        sock.close()  # each worker process binds its own SO_REUSEPORT socket
        serve_workers(cfg)
    else:
        serve(cfg, sock)


def _banner(cfg: Any) -> None:
    from eldr_cli.console import console
    from eldr_cli.proxy.replicas.conn import redact

    console.print(f"[green]eldr serve-proxy[/] on http://{cfg.host}:{cfg.port}  policy={cfg.policy}"
                  f"  prefill={len(cfg.prefill)}  decode={len(cfg.decode)}"
                  + (f"  routing={cfg.routing}" if cfg.routing else "")
                  + ("  admin=on" if cfg.admin_token else "  admin=off")
                  + (f"  workers={cfg.workers}" if cfg.workers > 1 else "")
                  + (f"  state={redact(cfg.state)}" if cfg.state != "local" else ""), highlight=False)


def register(app: typer.Typer) -> None:
    app.command("serve-proxy")(serve_proxy_cmd)
