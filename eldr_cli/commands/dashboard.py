"""`eldr dashboard export|import`: the Grafana dashboard of the proxy's metrics (library: eldr_cli.dashboards)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer

dashboard_app = typer.Typer(help="The Grafana dashboard of `eldr serve-proxy`'s Prometheus metrics.",
                            no_args_is_help=True)


@dashboard_app.command("export")
def export_cmd(out: Path = typer.Option(..., "--out", help="File to write the dashboard JSON to (new file).")) -> None:
    """Write the dashboard JSON (import it in Grafana: Dashboards -> New -> Import)."""
    from eldr_cli.console import console
    from eldr_cli.dashboards import export_dashboard, queries

    p = export_dashboard(out)
    console.print(f"dashboard ({len(queries())} queries) -> {p}")


@dashboard_app.command("import")
def import_cmd(
    url: str = typer.Option(..., "--url", help="Grafana base URL, e.g. http://grafana:3000."),
    token_file: Optional[Path] = typer.Option(None, "--token-file", help="File with a Grafana service-account "
                                              "token (default: $GRAFANA_TOKEN)."),
    datasource: Optional[str] = typer.Option(None, "--datasource", help="UID of the Prometheus data source that "
                                             "scrapes the proxy (default: Grafana's default)."),
    folder: Optional[str] = typer.Option(None, "--folder", help="UID of the Grafana folder (default: General)."),
) -> None:
    """Create or update the dashboard in a Grafana through its HTTP API, in one command."""
    from eldr_cli.console import console
    from eldr_cli.dashboards import import_dashboard
    from eldr_cli.errors import EldrError

    token = os.environ.get("GRAFANA_TOKEN")
    if token_file is not None:
        try:
            token = token_file.read_text().strip()
        except OSError as e:
            raise EldrError(f"--token-file {token_file}: {e.strerror}") from None
    ans = import_dashboard(url, token, datasource=datasource, folder_uid=folder)
    console.print(f"[green]imported[/] eldr serve-proxy dashboard: {url.rstrip('/')}{ans.get('url', '')}")


def register(app: typer.Typer) -> None:
    app.add_typer(dashboard_app, name="dashboard")
