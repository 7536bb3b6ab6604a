"""The simulator serves any trace's rows: imported traces (no prompt text) with a roofline cost model."""

from __future__ import annotations

import json

import pytest

from eldr_cli.artifacts.store import Artifact
from eldr_cli.capture.oic_fixtures import write_oic_tree
from eldr_cli.main import run as eldr

# an MoE config of the fixture's shape: 8 layers, every other one MoE (4), 16 experts, top-2
CONFIG = dict(hidden_size=256, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
              num_experts=16, num_experts_per_tok=2, moe_intermediate_size=128, decoder_sparse_step=2,
              vocab_size=1000)


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    d = tmp_path_factory.mktemp("imp")
    write_oic_tree(d / "src", n_per_subject=20, decode_steps=6)
    assert eldr(["capture", "--from-trace", str(d / "src" / "acme" / "Tiny-MoE"), "--out", str(d / "t"),
                 "--no-progress"]) == 0
    (d / "config.json").write_text(json.dumps(CONFIG))
    assert eldr(["bench", "cost-model", "--model", str(d / "config.json"), "--device", "H100-SXM",
                 "--out", str(d / "cm")]) == 0
    return d


def test_simulate_an_imported_trace_without_prompt_text(imported, tmp_path):
    d = imported
    out = tmp_path / "sim"
    code = eldr(["bench", "simulate", "--trace", str(d / "t"), "--cost-model", str(d / "cm"), "--routers",
                 "round-robin,jsq", "--rates", "5,20", "--duration", "10", "--warmup", "1", "--max-tokens", "16",
                 "--prefill", "1", "--decode", "2", "--out", str(out)])
    assert code == 0
    assert Artifact(out).params["mode"] == "simulated"
    runs = json.loads((out / "summary.json").read_text())["runs"]
    assert len(runs) == 4
    for r in runs:
        assert r["completed"] > 0 and r["unmatched"] == 0 and r["matched"] >= r["completed"]
        # 16 tokens asked, 6 captured decode steps per row: every request wrapped, and the summary says so
        assert r["wrapped_requests"] == r["matched"]
        assert r["p50_tpot_ms"] > 0


def test_cost_model_of_another_model_is_refused(imported, tmp_path):
    d = imported
    assert eldr(["bench", "cost-model", "--model", "Qwen3-30B-A3B", "--device", "MI300X",
                 "--out", str(tmp_path / "q")]) == 0
    code = eldr(["bench", "simulate", "--trace", str(d / "t"), "--cost-model", str(tmp_path / "q"), "--routers",
                 "round-robin", "--rates", "5", "--duration", "5", "--out", str(tmp_path / "sim")])
    assert code == 2 and not (tmp_path / "sim").exists()


def test_kv_capacity_of_the_cost_model_caps_the_simulated_decoders(imported, tmp_path):
    """A deployment whose HBM leaves 100 KV tokens (6 blocks of 16): every running request holds at least
    one block, so a decoder never runs more than 6 requests; without a cap it runs more."""
    import polars as pl

    from eldr_cli.costmodel.roofline import build

    d = imported
    _, _, r, _ = build(str(d / "config.json"), device="H100-SXM")
    hbm_gb = (r.weights_resident_bytes() + 100.5 * r.kv_bytes_per_token_gpu) / 0.9 / 1e9
    assert eldr(["bench", "cost-model", "--model", str(d / "config.json"), "--device", "H100-SXM", "--hbm-gb",
                 repr(hbm_gb), "--min-kv-tokens", "64", "--out", str(tmp_path / "cm")]) == 0
    assert Artifact(tmp_path / "cm").params["kv_capacity_tokens"] == 100
    batches = {}
    for name, cm in (("capped", tmp_path / "cm"), ("free", d / "cm")):
        out = tmp_path / name
        assert eldr(["bench", "simulate", "--trace", str(d / "t"), "--cost-model", str(cm), "--routers",
                     "round-robin", "--rates", "3000", "--duration", "1", "--warmup", "0.2", "--max-tokens",
                     "16", "--prefill", "2", "--decode", "1", "--out", str(out)]) == 0
        batches[name] = pl.read_parquet(out / "steps.parquet")["batch"].max()
    assert batches["capped"] <= 6 < batches["free"]
