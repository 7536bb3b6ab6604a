"""The clairvoyant router (issue 29, item 9): eldr-live's rule fed each request's true future decode activations.

Two decoders, one layer of four experts, two prototypes as in test_live_cost.py: prototype 0 predicts experts
{0, 1} at 0.5 per step, prototype 1 experts {2, 3}. Request 0 runs on decoder 0 and request 1 on decoder 1;
their prefill signatures point to prototypes 0 and 1, but in truth request 0 decodes on {2, 3} and request 1
on {0, 1} (every step). A new request whose signature points to prototype 0 truly decodes on {0, 1}.

By hand, with step = 1 + 0.1 B + 0.5 A (one layer), loads [1, 1]:

    eldr-live (prototypes):  q_0 = (.5, .5, 1, 1) A_0 = 1  dA_0 = .5   cost_0 = 1.95 + 0.35 = 2.3
                             q_1 = (1, 1, .5, .5) A_1 = 1  dA_1 = 1    cost_1 = 2.2 + 0.6   = 2.8   -> decoder 0
    clairvoyant (the truth): q_0 = (1, 1, 0, 0)   A_0 = 2  dA_0 = 2    cost_0 = 3.2 + 1.1   = 4.3
                             q_1 = (0, 0, 1, 1)   A_1 = 2  dA_1 = 0    cost_1 = 2.2 + 0.1   = 2.3   -> decoder 1
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

from eldr_cli.costmodel import CostModel
from eldr_cli.errors import EldrError
from eldr_cli.routing import RoutingModel, make_router
from eldr_cli.routing.clairvoyant import ClairvoyantPolicy, future_activations
from eldr_cli.routing.live import LiveDetail
from eldr_cli.routing.registry import SERVABLE, check_policy

PROTO0 = np.array([1.0, 0.0, 0.0, 0.0])
COST = CostModel(a_ms=1.0, b_ms=0.5, c_ms=0.1, source="given")
TRUTH = {0: np.array([0, 0, 1, 1.0]), 1: np.array([1, 1, 0, 0.0]), 2: np.array([1, 1, 0, 0.0])}


def _model() -> RoutingModel:
    protos = np.array([[1.0, 0, 0, 0], [0, 0, 1.0, 0]])
    act = np.array([[[0.5, 0.5, 0, 0]], [[0, 0, 0.5, 0.5]], [[0.25, 0.25, 0.25, 0.25]]], dtype=np.float32)
    return RoutingModel("count", np.ones((1, 4)), np.arange(1), np.eye(2, 4), live=(protos, act))


def _clairvoyant(future: dict):
    router = make_router("clairvoyant", 2, model=_model(), cost=COST, oracle=SimpleNamespace(future=future))
    for key, worker in ((0, 0), (1, 1)):  # placed where the test says, whatever the router would choose
        d = router.decide(None, [key, 0], key=key)
        router.on_dispatch(dataclasses.replace(d, worker=worker), key)
    return router


def test_eldr_live_picks_by_prototypes_the_clairvoyant_by_the_true_future():
    live = make_router("eldr-live", 2, model=_model(), cost=COST).policy
    live.on_dispatch(0, 0, LiveDetail(live.live.source.entries[0], 0))
    live.on_dispatch(1, 1, LiveDetail(live.live.source.entries[1], 0))
    r = live.rank([1, 1], PROTO0)
    assert r.first == 0
    np.testing.assert_allclose(r.predicted_ms, [2.3, 2.8], rtol=1e-6)

    router = _clairvoyant({k: v.astype(np.float32) for k, v in TRUTH.items()})
    d = router.decide(None, [1, 1], key=2)
    assert d.worker == 1
    np.testing.assert_allclose(d.predicted_ms, [4.3, 2.3], rtol=1e-4)  # a = 1 is clipped to 1 - 1e-6


def test_the_decision_follows_the_future_not_the_prototypes():
    # the same requests, signatures and prototypes; only the future differs: request 0 truly runs {0, 1},
    # request 1 {2, 3}. A router that used the prototypes would decide the same both times.
    swapped = {0: TRUTH[1], 1: TRUTH[0], 2: TRUTH[2]}
    d = _clairvoyant({k: v.astype(np.float32) for k, v in swapped.items()}).decide(None, [1, 1], key=2)
    assert d.worker == 0
    np.testing.assert_allclose(d.predicted_ms, [2.3, 4.3], rtol=1e-4)


def test_the_live_set_follows_dispatch_and_finish_and_recounts_exactly():
    router = _clairvoyant({k: v.astype(np.float32) for k, v in TRUTH.items()})
    pol = router.policy
    assert isinstance(pol, ClairvoyantPolicy)
    np.testing.assert_allclose(pol.idle_probabilities(), [[1, 1, 0, 0], [0, 0, 1, 1]], atol=1e-5)
    np.testing.assert_allclose(pol.live.exact_log_q(0), pol.live.log_q[0], rtol=1e-6)
    router.on_finish(0, 0)
    np.testing.assert_allclose(pol.idle_probabilities()[0], [1, 1, 1, 1], atol=1e-6)
    assert pol.live.view()[1][0] == pytest.approx(0.0, abs=1e-5)


def test_future_activations_are_decode_counts_over_decode_steps():
    counts = np.array([[[2, 0, 4, 0]], [[0, 0, 0, 0]], [[3, 3, 0, 0]]])
    fut = future_activations(counts, np.array([4, 0, 3]), np.array([2, 0, 1, 0]))
    assert sorted(fut) == [0, 2]  # row 1 has no decode step
    np.testing.assert_allclose(fut[0], [0.5, 0, 1 - 1e-6, 0], rtol=1e-6)
    np.testing.assert_allclose(fut[2], [1 - 1e-6, 1 - 1e-6, 0, 0], rtol=1e-6)


def test_not_servable_and_needs_the_future():
    assert "clairvoyant" not in SERVABLE
    with pytest.raises(EldrError, match="unknown policy 'clairvoyant'"):
        check_policy("clairvoyant", servable=True)
    with pytest.raises(EldrError, match="true decode activations"):
        make_router("clairvoyant", 2, model=_model(), oracle=None)


def test_bench_simulate_and_replay_run_the_clairvoyant_row(tmp_path):
    """`bench simulate --routers ...,clairvoyant` and `bench replay --policies ...,clairvoyant` on a GENERATED
    trace: the row is there, served every request, and (replay) activates no more experts per step than
    round-robin at the larger batch."""
    import json

    from eldr_cli.main import run

    t, f = tmp_path / "t", tmp_path / "fit"
    assert run(["synth-trace", "--out", str(t), "--requests", "240", "--layers", "4", "--experts", "16", "--top-k",
                "2", "--decode-steps", "16", "--picks"]) == 0
    assert run(["fit", "--trace", str(t), "--decoders", "2", "--out", str(f)]) == 0
    from eldr_cli.costmodel import write_cost_model

    write_cost_model(tmp_path / "cm", CostModel(a_ms=0.5, b_ms=0.2, c_ms=0.05, source="given", top_k=2))
    assert run(["bench", "simulate", "--trace", str(t), "--cost-model", str(tmp_path / "cm"), "--routing", str(f),
                "--routers", "round-robin,eldr-live,clairvoyant", "--rates", "20", "--duration", "6", "--warmup", "1",
                "--prefill", "1", "--decode", "2", "--max-tokens", "16", "--out", str(tmp_path / "sim")]) == 0
    runs = {r["router"]: r for r in json.loads((tmp_path / "sim" / "summary.json").read_text())["runs"]}
    assert set(runs) == {"round-robin", "eldr-live", "clairvoyant"}
    assert runs["clairvoyant"]["completed"] == runs["round-robin"]["completed"] > 0
    assert runs["clairvoyant"]["failed"] == 0
    assert run(["bench", "replay", "--trace", str(t), "--routing", str(f), "--policies",
                "round-robin,eldr-live,clairvoyant", "--batch-sizes", "1,8", "--out", str(tmp_path / "rep")]) == 0
    import polars as pl

    from eldr_cli.artifacts.store import Artifact

    a = Artifact(tmp_path / "rep")
    tables = sorted(p.name for p in a.path.glob("*.parquet"))
    df = pl.read_parquet(a.path / tables[0])
    assert "clairvoyant" in set(df[df.columns[0]].cast(str)) or "clairvoyant" in str(df.to_dicts())
