"""`eldr emulate`: an emulated xPyD cluster (vLLM HTTP + PD protocol, cost-model step times)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from eldr_cli.commands._common import split_option


def emulate_cmd(
    trace: Path = typer.Option(..., "--trace", help="Trace artifact with per-step decode picks (captured, "
                               "imported or generated)."),
    cost_model: Path = typer.Option(..., "--cost-model", help="Cost-model artifact (eldr bench moe-layer or "
                                    "eldr bench cost-model)."),
    prefill: int = typer.Option(8, "--prefill", min=1, help="Prefill workers."),
    decode: int = typer.Option(16, "--decode", min=1, help="Decode workers."),
    host: str = typer.Option("127.0.0.1", "--host"),
    base_port: int = typer.Option(18300, "--base-port", min=1, max=65535,
                                   help="Prefill workers take base..base+P-1, decode the next D."),
    max_seqs: int = typer.Option(256, "--max-seqs", min=1, help="Max running requests per decode worker."),
    model_name: str = typer.Option(None, "--model-name", help="Model id served (default: the trace's model)."),
    cluster_file: Path = typer.Option(None, "--cluster-file",
                                      help="Write the worker URLs as JSON here once listening (for bench/proxy)."),
    split: Optional[str] = split_option(None, help="Rows a bench sends by default (`bench serve --cluster FILE` "
                                        "without --prompts): default evaluation, all when the trace has no "
                                        "evaluation rows; every row is answered."),
) -> None:
    """Run P prefill + D decode EMULATED workers until Ctrl-C. Step times come from the cost model applied
    to the union of experts the running requests' replayed trace picks activate. A request is a trace row,
    named by its prompt text or, for rows without text (imported traces), by the prompt
    `trace-row:<request_id>`, which `eldr bench serve` sends for such rows."""
    from eldr_cli.console import console
    from eldr_cli.emulator import serve_cluster

    def ready(info):
        no_text = info["rows_without_text"]
        console.print(f"[bold]EMULATED[/] cluster {prefill}P{decode}D of {info['model']} (pid {info['pid']}), "
                      f"{info['split_rows']} {info['split']} rows"
                      + (f", {no_text} rows without prompt text (sent as trace-row:<id>)" if no_text else "") + ":")
        console.print("  prefill: " + " ".join(info["prefill"]))
        console.print("  decode:  " + " ".join(info["decode"]))
        console.print("  serve-proxy: eldr serve-proxy --routing FIT/routing "
                      + " ".join(f"--prefill {u}" for u in info["prefill"][:2]) + " ... "
                      + " ".join(f"--decode {u}" for u in info["decode"][:2]) + " ...")
        console.print("Ctrl-C stops it.", style="dim")

    _check_cluster_file(cluster_file)
    _quiet_client_disconnects()
    try:
        serve_cluster(trace=trace, cost_model=cost_model, n_prefill=prefill, n_decode=decode, host=host,
                      base_port=base_port, max_seqs=max_seqs, model_name=model_name, cluster_file=cluster_file,
                      ready=ready, split=split)
    finally:
        _remove_own_cluster_file(cluster_file)


def _read_cluster(p: Path) -> dict | None:
    import json

    try:
        info = json.loads(p.read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) and info.get("mode") == "emulated" else None


def _check_cluster_file(cluster_file: Path | None) -> None:
    """The cluster file is ours to (re)write only if it is new or an earlier `eldr emulate`'s."""
    from eldr_cli.errors import EldrError

    if cluster_file is None:
        return
    p = Path(cluster_file)
    if str(cluster_file).strip() in ("", "."):
        raise EldrError("--cluster-file is empty", hint="pass a file name such as cluster.json")
    if p.exists() and (not p.is_file() or _read_cluster(p) is None):
        raise EldrError(f"--cluster-file {p} exists and is not an eldr cluster file; refusing to overwrite it",
                        hint="choose another --cluster-file")


def _remove_own_cluster_file(cluster_file: Path | None) -> None:
    """A stopped cluster leaves no file pointing at dead ports (only the file this process wrote)."""
    import os

    if cluster_file is None:
        return
    p = Path(cluster_file)
    info = _read_cluster(p) if p.is_file() else None
    if info is not None and info.get("pid") == os.getpid():
        p.unlink(missing_ok=True)


class _DropClientDisconnects:
    """aiohttp logs a traceback when a client (a benchmark, the proxy) closes a stream mid-answer;
    for an emulated worker that is ordinary, not an error."""

    def filter(self, record) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, (ConnectionResetError, BrokenPipeError))


def _quiet_client_disconnects() -> None:
    import logging

    logging.getLogger("aiohttp.server").addFilter(_DropClientDisconnects())


def register(app: typer.Typer) -> None:
    app.command("emulate")(emulate_cmd)
