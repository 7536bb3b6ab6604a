"""The Grafana dashboard of the proxy's Prometheus metrics, shipped in the package (``proxy.json``), and its
export and import (Grafana's HTTP API, ``POST /api/dashboards/db``)."""

from __future__ import annotations

import json
import re
from importlib import resources
from pathlib import Path
from typing import Any

from eldr_cli.errors import EldrError

DASHBOARD = "proxy.json"


def dashboard() -> dict[str, Any]:
    """The proxy dashboard (Grafana JSON model, datasource chosen by the ``datasource`` variable)."""
    doc: dict[str, Any] = json.loads(resources.files(__name__).joinpath(DASHBOARD).read_text(encoding="utf-8"))
    return doc


def queries(doc: dict[str, Any] | None = None) -> list[tuple[str, str]]:
    """(panel title, PromQL expression) of every target of every panel."""
    doc = doc or dashboard()
    return [(p["title"], t["expr"]) for p in doc["panels"] for t in p.get("targets", [])]


def export_dashboard(out: str | Path) -> Path:
    """Write the dashboard JSON to ``out`` (refusing to overwrite a file the user owns)."""
    p = Path(out)
    if p.exists():
        raise EldrError(f"{p} exists; give another --out or remove it")
    if not p.parent.is_dir():
        raise EldrError(f"folder {p.parent} does not exist")
    p.write_text(json.dumps(dashboard(), indent=1))
    return p


def import_dashboard(url: str, token: str | None, *, datasource: str | None = None, folder_uid: str | None = None,
                     timeout_s: float = 10.0) -> dict[str, Any]:
    """Create or update the dashboard in the Grafana at ``url`` (``token``: a service-account token);
    ``datasource``: the uid of the Prometheus data source that scrapes the proxy (default: Grafana's pick)."""
    import httpx

    if not re.match(r"^https?://[^/\s]+", url or ""):
        raise EldrError(f"--url {url!r} is not a Grafana URL", hint="e.g. http://grafana:3000")
    doc = dashboard()
    if datasource:
        for var in doc["templating"]["list"]:
            if var["name"] == "datasource":
                var["current"] = {"value": datasource, "text": datasource}
    body: dict[str, Any] = {"dashboard": doc, "overwrite": True, "message": "eldr dashboard import"}
    if folder_uid:
        body["folderUid"] = folder_uid
    headers = {"authorization": f"Bearer {token}"} if token else {}
    try:
        r = httpx.post(url.rstrip("/") + "/api/dashboards/db", json=body, headers=headers, timeout=timeout_s)
    except httpx.HTTPError as e:
        raise EldrError(f"cannot reach Grafana at {url}: {e}") from None
    if r.status_code in (401, 403):
        raise EldrError(f"Grafana at {url} refused the token (HTTP {r.status_code})",
                        hint="give a service-account token with the Editor role: --token-file FILE or $GRAFANA_TOKEN")
    if r.status_code != 200:
        raise EldrError(f"Grafana at {url} answered HTTP {r.status_code}: {r.text[:200]}")
    try:
        ans: dict[str, Any] = r.json()
    except ValueError:
        raise EldrError(f"Grafana at {url} answered something that is not JSON") from None
    return ans
