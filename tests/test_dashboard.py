"""The shipped Grafana dashboard: every panel's query names a metric a real proxy exports (with Redis shared
state, a decision log and a routing artifact, so every conditional family is there) with the labels it has;
export and the one-command import through Grafana's HTTP API (a stub Grafana records the call)."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from _proxy_util import Cluster, build_routing

from eldr_cli.dashboards import dashboard, queries
from eldr_cli.main import run as eldr
from eldr_cli.proxy.replicas.redis_server import RedisServer
from eldr_cli.testing.servers import ServerThread

PROMQL_WORDS = {"sum", "by", "rate", "histogram_quantile", "le", "without", "avg", "max", "min", "irate",
                "increase", "on", "ignoring", "count"}


def _exported(app) -> dict[str, set[str]]:
    """Every series name the proxy's registry exposes -> the label names it carries (declared ones included,
    so a labelled counter not incremented yet still counts)."""
    out: dict[str, set[str]] = {}
    for fam in app.metrics.registry.collect():
        declared = set(getattr(fam, "_labelnames", ()) or ())
        names = {fam.name}
        if fam.type == "counter":
            names = {fam.name + "_total"}
        elif fam.type == "histogram":
            names = {fam.name + s for s in ("_bucket", "_sum", "_count")}
        for n in names:
            out.setdefault(n, set()).update(declared | ({"le"} if n.endswith("_bucket") else set()))
        for s in fam.samples:
            out.setdefault(s.name, set()).update(s.labels)
    for attr in vars(app.metrics).values():  # labelled metric objects: their declared label names
        if hasattr(attr, "_labelnames") and hasattr(attr, "_name"):
            for n, v in out.items():
                if n.startswith(attr._name):
                    v.update(attr._labelnames)
    return out


def _used(expr: str) -> list[tuple[str, set[str]]]:
    """(metric name, label names it is matched or grouped on) for every metric in a PromQL expression."""
    out = []
    groups = set()
    for m in re.finditer(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
        groups |= {x.strip() for x in m.group(1).split(",") if x.strip()}
    for m in re.finditer(r"\b(eldr_proxy_[a-z_]+)(\{([^}]*)\})?", expr):
        labels = {x.split("=")[0].strip().rstrip("!~") for x in (m.group(3) or "").split(",") if x.strip()}
        out.append((m.group(1), labels | groups))
    return out


TOKEN = "nSdsgYHMUJrNra6uG3HvVlMwp2n0I0q0tjf_TZkhnjY"  # with --state, the admin token signs: 256 bits (issue 28)


@pytest.fixture(scope="module")
def proxy(tmp_path_factory):
    d = tmp_path_factory.mktemp("dash")
    fit = build_routing(d, decoders=3)
    with RedisServer() as r:
        c = Cluster(routing=str(fit), policy="eldr", decision_log=str(d / "d.jsonl"), admin_token=TOKEN,
                    shadow=["eldr-live"], state=f"redis://{r.host}:{r.port}/0", scrape_metrics=True)
        try:
            assert httpx.post(c.url + "/v1/completions", json={"prompt": "hello there", "max_tokens": 2}).status_code \
                == 200
            yield c
        finally:
            c.close()


def test_every_query_names_an_exported_metric_with_its_labels(proxy):
    exported = _exported(proxy.app)
    checked = 0
    for title, expr in queries():
        used = _used(expr)
        assert used, f"panel {title!r}: no eldr_proxy_ metric in {expr!r}"
        for name, labels in used:
            assert name in exported, f"panel {title!r}: {name} is not exported by the proxy"
            missing = labels - exported[name] - {"le"} if not name.endswith("_bucket") else labels - exported[name]
            assert not missing, f"panel {title!r}: {name} has no label(s) {sorted(missing)}"
            checked += 1
    assert checked >= 20


def test_legends_name_only_labels_the_series_have(proxy):
    exported = _exported(proxy.app)
    for p in dashboard()["panels"]:
        for t in p["targets"]:
            names = [n for n, _ in _used(t["expr"])]
            have = set.union(*(exported[n] for n in names))
            for lab in re.findall(r"\{\{(\w+)\}\}", t.get("legendFormat", "")):
                assert lab in have, f"panel {p['title']!r}: legend uses {lab}, not a label of {names}"


def test_export_and_import(tmp_path):
    assert eldr(["dashboard", "export", "--out", str(tmp_path / "d.json")]) == 0
    assert json.loads((tmp_path / "d.json").read_text()) == dashboard()
    assert eldr(["dashboard", "export", "--out", str(tmp_path / "d.json")]) == 2  # never overwrites

    seen = []

    async def grafana(scope, receive, send):  # what Grafana's POST /api/dashboards/db answers
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                await send({"type": msg["type"] + ".complete"})
                if msg["type"] == "lifespan.shutdown":
                    return
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        auth = dict(scope["headers"]).get(b"authorization", b"")
        seen.append((scope["path"], auth, json.loads(body)))
        ok = auth == b"Bearer tok"
        ans = {"status": "success", "uid": "eldr-proxy", "url": "/d/eldr-proxy/eldr-serve-proxy"} if ok else \
            {"message": "invalid API key"}
        await send({"type": "http.response.start", "status": 200 if ok else 401,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": json.dumps(ans).encode()})

    srv = ServerThread(grafana).start()
    try:
        (tmp_path / "tok").write_text("tok\n")
        assert eldr(["dashboard", "import", "--url", srv.url, "--token-file", str(tmp_path / "tok"),
                     "--datasource", "prom1"]) == 0
        path, _, body = seen[-1]
        assert path == "/api/dashboards/db" and body["overwrite"] is True
        assert body["dashboard"]["uid"] == "eldr-proxy"
        assert body["dashboard"]["templating"]["list"][0]["current"]["value"] == "prom1"
        (tmp_path / "bad").write_text("nope")
        assert eldr(["dashboard", "import", "--url", srv.url, "--token-file", str(tmp_path / "bad")]) == 2
    finally:
        srv.stop()
    assert eldr(["dashboard", "import", "--url", "grafana:3000"]) == 2
