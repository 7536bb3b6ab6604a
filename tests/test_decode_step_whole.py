"""Issue 37: `eldr bench decode-step` times the whole step (every layer kind of the config, summed), refuses a
model it cannot time whole, compiles one graph per shape or fails loudly, and ships the Maverick TP8 step
where both of its measured parts exist."""

from __future__ import annotations

import json

import pytest

from eldr_cli.costmodel import decode_step as ds
from eldr_cli.costmodel import layer_kinds as lk
from eldr_cli.costmodel import measured_step as ms
from eldr_cli.errors import EldrError
from eldr_cli.main import run

LLAMA4_TINY = {"architectures": ["Llama4ForConditionalGeneration"], "text_config": {
    "model_type": "llama4_text", "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 8, "num_experts_per_tok": 1,
    "intermediate_size": 32, "intermediate_size_mlp": 128, "interleave_moe_layer_step": 2, "moe_layers": [1, 3],
    "no_rope_layers": [1, 1, 1, 0], "attention_chunk_size": 8192, "vocab_size": 256, "tie_word_embeddings": False}}


@pytest.fixture
def llama4_tiny(tmp_path):
    p = tmp_path / "llama4" / "config.json"
    p.parent.mkdir()
    p.write_text(json.dumps(LLAMA4_TINY))
    return p


def test_layer_kinds_follow_each_config_layout():
    cfg = LLAMA4_TINY["text_config"]
    assert lk.moe_layer_flags(cfg) == [False, True, False, True]
    assert lk.moe_layer_flags({**cfg, "moe_layers": None}) == [False, True, False, True]  # interleave step 2
    assert lk.shared_experts(cfg) == (1, 32)  # Llama-4's one shared expert has no config key of its own
    qwen = {"num_hidden_layers": 6, "decoder_sparse_step": 1, "mlp_only_layers": [0, 5], "num_experts": 8}
    assert lk.moe_layer_flags(qwen) == [False, True, True, True, True, False]
    assert lk.shared_experts(qwen) == (0, 0)
    dsk = {"num_hidden_layers": 5, "first_k_dense_replace": 2, "n_shared_experts": 2, "moe_intermediate_size": 16}
    assert lk.moe_layer_flags(dsk) == [False, False, True, True, True]
    assert lk.shared_experts(dsk) == (2, 16)
    mav = ds.layer_shape("Llama-4-Maverick", tp=8)
    assert (mav["n_layers"], mav["dense_layers"], mav["dense_intermediate"]) == (24, 24, 2048)
    assert (mav["shared_experts"], mav["shared_intermediate"], mav["intermediate"]) == (1, 1024, 1024)
    q = ds.layer_shape("Qwen3-30B-A3B")
    assert (q["n_layers"], q["dense_layers"], q["shared_experts"]) == (48, 0, 0)
    with pytest.raises(EldrError, match="sliding-window attention"):
        ds.layer_shape("GPT-OSS-120B")


@pytest.mark.parametrize("extra,msg", [({"q_lora_rank": 8, "kv_lora_rank": 8}, "MLA"),
                                       ({"sliding_window": 128}, "sliding-window"),
                                       ({"layer_types": ["sliding_attention", "full_attention"] * 2},
                                        "sliding_attention layers")])
def test_a_model_with_a_layer_kind_it_cannot_time_is_refused_whole(tmp_path, capsys, extra, msg):
    cfg = {**LLAMA4_TINY["text_config"], **extra}
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    out = tmp_path / "cm"
    assert run(["bench", "decode-step", "--model", str(p), "--device", "cpu", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert msg in err and "none of it is" in err and "Traceback" not in err
    assert not out.exists()


def test_the_whole_step_sums_its_kinds_once_each():
    shape = {"model": "m", "top_k": 1, "n_layers": 24, "dense_layers": 24}
    moe, dense, head = {"k0": 0.08, "kb": 0.0106, "kt": 2e-5, "kv": 1e-7}, {"d0": 0.067, "dt": 7e-5, "dv": 1.1e-7}, \
        {"h0": 0.06, "h1": 1e-4}
    cm = ms.cost_model_of(moe, shape, "cuda (x)", head, dense)
    B, A, ctx = 64, 24 * 20, [1000] * 64
    want = 24 * (0.08 + 2e-5 * B + 1e-7 * sum(ctx)) + 0.0106 * A + 24 * (0.067 + 7e-5 * B + 1.1e-7 * sum(ctx)) \
        + 0.06 + 1e-4 * B
    assert cm.step_ms(A, 24, B, context=ctx) == pytest.approx(want)
    with pytest.raises(EldrError, match="half the model"):  # dense layers untimed: refused, not half-charged
        ms.cost_model_of(moe, shape, "cuda (x)", head, None)


def test_a_small_llama4_config_is_timed_whole_on_the_cpu_and_the_zero_kv_term_prints(llama4_tiny, tmp_path, capsys):
    """The issue's crash: the KV term fits to zero at these tiny contexts; the summary must print, and the
    cost model must cover all 4 layers (2 MoE with the shared expert, 2 dense) and the LM head."""
    out = tmp_path / "cm"
    rc = run(["bench", "decode-step", "--model", str(llama4_tiny), "--device", "cpu", "--batches", "4,8",
              "--active", "2,4,8", "--contexts", "64,128", "--repeats", "2", "--out", str(out)])
    text = capsys.readouterr()
    assert rc == 0 and "Traceback" not in text.err, text.err
    assert "2 MoE layers + 2 dense layers + the LM head" in text.out and "ns per KV token" in text.out
    from eldr_cli.artifacts.store import Artifact
    from eldr_cli.costmodel import CostModel

    a = Artifact(out)
    p = a.params
    assert set(p["layer_kinds"]) == {"moe", "dense", "lm_head"} and p["layer_kinds"]["moe"]["shared_experts"] == 1
    assert "kv" in p["coefficients_ms"] and p["dense_layers"] == 2 and p["n_layers"] == 2
    assert any("chunked local attention" in x for x in p["not_timed"])
    assert (out / "dense_layer_timings.parquet").is_file() and (out / "lm_head_timings.parquet").is_file()
    cm, d, k, h = CostModel.load(out), p["dense_layer_ms"], p["layer_ms"], p["lm_head_ms"]
    assert cm.a_ms == pytest.approx(k["k0"] + (2 * d["d0"] + h["h0"]) / 2)
    assert cm.kv_ms == pytest.approx(k["kv"] + 2 * d["dv"] / 2)


def test_shipped_maverick_tp8_step_on_the_h200_names_its_parts(tmp_path, capsys):
    out = tmp_path / "cm"
    assert run(["bench", "decode-step", "--from-measured", "H200", "--model", "Llama-4-Maverick", "--tp", "8",
                "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "24 MoE layers + 24 dense layers (LM head not charged)" in printed
    assert "h200_maverick_tp8_dense_layer.json" in printed
    from eldr_cli.artifacts.store import Artifact
    from eldr_cli.costmodel import CostModel

    p = Artifact(out).params
    assert p["compiled"] is False and "not compiled" in p["timed"]
    assert set(p["measured_parts"]) == {"moe", "dense", "shared"}
    assert "decode_step_maverick_tp8" in p["measured_parts"]["moe"] and "NOT compiled" in p["measured_parts"]["moe"]
    assert [x for x in p["not_timed"] if "LM head" in x] == [x for x in p["not_timed"] if x.startswith(
        "the LM head: not measured for Llama-4-Maverick TP8")] and "(LM head not charged)" in p["step"]
    assert p["provenance"] == ("MEASURED decode step: Llama-4-Maverick TP8, the whole step (24 MoE layers with "
                               "shared expert + 24 dense layers; LM head not measured; CUDA graph) on cuda (NVIDIA "
                               "H200) (shipped with eldr)")
    cm = CostModel.load(out)
    # per MoE layer: its own fixed cost + the shared expert's (26 us) + one dense layer's (67 us)
    assert cm.a_ms == pytest.approx(p["layer_ms"]["k0"] + p["dense_layer_ms"]["d0"])
    assert cm.a_ms > 1.5 * (p["layer_ms"]["k0"] - p["shared_expert_ms"]["d0"]) and p["shared_expert_ms"]["d0"] > 0.02
    assert 0.0095 < cm.b_ms < 0.0125 and cm.deployment["tp"] == 8 and "H200" in cm.device
    with pytest.raises(EldrError, match="dense layers and the shared expert on an H100"):
        ms.shipped_kinds("H100-SXM", "Llama-4-Maverick", 8)


def test_a_dynamo_fallback_is_an_error_not_a_silent_eager_run(monkeypatch):
    import torch

    from eldr_cli.costmodel import compiled

    def breaks(x):
        print("graph break")
        return x + 1

    with pytest.raises(EldrError, match="could not compile a breaking function whole"):
        with compiled.one_graph_per_shape(breaks, "a breaking function") as run:
            run(torch.ones(2))
    # dynamo skipping the frame (no graph made) is caught too
    monkeypatch.setattr(compiled, "graphs_compiled", lambda: 0)
    with pytest.raises(EldrError, match="fell back to running the layer uncompiled"):
        with compiled.one_graph_per_shape(lambda x: x, "the layer"):
            pass


def test_shape_keys_separate_what_dynamo_specialises_on():
    import torch

    from eldr_cli.costmodel.compiled import shape_key

    a, b = torch.ones(2, 3), torch.zeros(2, 3)
    assert shape_key((a, (a, b))) == shape_key((b, (b, a)))
    assert shape_key((a,)) != shape_key((torch.ones(3, 3),)) != shape_key((a.double(),))
    assert shape_key([(1, a)]) != shape_key([(2, a)])  # a loop plan's expert ids are constants to dynamo


@pytest.mark.slow
def test_more_shapes_than_the_recompile_limit_each_get_a_compiled_graph():
    """Ten shapes through one function (the limit is 8): each is compiled, none runs uncompiled."""
    import torch

    from eldr_cli.costmodel.compiled import graphs_compiled

    torch.set_num_threads(1)
    before = graphs_compiled()
    rows = ds.time_lm_head({"hidden": 32, "vocab": 64}, batches=tuple(range(1, 11)), device="cpu", compile=True,
                           repeats=2)
    assert len(rows) == 10 and graphs_compiled() - before == 10


@pytest.mark.slow
def test_points_of_one_shape_share_one_compiled_graph_and_a_new_shape_gets_its_own():
    import torch

    from eldr_cli.costmodel.compiled import PerShape, graphs_compiled

    torch.set_num_threads(1)
    comp = PerShape(lambda x, w: torch.nn.functional.silu(x @ w) + x)
    before = graphs_compiled()
    w = torch.randn(8, 8)
    outs = [comp.call((torch.full((2, 8), float(i)), w), lambda run, i=i: run(torch.full((2, 8), float(i)), w),
                      "f") for i in range(3)]
    assert comp.compiles == 1 and graphs_compiled() - before == 1  # three points, one shape: one graph
    assert torch.allclose(outs[2], torch.nn.functional.silu(torch.full((2, 8), 2.0) @ w) + 2.0)
    comp.call((torch.ones(4, 8), w), lambda run: run(torch.ones(4, 8), w), "f")
    assert comp.compiles == 2 and graphs_compiled() - before == 2
