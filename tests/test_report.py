"""`eldr report`: the verdict numbers in report.json equal the HTML's and the summary's; bad inputs exit 2."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from eldr_cli.costmodel import CostModel, write_cost_model
from eldr_cli.main import run as eldr
from eldr_cli.pipeline.report import verdict

KEYS = ("tpot_p50_change_vs_best_lb_pct", "tpot_p99_change_vs_best_lb_pct", "active_experts_change_vs_rr_pct",
        "oracle_share_pct")


def cli(*args):
    return subprocess.run([sys.executable, "-m", "eldr_cli", *args], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    d = tmp_path_factory.mktemp("rep")
    assert eldr(["synth-trace", "--out", str(d / "t"), "--requests", "240", "--layers", "8", "--experts", "32",
                 "--top-k", "4", "--decode-steps", "16", "--picks"]) == 0
    assert eldr(["synth-trace", "--out", str(d / "nopicks"), "--requests", "60", "--layers", "8", "--experts",
                 "32", "--top-k", "4", "--decode-steps", "16"]) == 0
    # a memory-bound cost model: each distinct active expert costs as much as a layer's fixed work
    write_cost_model(d / "cm", CostModel(a_ms=0.05, b_ms=0.01, c_ms=0.0005, source="measured", device="test"))
    return d


def test_report_html_has_every_figure_and_the_json_verdict(inputs, tmp_path):
    out = tmp_path / "r"
    assert eldr(["report", "--trace", str(inputs / "t"), "--cost-model", str(inputs / "cm"), "--out", str(out),
                 "--duration", "10", "--no-progress"]) == 0
    doc = json.loads((out / "report.json").read_text())
    v = doc["verdict"]
    assert set(KEYS) <= set(v)
    assert v == {**verdict(doc["runs"]), "text": v["text"]}  # the verdict is recomputable from the runs
    html = (out / "report.html").read_text()
    for k in KEYS:
        shown = re.search(rf"data-key='{k}'>([^<]*)<", html).group(1)
        assert shown == ("n/a" if v[k] is None else f"{v[k]:.2f}")
    for fig in doc["figures"]:
        assert f"alt='{fig}' src='data:image/png;base64," in html
    names = " ".join(doc["figures"])
    for want in ("fig7", "fig8", "fig9", "fig11", "fig13"):
        assert want in names
    assert "SIMULATED" in html and "SIMULATED" in (out / "report.md").read_text()
    assert "src='http" not in html and "<link" not in html  # self-contained: opens from disk
    assert doc["simulated"]["cost_model"] in html
    assert {r["router"] for r in doc["runs"]} >= {"round-robin", "jsq", "eldr", "oracle"}
    assert v["oracle_share_pct"] is None or 0 <= v["oracle_share_pct"] <= 100
    # Fig. 13 from trace replay: a row per policy incl. the oracle at each batch size, and ELDR's share
    rep = doc["replay"]
    assert {r["policy"] for r in rep["results"]} >= {"round-robin", "eldr", "oracle"}
    assert "fig13_replay.png" in doc["figures"]
    table = html.split("<table id='replay'>")[1].split("</table>")[0]
    assert "<td>oracle</td>" in table and "REPLAY" in html
    from eldr_cli.pipeline.replay import shares

    assert rep["oracle_share"] == shares(rep["results"])
    if any(s.get("share_pct") is not None for s in rep["oracle_share"]):
        assert "<td>ELDR share of LB-&gt;oracle</td>" in table
    # the simulated share per rate, as in the simulate summary
    sim_rates = {r["request_rate"] for r in doc["runs"]}
    assert {r["request_rate"] for r in doc["oracle_share_by_rate"]} == sim_rates
    if any(r.get("p50_tpot_ms") for r in doc["oracle_share_by_rate"]):
        assert "<table id='oracle-share'>" in html


def test_report_without_decode_picks_names_the_capture_flags(inputs, tmp_path):
    r = cli("report", "--trace", str(inputs / "nopicks"), "--cost-model", str(inputs / "cm"), "--out",
            str(tmp_path / "r"), "--no-progress")
    assert r.returncode == 2 and "Traceback" not in r.stderr + r.stdout
    msg = r.stderr + r.stdout
    assert "--picks" in msg and "--max-new-tokens" in msg
    assert not (tmp_path / "r").exists()


def test_report_with_a_cost_model_of_another_model_exits_2(inputs, tmp_path):
    assert eldr(["bench", "cost-model", "--model", "Qwen3-30B-A3B", "--device", "MI300X",
                 "--out", str(tmp_path / "q")]) == 0
    r = cli("report", "--trace", str(inputs / "t"), "--cost-model", str(tmp_path / "q"), "--out",
            str(tmp_path / "r"), "--no-progress")
    assert r.returncode == 2 and "Traceback" not in r.stderr + r.stdout
    assert "L=8" in r.stderr + r.stdout
    assert not (tmp_path / "r").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".r.")]  # no half-written work dir left


def test_replay_sentence_picks_the_most_telling_batch_and_says_when_eldr_beats_the_oracle():
    from eldr_cli.pipeline.report import replay_text

    def row(b, lb, e, o, share):
        return {"batch_size": b, "best_lb": "jsq", "best_lb_active": lb, "eldr_active": e, "oracle_active": o,
                "share_pct": share}

    res = {"oracle_share": [row(4, 10.0, 9.0, 8.0, 50.0), row(16, 20.0, 15.0, 10.0, 50.0), {"batch_size": 64}]}
    t = replay_text(res)
    assert "decode batch 16" in t and "50% of the way to the oracle" in t  # the largest relative gap
    t = replay_text({"oracle_share": [row(4, 10.0, 7.0, 8.0, 150.0)]})
    assert "better than this oracle" in t and "150%" not in t
    assert replay_text({"oracle_share": [{"batch_size": 1}]}) == ""
