"""`eldr place-experts` and `eldr place-experts evaluate` end to end on GENERATED traces, plus bad input."""

import json

import numpy as np
import pytest

from eldr_cli.artifacts.store import Artifact
from eldr_cli.artifacts.trace import read_trace, write_trace
from eldr_cli.main import run
from eldr_cli.pipeline.fit import run_fit
from eldr_cli.routing import RoutingModel
from eldr_cli.synth import synthetic_trace

pytestmark = pytest.mark.slow  # fits a routing artifact (~7 s)

L, E, K, R = 6, 32, 4, 4


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """A structured generated trace (every layer domain-specific, sparse preferences) + its K=4 fit."""
    d = tmp_path_factory.mktemp("place")
    write_trace(d / "trace", synthetic_trace(240, L, E, 4, n_domains=4, decode_steps=24, with_picks=True,
                                             informative_layers=list(range(L)), concentration=0.1,
                                             request_noise=0.3, with_gates=False, seed=3))
    run_fit(d / "trace", d / "fit", decoders=K, pairs=2000, figures=False)
    return d


@pytest.fixture(scope="module")
def placed(fitted):
    out = fitted / "placement"
    assert run(["place-experts", "--trace", str(fitted / "trace"), "--routing", str(fitted / "fit" / "routing"),
                "--ep-size", str(R), "--out", str(out), "--batch-size", "8"]) == 0
    return out


def test_place_experts_writes_valid_artifact(placed, fitted):
    a = Artifact(placed, kind="placement")
    assert a.verify() == []
    rank = a.array("per_decoder_rank")
    assert rank.shape == (K, L, E) and rank.dtype == np.int32
    for k in range(K):
        for l in range(L):
            assert np.bincount(rank[k, l], minlength=R).tolist() == [E // R] * R
    assert a.manifest["inputs"]["routing"]["content_hash"] == Artifact(fitted / "fit" / "routing").content_hash
    share = a.metrics["expected_max_rank_share"]
    assert share["per_decoder"] <= share["contiguous"] and share["per_decoder"] <= share["global_eplb"]
    assert (placed / "placement_rank_load.png").stat().st_size > 1000
    # the per-decoder export is the same layout, in vLLM's EPLB fields
    ex = json.loads((placed / "export" / "decoder-02.json").read_text())
    assert ex["decoder"] == 2 and ex["ep_size"] == R and ex["num_redundant_experts"] == 0
    np.testing.assert_array_equal(ex["physical_to_logical_map"], a.array("per_decoder_physical_to_logical")[2])
    emap = np.asarray(ex["expert_map"])  # [R, L, E]
    for r in range(R):
        np.testing.assert_array_equal(emap[r] >= 0, rank[2] == r)
    assert json.loads((placed / "export" / "global-eplb.json").read_text())["layout"] == "global-eplb"


def test_replicated_eplb_baseline(fitted, tmp_path):
    out = tmp_path / "plc"
    assert run(["place-experts", "--trace", str(fitted / "trace"), "--routing", str(fitted / "fit"),
                "--ep-size", str(R), "--redundant-experts", "4", "--out", str(out), "--no-figures"]) == 0
    a = Artifact(out)
    p2l = a.array("global_eplb_physical_to_logical")
    assert p2l.shape == (L, E + 4)
    assert (a.array("global_eplb_replicas").sum(1) == E + 4).all()
    assert a.array("per_decoder_physical_to_logical").shape == (K, L, E)  # per-decoder never replicates


@pytest.fixture(scope="module")
def evaluated(fitted, placed):
    out = fitted / "eval"
    assert run(["place-experts", "evaluate", "--trace", str(fitted / "trace"), "--routing",
                str(fitted / "fit" / "routing"), "--placement", str(placed), "--batch-size", "6",
                "--out", str(out)]) == 0
    return out


def test_per_decoder_beats_contiguous_on_structured_data(evaluated):
    m = Artifact(evaluated, kind="placement-eval").metrics
    mm = m["mean_max_active_per_rank"]
    assert mm["per_decoder"] < mm["contiguous"]
    assert mm["per_decoder"] <= mm["global_eplb"]
    assert m["mean_lower_bound"] <= mm["per_decoder"]
    assert m["trace_source"] == "generated"
    assert (evaluated / "placement_eval.png").stat().st_size > 1000


def test_evaluate_metric_equals_brute_force_count(fitted, placed, evaluated):
    ev = Artifact(evaluated)
    steps, members = ev.table("steps"), ev.table("batches")
    trace = read_trace(fitted / "trace")
    plc = Artifact(placed)
    ranks = {"per_decoder": plc.array("per_decoder_rank"),
             "contiguous": np.arange(E)[None, :].repeat(L, 0) // (E // R),
             "global_eplb": None}
    eplb = plc.array("global_eplb_physical_to_logical")
    ranks["global_eplb"] = np.empty((L, E), int)
    for l in range(L):
        for p in range(E):
            ranks["global_eplb"][l, eplb[l, p]] = p // (E // R)
    # every evaluation request is replayed, each of its decode steps exactly once
    ev_rows = np.flatnonzero(trace.split_mask("evaluation"))
    assert sorted(set(members["request"].to_list())) == sorted(ev_rows.tolist())
    assert members.height == int(trace.decode_steps[ev_rows].sum())
    rng = np.random.default_rng(0)
    for i in rng.choice(steps.height, size=25, replace=False):
        row = steps.row(int(i), named=True)
        mem = members.filter((members["step"] == row["step"]) & (members["decoder"] == row["decoder"]))
        assert mem.height == row["batch_size"]
        per_layer = {"active": [], "lb": [], "contiguous": [], "global_eplb": [], "per_decoder": []}
        for l in range(L):
            active = set()
            for r, s in zip(mem["request"].to_list(), mem["request_step"].to_list(), strict=True):
                active |= {int(e) for e in trace.steps_of(r)[s, l]}
            per_layer["active"].append(len(active))
            per_layer["lb"].append(-(-len(active) // R))
            for name, rk in ranks.items():
                rk_l = rk[row["decoder"], l] if name == "per_decoder" else rk[l]
                per_layer[name].append(max(sum(1 for e in active if rk_l[e] == g) for g in range(R)))
        assert row["active"] == pytest.approx(np.mean(per_layer["active"]))
        assert row["lower_bound"] == pytest.approx(np.mean(per_layer["lb"]))
        for name in ranks:
            assert row[name] == pytest.approx(np.mean(per_layer[name])), name


def test_replay_routes_through_the_shared_policy(fitted, placed, tmp_path):
    """With tau=0 the eldr policy is top-1: every request lands on its nearest centroid."""
    out = tmp_path / "ev0"
    assert run(["place-experts", "evaluate", "--trace", str(fitted / "trace"), "--routing", str(fitted / "fit"),
                "--placement", str(placed), "--tau", "0", "--out", str(out), "--no-figures"]) == 0
    members = Artifact(out).table("batches")
    trace = read_trace(fitted / "trace", with_picks=False)
    model = RoutingModel.load(fitted / "fit" / "routing")
    for r, d in set(zip(members["request"].to_list(), members["decoder"].to_list(), strict=True)):
        assert d == int(np.argmax(model.centroids @ model.signature(trace.prefill_counts[r])))


# -- bad input: one message, exit 2, nothing written ---------------------------------------------

def _expect_error(argv, capsys, *needles):
    rc = run(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err
    for n in needles:
        assert n in err, err


def test_ep_size_not_dividing_experts(fitted, tmp_path, capsys):
    out = tmp_path / "bad"
    _expect_error(["place-experts", "--trace", str(fitted / "trace"), "--routing", str(fitted / "fit"),
                   "--ep-size", "3", "--out", str(out)], capsys, "R=3 does not divide E=32")
    assert not out.exists()
    _expect_error(["place-experts", "--trace", str(fitted / "trace"), "--routing", str(fitted / "fit"),
                   "--ep-size", "4", "--redundant-experts", "2", "--out", str(out)], capsys, "does not divide")
    assert not out.exists()


def test_routing_from_another_trace(fitted, tmp_path, capsys):
    other = tmp_path / "other"
    write_trace(other, synthetic_trace(240, L, E, 4, n_domains=4, decode_steps=24, with_picks=True, seed=99,
                                       with_gates=False))
    out = tmp_path / "bad"
    _expect_error(["place-experts", "--trace", str(other), "--routing", str(fitted / "fit" / "routing"),
                   "--ep-size", "4", "--out", str(out)], capsys, "fitted on another trace")
    assert not out.exists()
    _expect_error(["place-experts", "evaluate", "--trace", str(other), "--routing", str(fitted / "fit" / "routing"),
                   "--placement", str(fitted / "placement"), "--out", str(out)], capsys, "fitted on another trace")
    assert not out.exists()


def test_k_mismatch(fitted, placed, tmp_path, capsys):
    out = tmp_path / "bad"
    _expect_error(["place-experts", "--trace", str(fitted / "trace"), "--routing", str(fitted / "fit"),
                   "--ep-size", "4", "--decoders", "3", "--out", str(out)], capsys, "K mismatch", "K=4")
    assert not out.exists()
    # a placement made for a K=3 routing artifact, evaluated with the K=4 one
    run_fit(fitted / "trace", tmp_path / "fit3", decoders=3, pairs=2000, figures=False)
    assert run(["place-experts", "--trace", str(fitted / "trace"), "--routing", str(tmp_path / "fit3"),
                "--ep-size", "4", "--out", str(tmp_path / "plc3"), "--no-figures"]) == 0
    _expect_error(["place-experts", "evaluate", "--trace", str(fitted / "trace"), "--routing",
                   str(fitted / "fit"), "--placement", str(tmp_path / "plc3"), "--out", str(out)],
                  capsys, "K mismatch")
    assert not out.exists()


def test_missing_options_and_trace_without_picks(fitted, placed, tmp_path, capsys):
    _expect_error(["place-experts", "--trace", str(fitted / "trace")], capsys, "--routing", "--ep-size")
    nopicks = tmp_path / "nopicks"
    t = read_trace(fitted / "trace", with_picks=False)
    write_trace(nopicks, t)
    _expect_error(["place-experts", "evaluate", "--trace", str(nopicks), "--routing", str(fitted / "fit"),
                   "--placement", str(placed), "--out", str(tmp_path / "bad")], capsys)
    assert not (tmp_path / "bad").exists()


def test_imported_public_format_trace(tmp_path):
    """A trace imported from the Orders-in-Chaos layout (GENERATED fixture tree) through place + evaluate."""
    from eldr_cli.capture.oic_fixtures import write_oic_tree

    write_oic_tree(tmp_path / "tree", n_per_subject=40, num_layers=8, num_experts=16, top_k=2, decode_steps=12)
    assert run(["capture", "--from-trace", str(tmp_path / "tree"), "--out", str(tmp_path / "trace"),
                "--no-progress"]) == 0
    run_fit(tmp_path / "trace", tmp_path / "fit", decoders=3, pairs=2000, figures=False)
    assert run(["place-experts", "--trace", str(tmp_path / "trace"), "--routing", str(tmp_path / "fit"),
                "--ep-size", "4", "--out", str(tmp_path / "plc"), "--no-figures"]) == 0
    ex = json.loads((tmp_path / "plc" / "export" / "decoder-00.json").read_text())
    assert ex["moe_layer_ids"] == [1, 3, 5, 7] and len(ex["physical_to_logical_map"]) == 4
    assert run(["place-experts", "evaluate", "--trace", str(tmp_path / "trace"), "--routing", str(tmp_path / "fit"),
                "--placement", str(tmp_path / "plc"), "--out", str(tmp_path / "ev"), "--no-figures"]) == 0
    m = Artifact(tmp_path / "ev").metrics
    assert m["trace_source"] == "imported"
    mm = m["mean_max_active_per_rank"]
    assert m["mean_lower_bound"] <= min(mm.values())
