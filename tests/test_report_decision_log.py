"""`eldr report --decision-log`: the verdict on traffic a real proxy served (stub PD workers, --decision-log-replay),
and the bad-input rules (older log, truncated, mixed artifacts, missing --fit)."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest
from _proxy_util import Cluster, build_routing

from eldr_cli.costmodel import CostModel, write_cost_model
from eldr_cli.main import run as eldr
from eldr_cli.pipeline.decision_replay import read_rows, replay_rows, trace_from_rows
from eldr_cli.proxy.decisionlog import routing_id
from eldr_cli.routing import RoutingModel
from eldr_cli.testing.stub_worker import fake_counts

N = 80


def cli(*args):
    return subprocess.run([sys.executable, "-m", "eldr_cli", *args], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    d = tmp_path_factory.mktemp("served")
    fit = build_routing(d, decoders=3)
    write_cost_model(d / "cm", CostModel(a_ms=0.5, b_ms=0.1, c_ms=0.005, source="measured", device="test"))
    c = Cluster(routing=str(fit), policy="jsq", decision_log=str(d / "log.jsonl"), decision_log_replay=True)
    try:
        with httpx.Client() as h:
            for i in range(N):
                r = h.post(c.url + "/v1/completions", json={"prompt": f"prompt {i} about item {i * 13}",
                                                             "max_tokens": 8})
                assert r.status_code == 200
        c.app.decision_log.flush()
    finally:
        c.close()
    return d, fit


def test_report_on_the_served_log(served):
    d, fit = served
    out = d / "report"
    assert eldr(["report", "--decision-log", str(d / "log.jsonl"), "--fit", str(fit), "--cost-model", str(d / "cm"),
                 "--out", str(out), "--duration", "1", "--seeds", "2", "--routers", "jsq,eldr",
                 "--no-progress"]) == 0
    doc = json.loads((out / "report.json").read_text())
    sec = doc["decision_log"]
    assert sec["rows_used"] == N and not any(sec["rows_skipped"].values())
    assert sec["policies_logged"] == ["jsq"] and sec["logged_rate_rps"] > 0
    assert "GENERATED" in sec["decode_picks"] and "Served traffic (decision log)" in (out / "report.md").read_text()
    v = doc["verdict"]
    assert set(v["capacity_rps"]) == {"jsq", "eldr"} and v["seeds"] == 2
    for c in v["capacity_rps"].values():
        assert c["ci95"][0] <= c["mean"] <= c["ci95"][1]
    assert set(sec["logged_load_pct_of_capacity"]) == {"jsq", "eldr"}
    at = sec["at_logged_load"]  # every router SIMULATED at the logged rate, paired against the best balancer
    assert at["label"] == "SIMULATED" and at["rate_rps"] == pytest.approx(sec["logged_rate_rps"], rel=1e-3)
    assert set(at["by_router"]) == {"jsq", "eldr"} and set(at["tpot_p50_change_vs_best_lb_pct"]) == {"eldr"}
    assert all(x["tpot_p50_ms"]["mean"] > 0 for x in at["by_router"].values())
    assert "at the logged load (SIMULATED)" in (out / "report.md").read_text()
    assert doc["trace"]["requests"] == N
    # the stub's random counts are nothing like the GENERATED calibration domains: drift is flagged
    assert sec["drift"]["drifted"] is True and sec["drift"]["requests"] == N
    assert "DRIFTED" in (out / "report.md").read_text()


def test_rebuilt_requests_are_the_served_ones(served):
    d, fit = served
    model = RoutingModel.load(fit)
    rows, skipped = replay_rows(read_rows(d / "log.jsonl"), "log", routing_id(str(fit)))
    tr = trace_from_rows(rows, model.shape, seed=0)
    assert not any(skipped.values()) and len({r["request_id"] for r in rows}) == N
    prompts = [f"prompt {i} about item {i * 13}" for i in range(N)]
    assert (tr.prefill_counts == [fake_counts(p) for p in prompts]).all()  # arrival order is send order
    assert tr.top_k == 4 and (tr.decode_steps == 8).all()
    assert (tr.prompt_tokens == [len(p.split()) for p in prompts]).all()
    # GENERATED decode picks: k distinct experts per layer and step
    steps = tr.steps_of(0)
    assert steps.shape == (8, 4, 4) and all(len(set(s.tolist())) == 4 for s in steps.reshape(-1, 4))


def test_older_log_is_refused_naming_the_option(served, tmp_path):
    d, fit = served
    old = tmp_path / "old.jsonl"
    with open(old, "w") as fh:
        for line in open(d / "log.jsonl"):
            row = json.loads(line)
            for k in ("log_v", "arrival_s", "prompt_tokens", "max_tokens", "sig", "routing_id"):
                row.pop(k)
            fh.write(json.dumps(row) + "\n")
    r = cli("report", "--decision-log", str(old), "--fit", str(fit), "--out", str(tmp_path / "r"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "--decision-log-replay" in r.stderr and "arrival_s" in r.stderr
    assert not (tmp_path / "r").exists()
    r = cli("report", "--decision-log", str(d / "log.jsonl"), "--out", str(tmp_path / "r"))
    assert r.returncode == 2 and "--fit" in r.stderr
    r = cli("report", "--decision-log", str(d / "log.jsonl"), "--trace", str(d / "trace"), "--fit", str(fit),
            "--out", str(tmp_path / "r"))
    assert r.returncode == 2 and "one of --trace" in r.stderr


def test_truncated_and_mixed_rows_are_skipped_and_counted(served, tmp_path):
    d, fit = served
    lines = open(d / "log.jsonl").read().splitlines()
    mixed = tmp_path / "mixed.jsonl"
    with open(mixed, "w") as fh:
        for i, line in enumerate(lines):
            row = json.loads(line)
            if i % 4 == 0:
                row["routing_id"] = "feedfacefeedface"
            elif i % 4 == 1:  # a proxy serving without a routing artifact
                row["routing_id"] = None
            elif i % 8 == 2:  # no output budget asked for: the others' median
                row["max_tokens"] = None
            fh.write(json.dumps(row) + "\n")
        fh.write(lines[0][:40])  # the writer stopped mid-row
    rows, skipped = replay_rows(read_rows(mixed), mixed, routing_id(str(fit)))
    assert skipped == {"truncated": 1, "without replay fields": 0, "other routing artifact": N // 2,
                       "without signature": 0}
    assert len(rows) == N - N // 2
    tr = trace_from_rows(rows, RoutingModel.load(fit).shape)
    assert (tr.decode_steps == 8).all()
    bad = tmp_path / "bad.jsonl"
    bad.write_text(lines[0] + "\n{not json\n" + lines[1] + "\n")
    r = cli("report", "--decision-log", str(bad), "--fit", str(fit), "--out", str(tmp_path / "r"))
    assert r.returncode == 2 and "line 2" in r.stderr and "Traceback" not in r.stderr
    other = build_routing(tmp_path, decoders=3, seed=5)
    r = cli("report", "--decision-log", str(d / "log.jsonl"), "--fit", str(other), "--out", str(tmp_path / "r"))
    assert r.returncode == 2 and routing_id(str(fit)) in r.stderr and "Traceback" not in r.stderr


def test_logged_tpot_against_the_cost_model(served, tmp_path):
    """Rows carrying the decoders' scraped TPOT (here written into the served log: 2 ms on d0, 4 ms elsewhere)
    give each decoder's logged TPOT beside the cost model's step at its mean logged batch."""
    from eldr_cli.costmodel import CostModel
    from eldr_cli.report.decision_log import logged_tpot

    d, fit = served
    model = RoutingModel.load(fit)
    rows, _ = replay_rows(read_rows(d / "log.jsonl"), "log", routing_id(str(fit)))
    for r in rows:
        r["decoders_tpot_ms"] = [2.0, 4.0, None]
        r["loads"] = [3, 1, 0]
    tr = trace_from_rows(rows, model.shape, seed=0)
    t = logged_tpot(rows, tr, d / "cm")
    per = {x["decoder"]: x for x in t["per_decoder"]}
    assert set(per) == {0, 1}  # d2 was never scraped
    cost = CostModel.load(d / "cm")
    assert per[0]["logged_tpot_ms"] == 2.0 and per[0]["mean_batch"] == 3
    assert per[1]["predicted_tpot_ms"] < per[0]["predicted_tpot_ms"]  # a smaller batch: a shorter step
    p = tr.decode_counts.mean(axis=0) / 8
    want = cost.step_ms(float((1 - (1 - p) ** 3).sum()), 4, 3.0, cost.token_scale(4))
    assert per[0]["predicted_tpot_ms"] == pytest.approx(want, rel=1e-3)
    assert per[0]["error_pct"] == pytest.approx(100 * (2.0 - want) / want, abs=0.1)
    assert "note" in logged_tpot(rows, tr, None) and "--scrape-metrics" in logged_tpot(
        [{k: v for k, v in r.items() if k != "decoders_tpot_ms"} for r in rows], tr, d / "cm")["note"]


def test_scraped_tpot_is_the_mean_over_the_scrape_interval():
    from eldr_cli.proxy.tpot import update_tpot
    from eldr_cli.proxy.workers import Worker

    w = Worker("d0", "decode", "http://x")
    page = 'vllm:time_per_output_token_seconds_sum{{model_name="m"}} {}\nvllm:time_per_output_token_seconds_count' \
           '{{model_name="m"}} {}\n'
    update_tpot(w, page.format(1.0, 100))
    assert w.scraped_tpot_ms is None  # one scrape: no interval yet
    update_tpot(w, page.format(1.5, 150))
    assert w.scraped_tpot_ms == pytest.approx(10.0)  # 0.5 s over 50 tokens
    update_tpot(w, page.format(1.5, 150))
    assert w.scraped_tpot_ms == pytest.approx(10.0)  # no new token: the last figure stays
    update_tpot(w, "vllm:num_requests_running 3\n")
    assert w.scraped_tpot_ms is None and w.tpot_totals is None


def test_parquet_log_replays_like_jsonl(served, tmp_path):
    from eldr_cli.proxy.decisionlog import DecisionLog

    d, fit = served
    lines = [json.loads(x) for x in open(d / "log.jsonl")]
    log = DecisionLog(str(tmp_path / "log.parquet"), rows_per_part=30)
    for r in lines:
        log.write(r)
    log.close()
    assert len(list(tmp_path.glob("log-*.parquet"))) == 3
    a, _ = replay_rows(read_rows(d / "log.jsonl"), "jsonl", routing_id(str(fit)))
    b, _ = replay_rows(read_rows(tmp_path / "log.parquet"), "parquet", routing_id(str(fit)))
    assert [r["sig"] for r in a] == [{k: v for k, v in r["sig"].items() if v is not None} for r in b]
