"""Issue 37 item 4: `eldr bench replay --device`: each policy's replayed decode steps run as MoE layers with
their real token-to-expert assignment (a tiny shape on this CPU), MoE time per step with an interval, the
difference to the best load balancer and the cost model's prediction of it; refused where it would mislead."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from eldr_cli.errors import EldrError
from eldr_cli.main import run
from eldr_cli.simulator import moe_replay as mr


def test_plans_group_each_layers_tokens_by_their_true_experts():
    picks = np.array([[[3, 1], [0, 2]], [[1, 0], [2, -1]], [[3, 0], [0, 0]]])  # [n=3, L=2, k=2]; -1: padding
    plans = mr.plans_of(picks, 4)
    order, offs = plans[0]
    assert offs.tolist() == [2, 4, 4, 6]  # expert 0: tokens 1, 2; expert 1: 0, 1; expert 2: none; 3: 0, 2
    assert order.tolist() == [1, 2, 0, 1, 0, 2]
    order, offs = plans[1]
    assert offs.tolist() == [3, 3, 5, 5] and sorted(order[:3].tolist()) == [0, 2, 2]  # token 2 picked 0 twice
    for (o, f), layer in zip(plans, range(2), strict=True):  # every real pick, once, under its expert
        got = {(int(t), e) for e, (s, t_) in enumerate(zip(np.r_[0, f[:-1]], f, strict=True)) for t in o[s:t_]}
        want = {(i, int(e)) for i in range(3) for e in picks[i, layer] if 0 <= e < 4}
        assert got == want


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("rm")
    assert run(["synth-trace", "--out", str(d / "t"), "--requests", "40", "--layers", "4", "--experts", "16",
                "--top-k", "2", "--decode-steps", "8", "--picks"]) == 0
    assert run(["fit", "--trace", str(d / "t"), "--decoders", "2", "--out", str(d / "f"), "--no-figures"]) == 0
    from eldr_cli.costmodel import CostModel, write_cost_model

    write_cost_model(d / "cm", CostModel(a_ms=0.05, b_ms=0.003, c_ms=0.0002, source="measured", top_k=2))
    return d


def test_a_tiny_measured_replay_on_the_cpu_times_each_policy_beside_the_prediction(tiny, capsys):
    d, out = tiny, tiny / "rep"
    assert run(["bench", "replay", "--trace", str(d / "t"), "--routing", str(d / "f"), "--out", str(out),
                "--split", "all", "--batch-sizes", "4", "--policies", "round-robin,jsq,eldr", "--device", "cpu",
                "--tiny", "--max-steps", "3", "--cost-model", str(d / "cm")]) == 0
    printed = capsys.readouterr().out
    assert "MEASURED (tiny shape" in printed and "MoE ms/step" in printed
    res = json.loads((out / "replay.json").read_text())
    assert res["measured"]["hidden"] == 64 and "loop" in res["measured"]["timed"]
    m = {r["policy"]: r["measured"] for r in res["results"]}
    assert set(m) == {"round-robin", "jsq", "eldr"}
    for x in m.values():
        assert x["steps_timed"] == 3 and len(x["moe_ms_per_step"]) == 3 and x["moe_ms"] > 0
        assert x["moe_ms_ci95"][0] <= x["moe_ms"] <= x["moe_ms_ci95"][1]
        assert x["pred_expert_ms"] == pytest.approx(0.003 * x["active_per_step"])
    vs = {r["policy"]: r for r in res["measured_vs_best_lb"]}
    best = vs["eldr"]["best_lb"]
    assert best in ("round-robin", "jsq") and vs[best]["delta_ms"] == 0.0
    assert vs["eldr"]["pred_delta_expert_ms"] == pytest.approx(0.003 * (m["eldr"]["active_per_step"]
                                                                        - m[best]["active_per_step"]))
    assert vs["eldr"]["delta_ci95"][0] <= vs["eldr"]["delta_ms"] <= vs["eldr"]["delta_ci95"][1]
    import polars as pl

    assert pl.read_parquet(out / "moe_time.parquet").height == 3


@pytest.mark.parametrize("args,msg", [(["--device", "cpu"], "on a CPU that would time nothing a GPU serves"),
                                      (["--tiny"], "belong to a measured replay"),
                                      (["--device", "cpu", "--tiny", "--dtype", "fp8"], "fp8 needs a CUDA GPU"),
                                      (["--device", "cuda", "--model", "Llama-4-Maverick"], "torch sees no CUDA GPU"),
                                      (["--device", "cpu", "--tiny", "--dtype", "int4"], "unknown --dtype")])
def test_a_measured_replay_that_would_mislead_is_refused(tiny, tmp_path, capsys, monkeypatch, args, msg):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "rep"
    assert run(["bench", "replay", "--trace", str(tiny / "t"), "--routing", str(tiny / "f"), "--out", str(out),
                "--batch-sizes", "4", *args]) == 2
    err = capsys.readouterr().err
    assert msg in err and "Traceback" not in err, err
    assert not out.exists()


def test_the_model_must_be_the_traces(tiny, tmp_path, capsys):
    hook = mr.MeasuredReplay.__new__(mr.MeasuredReplay)
    hook.tiny, hook.cost_params = False, {}
    from eldr_cli.costmodel.decode_step import layer_shape

    hook.shape = layer_shape("Llama-4-Maverick", 8)
    with pytest.raises(EldrError, match="24 MoE layers, 128 experts, top-1"):
        hook._check(SimpleNamespace(num_layers=4, num_experts=16, top_k=2))
    out = tmp_path / "rep"  # a measured decode step of another model as the prediction: refused, nothing written
    assert run(["bench", "decode-step", "--from-measured", "H200", "--out", str(tmp_path / "q")]) == 0
    assert run(["bench", "replay", "--trace", str(tiny / "t"), "--routing", str(tiny / "f"), "--out", str(out),
                "--batch-sizes", "4", "--policies", "jsq", "--device", "cpu", "--tiny", "--max-steps", "2",
                "--cost-model", str(tmp_path / "q")]) == 2
    assert "measured decode step of Qwen3-30B-A3B" in capsys.readouterr().err
    assert not out.exists()
