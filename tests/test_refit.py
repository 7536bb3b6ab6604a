"""`eldr fit --from-decision-log`: a routing artifact refitted on the signatures a real proxy logged (stub PD
workers handing off a GENERATED trace's counts), swapped into the proxy by the admin API, after which the
decision log names the new artifact."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import numpy as np
import pytest
from _proxy_util import Cluster

from eldr_cli.artifacts.trace import write_trace
from eldr_cli.main import run as eldr
from eldr_cli.method.cluster import balanced_assignment
from eldr_cli.pipeline.fit import run_fit
from eldr_cli.proxy.decisionlog import routing_id
from eldr_cli.routing import RoutingModel
from eldr_cli.routing.model import load_routing_artifact
from eldr_cli.synth import synthetic_trace

TOKEN = "pP3uG-8vQk2Zr6XyT1bW0nLh5sJd9aFcE4mKo7iRqYw"  # an admin token must hold 256 bits (issue 36): 43 base64url
SHAPE = dict(n_requests=800, num_layers=4, num_experts=16, top_k=4, decode_steps=8, seed=3)


def cli(*args):
    return subprocess.run([sys.executable, "-m", "eldr_cli", *args], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Fit on an even mix of 4 GENERATED domains; serve 240 requests of a mix 70% one domain (same
    generative model) through the proxy with --decision-log-replay."""
    d = tmp_path_factory.mktemp("refit")
    write_trace(d / "trace", synthetic_trace(**SHAPE))
    fit = run_fit(d / "trace", d / "fit", decoders=4, pairs=2000, figures=False)
    skew = synthetic_trace(**(SHAPE | {"domain_weights": [0.7, 0.1, 0.1, 0.1]})).prefill_counts[:240]
    table = {f"row {i}": c for i, c in enumerate(skew)}
    c = Cluster(n_decode=4, routing=str(fit), policy="jsq", decision_log=str(d / "log.jsonl"), decision_log_replay=True,
                admin_token=TOKEN, stub_kw={"counts_fn": table.__getitem__})
    try:
        with httpx.Client() as h:
            for i in range(len(skew)):
                assert h.post(c.url + "/v1/completions", json={"prompt": f"row {i}", "max_tokens": 1}).status_code \
                    == 200
        c.app.decision_log.flush()
        assert eldr(["fit", "--from-decision-log", str(d / "log.jsonl"), "--routing", str(fit), "--out",
                     str(d / "refit"), "--seed", "0"]) == 0
        # the admin API swaps the refitted artifact in; the decisions after it name it
        r = httpx.post(c.url + "/admin/reload", json={"routing": str(d / "refit")},
                       headers={"authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 200, r.text
        for i in range(5):
            assert httpx.post(c.url + "/v1/completions", json={"prompt": f"row {i}", "max_tokens": 1}).status_code \
                == 200
        c.app.decision_log.flush()
    finally:
        c.close()
    return d, fit, skew


def test_refit_keeps_the_signature_space_and_fits_the_served_mix(served):
    d, fit, skew = served
    old, new = RoutingModel.load(fit), RoutingModel.load(d / "refit")
    assert new.n_clusters == 4 and new.transform == old.transform
    assert np.array_equal(new.weights, old.weights) and np.array_equal(new.mask, old.mask)
    assert new.live is not None and np.array_equal(new.live[0], old.live[0])  # eldr-live's model is kept
    p = load_routing_artifact(d / "refit").params
    assert p["refit"]["rows"] == len(skew) and p["split"] == "decision-log"
    assert p["drift"]["centroid"]["n"] == len(skew)
    # the served mix is 70% one domain: split evenly over the decoders (balanced assignment, Sec. 4.3.1), its
    # signatures sit closer to the refitted centroids than to the calibration's
    S = np.stack([old.signature(c) for c in skew])

    def balanced_distance(centroids):
        cost = 1.0 - S @ centroids.T
        labels = balanced_assignment(cost, capacity=-(-len(S) // 4))
        return float(cost[np.arange(len(S)), labels].mean())

    assert balanced_distance(new.centroids) < 0.8 * balanced_distance(old.centroids)


def test_the_log_names_the_artifact_that_decided(served):
    d, fit, skew = served
    rows = [json.loads(x) for x in open(d / "log.jsonl")]
    ids = [r["routing_id"] for r in rows]
    assert ids[: len(skew)] == [routing_id(str(fit))] * len(skew)
    assert ids[len(skew):] == [routing_id(str(d / "refit"))] * 5 and ids[0] != ids[-1]


def test_refit_bad_input(served, tmp_path):
    d, fit, _ = served
    old = tmp_path / "old.jsonl"
    old.write_text("".join(json.dumps({k: v for k, v in json.loads(x).items() if k not in ("sig", "log_v")}) + "\n"
                           for x in open(d / "log.jsonl")))
    r = cli("fit", "--from-decision-log", str(old), "--routing", str(fit), "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and "--decision-log-replay" in r.stderr and "Traceback" not in r.stderr
    r = cli("fit", "--from-decision-log", str(d / "log.jsonl"), "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and "--routing" in r.stderr
    r = cli("fit", "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and "--trace" in r.stderr
    assert not (tmp_path / "o").exists()
