"""Drift of the served signatures against the routing artifact: the calibration figures stored at fit time, the
verdict on held-back and on foreign traffic (GENERATED traces, 5 seeds), and the proxy's gauges and /health
with a real proxy in front of stub PD workers that hand off the traces' counts."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from _proxy_util import Cluster

from eldr_cli.artifacts.trace import write_trace
from eldr_cli.pipeline.fit import run_fit
from eldr_cli.routing import RoutingModel
from eldr_cli.routing.drift import WINDOW, DriftMonitor
from eldr_cli.routing.model import load_routing_artifact
from eldr_cli.synth import synthetic_trace

SHAPE = dict(num_layers=4, num_experts=16, top_k=4, decode_steps=8)


def _fit(tmp, seed: int, n: int = 1600):
    """A GENERATED trace of 4 domains, fitted on its calibration rows (80%), and its held-back rows' counts."""
    tr = synthetic_trace(n_requests=n, seed=seed, **SHAPE)
    write_trace(tmp / f"t{seed}", tr)
    fit = run_fit(tmp / f"t{seed}", tmp / f"f{seed}", decoders=4, pairs=2000, figures=False, seed=seed)
    held = tr.prefill_counts[np.asarray(tr.column("split") == "evaluation")]
    return fit, held


def _foreign(seed: int, n: int = WINDOW + 20) -> np.ndarray:
    """Counts of other domains (another generated model of the experts' preferences): the drifted traffic."""
    return synthetic_trace(n_requests=n, seed=1000 + seed, **SHAPE).prefill_counts


@pytest.mark.parametrize("seed", range(5))
def test_held_back_traffic_is_not_flagged_and_foreign_traffic_is(tmp_path, seed):
    fit, held = _fit(tmp_path, seed)
    stats = load_routing_artifact(fit).params["drift"]
    assert stats["centroid"]["threshold"] < stats["centroid"]["mean"] and stats["window"] == WINDOW
    assert stats["prototype"] is not None and 0 <= stats["band_all_share"] <= 1
    model = RoutingModel.load(fit)
    verdicts = {}
    for name, counts in (("held-back", held), ("foreign", _foreign(seed))):
        mon = DriftMonitor.for_model(model, stats)
        mon.observe_many(np.stack([model.signature(c) for c in counts]))
        snap = mon.snapshot()
        assert snap["requests"] == WINDOW
        verdicts[name] = snap["drifted"]
    assert verdicts == {"held-back": False, "foreign": True}


def test_no_verdict_before_a_full_window_or_without_figures(tmp_path):
    fit, held = _fit(tmp_path, 0, n=400)
    model = RoutingModel.load(fit)
    mon = DriftMonitor.for_model(model, load_routing_artifact(fit).params["drift"])
    mon.observe_many(np.stack([model.signature(c) for c in held[:10]]))
    assert mon.snapshot()["drifted"] is None and mon.snapshot()["requests"] == 10
    old = DriftMonitor.for_model(model, None)
    old.observe_many(np.stack([model.signature(c) for c in held]))
    assert old.snapshot()["drifted"] is None and "refit" in old.snapshot()["reasons"][0]


def test_proxy_exports_drift_and_health_says_so(tmp_path):
    fit, held = _fit(tmp_path, 1)
    foreign = _foreign(1)
    table = {f"held {i}": c for i, c in enumerate(held[:WINDOW])} | {f"foreign {i}": c for i, c in enumerate(foreign)}
    c = Cluster(routing=str(fit), policy="jsq", stub_kw={"counts_fn": table.__getitem__})
    try:
        with httpx.Client() as h:
            for i in range(WINDOW):
                r = h.post(c.url + "/v1/completions", json={"prompt": f"held {i}", "max_tokens": 1})
                assert r.status_code == 200
            c.app.drift.drain()
            health = h.get(c.url + "/health").json()["drift"]
            assert health["requests"] == WINDOW and health["drifted"] is False
            assert c.metric("eldr_proxy_drift_flag") == 0
            assert c.metric("eldr_proxy_drift_similarity", to="centroid") > c.metric("eldr_proxy_drift_threshold",
                                                                                     to="centroid")
            for i in range(WINDOW):
                r = h.post(c.url + "/v1/completions", json={"prompt": f"foreign {i}", "max_tokens": 1})
                assert r.status_code == 200
            c.app.drift.drain()
            health = h.get(c.url + "/health").json()["drift"]
        assert health["drifted"] is True and "nearest centroid" in health["reasons"][0]
        assert c.metric("eldr_proxy_drift_flag") == 1
        assert c.metric("eldr_proxy_drift_similarity", to="centroid") < c.metric("eldr_proxy_drift_threshold",
                                                                                 to="centroid")
        assert 0 <= c.metric("eldr_proxy_drift_band_all_share") <= 1
    finally:
        c.close()


def test_drift_watch_scores_counts_and_signatures_alike_and_skips_beyond_its_queue(tmp_path):
    """The watch's window from decoded counts (what the hand-off queues when it decoded them) and from the decision's
    Eq. 2 cells (what eldr-live's hand-off queues) is the one from the signatures as they arrived, equal to the
    monitor fed one request at a time; cells of a routing model no longer current are not scored; its CPU is
    counted; a full queue skips (counted) and never blocks the request path."""
    from types import SimpleNamespace

    from eldr_cli.handoff import encode_counts
    from eldr_cli.proxy.drift import DriftWatch
    from eldr_cli.routing.live_set import PrefillPredictor

    fit, held = _fit(tmp_path, 2, n=400)
    model = RoutingModel.load(fit)
    state = SimpleNamespace(model=model, routing_path=str(fit))
    ref = DriftMonitor.for_model(model, load_routing_artifact(fit).params["drift"])
    for c in held:
        ref.observe(model.signature(c))
    snaps = []
    cells = [(model, model.signature(c, unit=False)) for c in held]
    for items in (list(held), [encode_counts(c) for c in held], cells):
        w = DriftWatch(state)
        try:
            for x in items:
                w.observe(x)
            w.observe(None)  # no signature: not queued
            w.drain()
            snaps.append(w.snapshot())
            assert w.scored == len(held) and w.dropped == 0 and w.cpu_s > 0
        finally:
            w.close()
    assert snaps[0] == snaps[1] == snaps[2]  # the same window whichever the hand-off queued
    # eldr-live's hand-off also queues the prototype its decision found nearest (in float32): the similarity to it
    src = PrefillPredictor(model)
    w = DriftWatch(state)
    try:
        for c, (_, x) in zip(held, cells, strict=True):
            entry = src.entry(c)
            w.observe((model, x, entry.prototype if entry is not None and entry.cells is not None else 0))
        w.drain()
        live = w.snapshot() or {}
    finally:
        w.close()
    # (scored by one compiled pass over each request's cells: the sums in another order than BLAS's)
    assert live == {**snaps[0], "prototype_similarity": pytest.approx(snaps[0]["prototype_similarity"], rel=1e-6),
                    "centroid_similarity": pytest.approx(snaps[0]["centroid_similarity"], rel=1e-12)}
    w = DriftWatch(state)
    try:
        for _, x in cells[:5]:
            w.observe((RoutingModel.load(fit), x))  # another model object: an artifact reloaded since
        w.drain()
        assert w.scored == 5 and (w.snapshot() or {}).get("requests", 0) == 0
    finally:
        w.close()
    want = ref.snapshot()
    assert snaps[0] == {**want, **{k: pytest.approx(want[k], rel=1e-12) for k in
                                   ("centroid_similarity", "prototype_similarity")}}
    w = DriftWatch(state, queue_rows=5)
    w.close()  # no thread: the queue fills
    for c in held[:8]:
        w.observe(c)
    assert w.dropped == 3


def test_cells_of_another_artifact_are_not_counted(tmp_path):
    """The drift watch's compiled pass skips (does not count, does not read past) cells of another length than the
    centroids' and a prototype index the artifact does not have (an artifact reloaded under the same path)."""
    fit, held = _fit(tmp_path, 2, n=200)
    model = RoutingModel.load(fit)
    mon = DriftMonitor.for_model(model, load_routing_artifact(fit).params["drift"])
    cells = model.signature(held[0], unit=False)
    mon.observe_cells([cells, np.ones(len(cells) + 7), cells], [0, 0, 10_000])
    assert mon.seen == 1
    ref = DriftMonitor.for_model(model, load_routing_artifact(fit).params["drift"])
    ref.observe_batch(cells[None, :], unit=False)
    assert mon.snapshot()["centroid_similarity"] == pytest.approx(ref.snapshot()["centroid_similarity"], rel=1e-12)
