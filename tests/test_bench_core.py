"""Bench building blocks: arrival schedules, prompts, metrics, the cost model fit, trace replay and
the simulator's decode core (checked against hand-computed and pure-Python references)."""

import json

import numpy as np
import polars as pl
import pytest

from eldr_cli.bench.metrics import _weighted_percentile, requests_frame, summarize
from eldr_cli.bench.workload import build_schedule, load_prompts, parse_rates
from eldr_cli.costmodel import CostModel, write_cost_model
from eldr_cli.costmodel.moe_layer import fit_cost_model
from eldr_cli.data import prompts_file
from eldr_cli.errors import EldrError
from eldr_cli.main import run
from eldr_cli.simulator.replay import TraceReplay, prefill_batch
from eldr_cli.synth import synthetic_trace

TASK = str(prompts_file("task"))


def test_poisson_schedule_rate_and_determinism():
    s = build_schedule(100, 50.0, duration_s=200, warmup_s=20, seed=1)
    gaps = np.diff(s.offsets)
    assert abs(len(s) / 220 - 50) < 2.5           # ~11,000 arrivals: rate within 5%
    assert abs(gaps.std() / gaps.mean() - 1) < 0.05  # exponential gaps: CV 1
    assert s.warmup.sum() == (s.offsets < 20).sum() and s.offsets.max() < 220
    s2 = build_schedule(100, 50.0, duration_s=200, warmup_s=20, seed=1)
    np.testing.assert_array_equal(s.offsets, s2.offsets)
    np.testing.assert_array_equal(s.prompt_index, s2.prompt_index)
    # every prompt is used once per pass before any repeats
    assert sorted(s.prompt_index[:100].tolist()) == list(range(100))


def test_gamma_burstiness_changes_dispersion():
    bursty = np.diff(build_schedule(10, 20.0, duration_s=500, burstiness=0.25, seed=0).offsets)
    regular = np.diff(build_schedule(10, 20.0, duration_s=500, burstiness=4.0, seed=0).offsets)
    assert bursty.std() / bursty.mean() > 1.6      # CV = 1/sqrt(shape) = 2
    assert regular.std() / regular.mean() < 0.65   # CV = 0.5
    assert abs(bursty.mean() - 0.05) < 0.01 and abs(regular.mean() - 0.05) < 0.005


@pytest.mark.parametrize("bad", ["0", "-5", "abc", "10,nan", ""])
def test_rates_must_be_positive_numbers(bad):
    with pytest.raises(EldrError):
        parse_rates(bad)


def test_prompts_from_real_jsonl_and_empty_file(tmp_path):
    items = load_prompts(TASK, limit=50)
    assert len(items) == 50 and all(i.prompt and i.domain for i in items)
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"id": 1}\n\n')
    with pytest.raises(EldrError, match="no prompts"):
        load_prompts(empty)


def test_summary_counts_failures_and_matches_numpy():
    rows = []
    for i in range(10):
        ok = i % 5 != 4
        rows.append({"request_id": str(i), "router": "rr", "request_rate": 1.0, "prompt_index": i, "domain": None,
                     "scheduled_s": i, "sent_s": float(i), "lag_ms": 0.1 * i, "ttft_ms": 10.0 + i if ok else None,
                     "tpot_ms": 2.0 * i if ok else None, "e2el_ms": 100.0 + i if ok else 5.0,
                     "itl_ms": [1.0, 3.0] if ok else None, "prompt_tokens": 7, "output_tokens": 3 if ok else 0,
                     "outcome": "ok" if ok else "http_error", "error": None if ok else "HTTP 500",
                     "warmup": i == 0})
    s = summarize(requests_frame(rows), request_rate=1.0, router="rr", mode="real")
    assert s["num_prompts"] == 9 and s["completed"] == 7 and s["failed"] == 2
    assert s["failed_by_outcome"] == {"http_error": 2}
    ok_tpot = [2.0 * i for i in range(1, 10) if i % 5 != 4]
    assert s["median_tpot_ms"] == pytest.approx(np.median(ok_tpot))
    assert s["p99_tpot_ms"] == pytest.approx(np.percentile(ok_tpot, 99))
    assert s["mean_ttft_ms"] == pytest.approx(np.mean([10.0 + i for i in range(1, 10) if i % 5 != 4]))
    assert s["median_itl_ms"] == pytest.approx(2.0)
    assert s["total_output_tokens"] == 21
    assert s["median_schedule_lag_ms"] == pytest.approx(np.median([0.1 * i for i in range(1, 10)]))


def test_weighted_percentile_equals_expanded_samples():
    rng = np.random.default_rng(0)
    v = rng.normal(50, 10, 40)
    w = rng.integers(0, 6, 40)
    for q in (1, 50, 90, 99):
        assert _weighted_percentile(v, w, q) == pytest.approx(np.percentile(np.repeat(v, w), q))


def test_cost_model_fit_recovers_known_coefficients():
    rng = np.random.default_rng(0)
    rows = [{"batch": b, "active_experts": a, "ms": 0.3 + 0.8 * a + 0.05 * b + rng.normal(0, 0.01)}
            for b in (1, 8, 32, 64) for a in (1, 4, 16, 32) if a <= 8 * b]
    dense = [{"batch": b, "ms": 0.5 + 0.02 * b} for b in (1, 8, 32, 64)]
    m, fit = fit_cost_model(rows, dense)
    assert m.a_ms == pytest.approx(0.3, abs=0.05) and m.b_ms == pytest.approx(0.8, abs=0.01)
    assert m.c_ms == pytest.approx(0.05, abs=0.005) and m.e_ms == pytest.approx(0.5) and m.d_ms == pytest.approx(0.02)
    assert fit["r2"] > 0.999


@pytest.mark.slow
def test_moe_layer_command_times_and_fits(tmp_path):
    out = tmp_path / "cost"
    rc = run(["bench", "moe-layer", "--out", str(out), "--experts", "8", "--hidden", "64", "--intermediate", "32",
              "--top-k", "2", "--batches", "1,4,16", "--active", "1,2,4,8", "--repeats", "2"])
    assert rc == 0
    m = CostModel.load(out)
    assert m.top_k == 2 and m.b_ms >= 0 and m.source == "measured"
    import torch

    # auto: the artifact names what was timed (the GPU when torch sees one, else this CPU)
    assert m.device.startswith("cuda (" if torch.cuda.is_available() else "cpu (")
    t = pl.read_parquet(out / "moe_timings.parquet")
    # only feasible points: at most batch * top_k distinct experts
    assert set(zip(t["batch"], t["active_experts"], strict=True)) == {(1, 1), (1, 2), (4, 1), (4, 2), (4, 4), (4, 8),
                                                          (16, 1), (16, 2), (16, 4), (16, 8)}
    assert (out / "fig2_moe_layer.png").stat().st_size > 1000


def test_moe_layer_device_cuda_without_a_gpu_is_a_user_error(tmp_path, monkeypatch):
    import torch

    from eldr_cli.costmodel.moe_layer import resolve_device
    from eldr_cli.errors import EldrError

    # torch's answer is faked both ways, so both paths run on every machine (a GPU machine included)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == "cuda" and resolve_device("cuda") == "cuda" and resolve_device("cpu") == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == "cpu" and resolve_device("cpu") == "cpu"
    with pytest.raises(EldrError, match="no CUDA GPU"):
        resolve_device("cuda")
    rc = run(["bench", "moe-layer", "--out", str(tmp_path / "cm"), "--device", "cuda", "--repeats", "1"])
    assert rc == 2 and not (tmp_path / "cm").exists()


def test_cost_model_of_wrong_kind_is_a_user_error(tmp_path):
    from eldr_cli.artifacts.trace import write_trace

    write_trace(tmp_path / "trace", synthetic_trace(20, 2, 8, 2, decode_steps=4, with_picks=True))
    with pytest.raises(EldrError, match="expected cost-model"):
        CostModel.load(tmp_path / "trace")
    rc = run(["emulate", "--trace", str(tmp_path / "trace"), "--cost-model", str(tmp_path / "trace")])
    assert rc == 2


def _replay(seed=0, **kw):
    t = synthetic_trace(30, 3, 16, 2, decode_steps=8, with_picks=True, seed=seed, **kw)
    cost = CostModel(a_ms=0.5, b_ms=1.0, c_ms=0.1, e_ms=0.2, d_ms=0.05, source="given")
    return t, TraceReplay(t, cost)


def test_replay_union_equals_python_sets():
    t, rp = _replay()
    rows = np.array([0, 3, 7, 11])
    done = np.array([0, 5, 9, 2])  # 9 wraps around to step 1 of an 8-step request
    want = 0
    for layer in range(3):
        s = set()
        for r, j in zip(rows, done, strict=True):
            s |= set(t.steps_of(int(r))[j % 8, layer].tolist())
        want += len(s)
    assert rp.decode_active(rows, done) == want
    ms, a = rp.decode_step_ms(rows, done)
    assert ms == pytest.approx(3 * (0.5 + 0.2 + (0.1 + 0.05) * 4) + 1.0 * want)
    # prefill union: experts with a non-zero prompt count
    want_p = sum(len(set(np.flatnonzero(t.prefill_counts[r, layer]).tolist()) | set(np.flatnonzero(
        t.prefill_counts[5, layer]).tolist())) for r in [2] for layer in range(3))
    assert rp.prefill_active([2, 5]) == want_p


def test_replay_matches_prompts_and_falls_back_deterministically():
    t, rp = _replay()
    assert rp.match(t.column("prompt")[4]) == (4, True)
    assert rp.match("  " + t.column("prompt")[4] + "\n") == (4, True)
    r1, ok = rp.match("a prompt nobody captured")
    assert not ok and rp.match("a prompt nobody captured") == (r1, False) and 0 <= r1 < 30


def test_prefill_batch_token_budget():
    assert prefill_batch([100, 200, 300], 350) == 2
    assert prefill_batch([1000, 10], 500) == 1  # always at least one
    assert prefill_batch([10] * 5, 1000) == 5


def test_decode_core_matches_reference_loop():
    """The numba decode pool against a straightforward Python re-implementation of the same rules."""
    from eldr_cli.simulator.core import DecodePool

    t, rp = _replay(seed=2)
    rng = np.random.default_rng(0)
    n = 40
    rows = rng.integers(0, 30, n)
    arrive = np.sort(rng.uniform(0, 0.5, n))
    maxtok = rng.integers(1, 12, n)
    worker = rng.integers(0, 2, n)
    pool = DecodePool(rp, 2, rows, maxtok, np.ones(n, bool), max_seqs=3, log_capacity=4)
    for i in range(n):
        pool.advance(arrive[i])
        pool.admit(int(worker[i]), i, float(arrive[i]))
    pool.advance(np.inf)

    # reference: per worker, event-by-event
    finish = np.full(n, np.nan)
    first = np.full(n, np.nan)
    for w in range(2):
        ids = [i for i in range(n) if worker[i] == w]
        queue, running, ntok = [], [], {i: 0 for i in ids}
        t_now, k = None, 0
        while k < len(ids) or queue or running:
            if not running and not queue:
                t_now = arrive[ids[k]]
            while k < len(ids) and arrive[ids[k]] <= t_now:
                queue.append(ids[k])
                k += 1
            while queue and len(running) < 3:
                running.append(queue.pop(0))
            ms, _ = rp.decode_step_ms(rows[running], np.array([ntok[i] for i in running]))
            t_now = t_now + ms / 1000
            keep = []
            for i in running:
                ntok[i] += 1
                if ntok[i] == 1:
                    first[i] = t_now
                if ntok[i] >= maxtok[i]:
                    finish[i] = t_now
                else:
                    keep.append(i)
            running = keep
    np.testing.assert_allclose(pool.req_finish, finish, rtol=1e-9)
    np.testing.assert_allclose(pool.req_first, first, rtol=1e-9)
    assert (pool.inflight == 0).all()
    log = pool.step_log()
    assert log["batch"].max() <= 3 and len(log["batch"]) > 4  # the log grew past its initial capacity


@pytest.mark.slow
def test_simulator_calls_the_shared_routing_objects(tmp_path, monkeypatch):
    """bench simulate must route with the decode router of eldr_cli.routing.make_router (imported, not copied)."""
    import eldr_cli.routing.router as routing
    from eldr_cli.artifacts.trace import write_trace
    from eldr_cli.pipeline.fit import run_fit
    from eldr_cli.pipeline.simulate import run_simulate

    t = synthetic_trace(120, 4, 16, 2, decode_steps=16, with_picks=True, seed=1)
    write_trace(tmp_path / "trace", t)
    run_fit(tmp_path / "trace", tmp_path / "fit", decoders=3, figures=False, pairs=2000)
    write_cost_model(tmp_path / "cost", CostModel(a_ms=0.2, b_ms=0.5, c_ms=0.05, source="given"))
    seen = []
    real = routing.DecodeRouter.decide

    def spy(self, counts, loads, **kw):
        d = real(self, counts, loads, **kw)
        seen.append((self.name, d.signature == "ok", kw.get("domain")))
        return d

    monkeypatch.setattr(routing.DecodeRouter, "decide", spy)
    out = run_simulate(tmp_path / "sim", trace=tmp_path / "trace", cost_model=tmp_path / "cost",
                       routing=tmp_path / "fit", split="all", routers=["round-robin", "eldr", "domain"],
                       rates=[20.0], n_prefill=1, n_decode=3, duration_s=3, warmup_s=1, max_tokens=8)
    assert {s[0] for s in seen} == {"round-robin", "eldr", "domain"}
    assert all(sig for name, sig, _ in seen if name == "eldr")
    assert all(dom and dom.startswith("d") for name, _, dom in seen if name == "domain")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mode"] == "simulated" and "SIMULATED" in summary["label"]
    assert {r["router"] for r in summary["runs"]} == {"round-robin", "eldr", "domain"}
    req = pl.read_parquet(out / "requests.parquet")
    assert (req["outcome"] == "ok").all() and (req["output_tokens"] == 8).all()
    steps = pl.read_parquet(out / "steps.parquet")
    assert steps["active_experts"].max() <= 4 * 16 and (out / "fig13_active_experts.png").exists()


def test_simulate_rejects_a_routing_artifact_of_another_model(tmp_path):
    from eldr_cli.artifacts.trace import write_trace
    from eldr_cli.pipeline.fit import run_fit

    write_trace(tmp_path / "a", synthetic_trace(60, 4, 16, 2, decode_steps=4, with_picks=True))
    write_trace(tmp_path / "b", synthetic_trace(60, 3, 16, 2, decode_steps=4, with_picks=True))
    run_fit(tmp_path / "b", tmp_path / "fit", decoders=2, figures=False, pairs=1000)
    write_cost_model(tmp_path / "cost", CostModel(a_ms=0.2, b_ms=0.5, c_ms=0.05, source="given"))
    rc = run(["bench", "simulate", "--trace", str(tmp_path / "a"), "--cost-model", str(tmp_path / "cost"),
              "--routing", str(tmp_path / "fit"), "--split", "all", "--decode", "2", "--prefill", "1",
              "--rates", "5", "--duration", "2", "--warmup", "0", "--out", str(tmp_path / "sim")])
    assert rc == 2 and not (tmp_path / "sim").exists()
    rc = run(["bench", "simulate", "--trace", str(tmp_path / "b"), "--cost-model", str(tmp_path / "cost"),
              "--routing", str(tmp_path / "fit"), "--rates", "5,-1", "--out", str(tmp_path / "sim")])
    assert rc == 2


@pytest.fixture(scope="module")
def imported_trace(tmp_path_factory):
    """An imported public-layout trace: no prompt text, 6 captured decode steps per row."""
    from eldr_cli.capture.oic_fixtures import write_oic_tree

    d = tmp_path_factory.mktemp("imp")
    write_oic_tree(d / "src", n_per_subject=10, decode_steps=6)
    assert run(["capture", "--from-trace", str(d / "src" / "acme" / "Tiny-MoE"), "--out", str(d / "t"),
                "--no-progress"]) == 0
    return d / "t"


def test_rows_without_text_go_as_row_references(imported_trace, tmp_path):
    """Imported rows become `trace-row:<request_id>` prompts; the replay resolves each to its own row (never
    to the empty-text row 0), and sending them to a non-emulated endpoint is refused before any request."""
    from eldr_cli.artifacts.trace import read_trace
    from eldr_cli.bench.workload import row_ref

    tr = read_trace(imported_trace)
    items = load_prompts(imported_trace, split="evaluation")
    ev = np.flatnonzero(tr.split_mask("evaluation"))
    assert [it.prompt for it in items] == [row_ref(i) for i in tr.column("request_id")[ev]]
    rep = TraceReplay(tr, CostModel(a_ms=0.1, b_ms=0.01, c_ms=0.01))
    assert [rep.match(it.prompt) for it in items] == [(int(r), True) for r in ev]
    assert rep.match("")[1] is False and rep.rows_without_text == tr.n_requests
    assert rep.wraps(int(ev[0]), 7) and not rep.wraps(int(ev[0]), 6)
    rc = run(["bench", "serve", "--url", "http://127.0.0.1:9", "--prompts", str(imported_trace), "--rates", "5",
              "--duration", "1", "--no-live", "--out", str(tmp_path / "b")])
    assert rc == 2 and not (tmp_path / "b").exists()


def test_roofline_decode_step_charges_kv_at_current_context(imported_trace, tmp_path):
    """With a roofline cost model the emulated decode step reads each running request's KV at prompt +
    generated tokens (Roofline.step_ms with those contexts); a measured model has no context term."""
    import json as _json

    from eldr_cli.artifacts.trace import read_trace
    from eldr_cli.costmodel.roofline import run_cost_model

    cfg = dict(hidden_size=256, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
               num_experts=16, num_experts_per_tok=2, moe_intermediate_size=128, decoder_sparse_step=2,
               vocab_size=1000)
    (tmp_path / "config.json").write_text(_json.dumps(cfg))
    run_cost_model(tmp_path / "cm", tmp_path / "config.json", device="H100-SXM")
    roof = getattr(CostModel.load(tmp_path / "cm"), "roofline", None)
    assert roof is not None and getattr(CostModel.load(_measured(tmp_path)), "roofline", None) is None
    tr = read_trace(imported_trace)
    rep = TraceReplay(tr, CostModel.load(tmp_path / "cm"))
    rows = np.arange(4)
    early, a0 = rep.decode_step_ms(rows, np.zeros(4, dtype=np.int64))
    late, a1 = rep.decode_step_ms(rows, np.full(4, 6000, dtype=np.int64))  # same captured step (6000 % 6 == 0)
    assert a0 == a1
    ctx0 = rep.prompt_tokens[rows]
    assert early == pytest.approx(roof.step_ms(a0, ctx0)) and late == pytest.approx(roof.step_ms(a0, ctx0 + 6000))
    assert late > early  # 24,000 more KV tokens read
    # prefill: the roofline at the batch's prompt tokens, no KV read (not the linearisation's per-token KV)
    pre, ap = rep.prefill_step_ms(rows)
    T = int(rep.prompt_tokens[rows].sum())
    overhead = roof.facts.n_layers * roof.overhead_us / 1e3
    assert pre == pytest.approx(max(roof.memory_ms(ap, 0.0), roof.compute_ms(T, 0.0)) + overhead)
    flat = TraceReplay(tr, CostModel(a_ms=0.1, b_ms=0.01, c_ms=0.01))
    assert flat.decode_step_ms(rows, np.zeros(4, dtype=np.int64)) == flat.decode_step_ms(rows, np.full(4, 6000))


def _measured(tmp_path):
    write_cost_model(tmp_path / "measured", CostModel(a_ms=0.1, b_ms=0.01, c_ms=0.01))
    return tmp_path / "measured"


def test_grouped_gemm_plan_computes_the_per_expert_loop():
    """The grouped backend (torch._grouped_mm over all experts, per-expert row offsets, inactive experts empty)
    gives the loop's result, on this CPU (float32)."""
    import torch

    from eldr_cli.costmodel.moe_layer import _grouped_plan, _routing

    E, H, I, k = 8, 32, 16, 2
    g = torch.Generator().manual_seed(0)
    wg, wu, wd = torch.randn(E, H, I, generator=g), torch.randn(E, H, I, generator=g), torch.randn(E, I, H, generator=g)
    x = torch.randn(6, H, generator=g)
    routes = [(e, torch.from_numpy(t)) for e, t in _routing(6, 4, k, E, np.random.default_rng(1))]
    order, offs = _grouped_plan(routes, E, torch.device("cpu"))
    assert offs.dtype == torch.int32 and offs.shape == (E,) and int(offs[-1]) == order.numel() == 6 * k
    xs = x.index_select(0, order)
    h = torch.nn.functional.silu(torch._grouped_mm(xs, wg, offs=offs)) * torch._grouped_mm(xs, wu, offs=offs)
    got = torch.zeros_like(x).index_add_(0, order, torch._grouped_mm(h, wd, offs=offs))
    want = torch.zeros_like(x)
    for e, idx in routes:
        xe = x[idx]
        want.index_add_(0, idx, (torch.nn.functional.silu(xe @ wg[e]) * (xe @ wu[e])) @ wd[e])
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-4)


def test_moe_layer_backends_on_a_cpu_and_their_refusals(tmp_path, monkeypatch):
    import torch

    from eldr_cli.artifacts.store import Artifact
    from eldr_cli.costmodel.moe_layer import resolve_backend
    from eldr_cli.errors import EldrError

    small = ["--experts", "8", "--hidden", "64", "--intermediate", "32", "--top-k", "2", "--batches", "4",
             "--active", "1,4,8", "--repeats", "1", "--device", "cpu"]
    assert run(["bench", "moe-layer", "--out", str(tmp_path / "g"), "--backend", "grouped", *small]) == 0
    p = Artifact(tmp_path / "g").params
    assert (p["backend"], p["launch"], p["launch_bound"]) == ("grouped", "eager", False)
    assert "torch._grouped_mm" in p["timed"] and "CUDA graph capture skipped: no CUDA GPU" in p["timed"]
    # CUDA graphs on a CPU: one message, exit 2, nothing written
    rc = run(["bench", "moe-layer", "--out", str(tmp_path / "bad"), "--launch", "graph", *small])
    assert rc == 2 and not (tmp_path / "bad").exists()
    assert resolve_backend("auto", "auto", "cpu", "float32")[:2] == ("loop", "eager")
    # on a GPU (faked): grouped in a CUDA graph by default; the eager loop only on request, labelled
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "FAKE H100")
    assert resolve_backend("auto", "auto", "cuda", "bfloat16")[:2] == ("grouped", "graph")
    assert "LAUNCH-BOUND" in resolve_backend("loop", "eager", "cuda", "bfloat16")[2]
    with pytest.raises(EldrError, match="runs bf16"):
        resolve_backend("grouped", "graph", "cuda", "float32")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    with pytest.raises(EldrError, match=r"compute capability >= 9\.0 \(this GPU \(8, 0\)"):
        resolve_backend("auto", "auto", "cuda", "bfloat16")
    with pytest.raises(EldrError, match="unknown --backend"):
        resolve_backend("fused", "auto", "cpu", "float32")
