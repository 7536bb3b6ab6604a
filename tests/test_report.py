"""`eldr report`: capacity at SLO with intervals in report.json (the keys tools read), an HTML a person reads
(checked in headless Chromium), and the bad-input rules."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest

from eldr_cli.costmodel import CostModel, write_cost_model
from eldr_cli.main import run as eldr

LEGACY = ("tpot_p50_change_vs_best_lb_pct", "tpot_p99_change_vs_best_lb_pct", "active_experts_change_vs_rr_pct",
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
    write_cost_model(d / "cm", CostModel(a_ms=0.5, b_ms=0.1, c_ms=0.005, source="measured", device="test"))
    return d


@pytest.fixture(scope="module")
def report(inputs):
    out = inputs / "r"
    assert eldr(["report", "--trace", str(inputs / "t"), "--cost-model", str(inputs / "cm"), "--out", str(out),
                 "--duration", "1", "--seeds", "2", "--no-progress"]) == 0
    return out


def test_report_json_has_the_keys_tools_read(report):
    doc = json.loads((report / "report.json").read_text())
    v = doc["verdict"]
    routers = doc["simulated"]["routers"]
    assert {"round-robin", "random", "jsq", "p2c", "eldr", "oracle"} <= set(routers)
    assert set(v["slo"]) == {"tpot_p90_ms", "ttft_p90_ms"} and all(x > 0 for x in v["slo"].values())
    assert v["best_load_balancer"] in ("round-robin", "random", "jsq", "p2c") and v["seeds"] == 2
    assert set(v["capacity_rps"]) == set(routers)
    for c in v["capacity_rps"].values():
        assert set(c) == {"mean", "ci95"} and len(c["ci95"]) == 2 and c["ci95"][0] <= c["mean"] <= c["ci95"][1]
    balancers = {"round-robin", "random", "jsq", "p2c"}
    assert set(v["capacity_gain_vs_best_lb_pct"]) == set(routers) - balancers  # eldr, eldr-live, the oracle
    assert len(v["by_load"]) == 5 * len(routers)  # 10, 25, 50, 75 and 100% of the best balancer's capacity
    for row in v["by_load"]:
        assert {"load_pct", "router", "tpot_p50_ms", "tpot_p99_ms", "ttft_p50_ms"} <= set(row)
        assert row["load_pct"] in (10, 25, 50, 75, 100) and set(row["tpot_p50_ms"]) == {"mean", "ci95"}
    assert set(v["deployment"]) == {"gpus_per_instance", "tp", "ep", "dtype", "kv_capacity_tokens"}
    assert set(LEGACY) <= set(v) and v["legacy_keys_load_pct"] == 75
    best = v["best_load_balancer"]
    at75 = {r["router"]: r for r in v["by_load"] if r["load_pct"] == 75}
    # today's TPOT key is the paired change at 75% load: its sign follows the means there
    if v["tpot_p50_change_vs_best_lb_pct"] is not None and abs(v["tpot_p50_change_vs_best_lb_pct"]) > 1:
        assert (v["tpot_p50_change_vs_best_lb_pct"] > 0) == (at75["eldr"]["tpot_p50_ms"]["mean"]
                                                             > at75[best]["tpot_p50_ms"]["mean"])
    assert v["status"] == "ok" and v["text"].startswith("SIMULATED")
    # the capacity search's bracket is within 2% for every router and seed
    for runs in doc["capacity"].values():
        for r in runs:
            lo, hi = r["bracket_rps"]
            assert r["status"] == "found" and r["rate_rps"] == pytest.approx(lo, rel=1e-3) and lo < hi <= 1.02 * lo


def test_report_html_reads_like_a_report(report):
    from eldr_cli.pipeline.report_render import headline

    doc = json.loads((report / "report.json").read_text())
    html = (report / "report.html").read_text()
    text = re.sub(r"src='data:image/png;base64,[^']*'", "", html)
    body = text.split("<h2>Decision", 1)[1]
    assert body.index("id='headline'") < body.index("tpot_vs_load.png") < body.index("Capacity at SLO")
    assert body.index("Capacity at SLO") < body.index("Signature quality") and "Clusters" in body
    for _, big, _ in headline(doc):
        assert f"<div class='big'>{big}</div>" in html
    for f in ("tpot_vs_load.png", "fig7", "fig8", "fig9", "fig13"):
        assert f in " ".join(doc["figures"])
    for fig in doc["figures"]:
        assert f"alt='{fig}' src='data:image/png;base64," in html
    assert "src='http" not in html and "<link" not in html  # self-contained: opens from disk
    assert "{'" not in text and not re.search(r"\d\.\d{5,}", text)  # no Python dicts, no long floats
    for sec in text.split("<section>")[1:]:
        assert sec.count("SIMULATED") <= 1
    md = (report / "report.md").read_text()
    assert "SIMULATED" in md and "Capacity at SLO" in md and "{'" not in md


def test_bad_seeds_and_slo_exit_2_and_write_nothing(inputs, tmp_path):
    for args, flag in ((["--seeds", "0"], "--seeds"), (["--slo-tpot-ms", "-5"], "--slo-tpot-ms"),
                       (["--slo-ttft-ms", "0"], "--slo-ttft-ms")):
        r = cli("report", "--trace", str(inputs / "t"), "--cost-model", str(inputs / "cm"), "--out",
                str(tmp_path / "r"), "--no-progress", *args)
        msg = r.stderr + r.stdout
        assert r.returncode == 2 and "Traceback" not in msg and flag in msg and msg.count("error") == 1
        assert not (tmp_path / "r").exists() and not list(tmp_path.iterdir())


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


@pytest.mark.parametrize("slo,status,words", [
    ((1e-4, None), "none", "No router meets this SLO"),
    pytest.param((1e7, 1e9), "above", "Every router meets this SLO", marks=pytest.mark.slow)])
def test_an_slo_out_of_reach_or_too_loose_gives_a_report_that_says_so(inputs, tmp_path, slo, status, words):
    from eldr_cli.pipeline.report import run_report

    v = run_report(inputs / "t", tmp_path / "r", cost_model=inputs / "cm", routers=["round-robin", "eldr"],
                   seeds=1, slo_tpot_ms=slo[0], slo_ttft_ms=slo[1], duration_s=0.05)
    assert v["status"] == status and words in v["text"]
    html = (tmp_path / "r" / "report.html").read_text()
    assert words in html and v["by_load"] == []  # no load points: there is no capacity to take fractions of


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


@pytest.mark.slow
def test_report_html_renders_in_chromium_with_the_headline_visible(report, tmp_path):
    """A real browser: the DOM after load holds the decision and the headline figures, and the page paints."""
    from PIL import Image

    from eldr_cli.pipeline.report_render import headline

    exe = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    assert exe, "headless Chromium is needed for this test: `make deps-chromium` installs it"
    url = (report / "report.html").resolve().as_uri()
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--window-size=1200,1400"]
    dom = subprocess.run([exe, *flags, "--dump-dom", url], capture_output=True, text=True, timeout=120).stdout
    doc = json.loads((report / "report.json").read_text())
    assert "id=\"headline\"" in dom and "Decision" in dom
    tiles = headline(doc)
    assert len(tiles) == 4
    for label, big, _ in tiles:
        assert big in dom and label in dom
    shot = tmp_path / "shot.png"
    subprocess.run([exe, *flags, f"--screenshot={shot}", url], capture_output=True, timeout=120)
    img = Image.open(shot).convert("L")
    top = img.crop((0, 0, img.width, 600))  # the decision and the headline card
    lo, hi = top.getextrema()
    assert hi - lo > 100 and sum(1 for n in top.histogram() if n) > 20  # painted text, not a blank page


def test_capacity_search_finds_the_threshold_of_a_synthetic_linear_cost_model(inputs, tmp_path):
    """Decode step = L (a + c B) ms for B running requests. Little's law (B = lambda/D * max_tokens * TPOT per
    decoder) gives mean TPOT = L a / (1 - L c lambda/D m), so the mean meets a target S up to
    lambda* = D (1 - L a / S) / (L c m). TPOT p90 is a little above the mean: the capacity is just below."""
    from eldr_cli.pipeline.report import run_report

    a_ms, c_ms, L, m, D, S = 0.1, 0.02, 8, 16, 2, 4.0  # the trace's median decode steps are 16
    write_cost_model(tmp_path / "lin", CostModel(a_ms=a_ms, b_ms=0.0, c_ms=c_ms, source="measured", device="test"))
    v = run_report(inputs / "t", tmp_path / "r", cost_model=tmp_path / "lin", routers=["round-robin"], decode=D,
                   prefill=16, seeds=1, slo_tpot_ms=S, slo_ttft_ms=1e6, duration_s=2.0)
    threshold = D * (1 - L * a_ms / S) / (L * c_ms * 1e-3 * m)
    cap = v["capacity_rps"]["round-robin"]["mean"]
    assert 0.75 * threshold <= cap <= threshold
    assert v["binding_slo"]["round-robin"] == "tpot" and v["tpot_p50_change_vs_best_lb_pct"] is None
