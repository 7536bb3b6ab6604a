"""End to end: `eldr capture` on the tiny checkpoint -> a trace `eldr fit` reads; resume after a kill;
bad input leaves nothing behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from eldr_cli.artifacts.store import Artifact
from eldr_cli.artifacts.trace import read_trace
from eldr_cli.capture.staging import staging_dir
from eldr_cli.data import prompts_file
from eldr_cli.errors import EldrError
from eldr_cli.main import run as eldr
from eldr_cli.pipeline.capture import run_capture

TASK = prompts_file("task")


def _short_real_prompts(path: Path, per_domain: int, max_chars: int = 260) -> Path:
    """A few short real prompts of every domain of task.jsonl (keeps CPU tests quick)."""
    out, seen = [], {}
    for line in TASK.open():
        r = json.loads(line)
        if len(r["prompt"]) <= max_chars and seen.get(r["domain"], 0) < per_domain:
            seen[r["domain"]] = seen.get(r["domain"], 0) + 1
            out.append(r)
    path.write_text("".join(json.dumps(r) + "\n" for r in out))
    return path


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    return _short_real_prompts(tmp_path_factory.mktemp("prompts") / "calib.jsonl", per_domain=3)


@pytest.fixture(scope="module")
def captured(tiny_moe_dir, prompts, tmp_path_factory):
    out = tmp_path_factory.mktemp("cap") / "trace"
    res = run_capture(tiny_moe_dir, prompts, out, max_new_tokens=6, batch_size=4, chunk_size=5,
                      eval_fraction=0.34, progress=False)
    return out, res


def test_capture_writes_a_trace_fit_can_use(captured, tmp_path, tiny_moe_dir):
    out, res = captured
    t = read_trace(out)
    R, L, E = t.prefill_counts.shape
    assert (R, L, E) == (12, 4, 16) and t.model["top_k"] == 4 and t.model["family"] == "qwen3_moe"
    assert t.model["moe_layer_ids"] == [0, 1, 2, 3]
    np.testing.assert_array_equal(t.prefill_counts.sum(axis=2), np.repeat(t.prompt_tokens[:, None] * 4, L, axis=1))
    np.testing.assert_array_equal(t.decode_steps, 6)
    assert t.decode_picks.shape == (12 * 6, L, 4) and t.decode_offsets[-1] == 72
    # decode counts are the per-step picks, counted
    for r in range(R):
        steps = t.steps_of(r)
        for li in range(L):
            np.testing.assert_array_equal(t.decode_counts[r, li], np.bincount(steps[:, li].ravel(), minlength=E))
    assert set(t.column("split")) == {"calibration", "evaluation"}
    assert t.prefill_gate_prob is not None and np.allclose(t.prefill_gate_prob.sum(-1), t.prompt_tokens[:, None])
    m = Artifact(out).metrics
    assert len(m["prefill_decode_corr_per_layer"]) == L and -1 <= m["prefill_decode_corr_mean"] <= 1
    assert (out / "fig1_domain_experts.png").is_file() and (out / "fig3_prefill_vs_decode.png").is_file()
    assert not staging_dir(out).exists()
    # the same request captured alone gives the same counts (batching/padding invisible)
    from eldr_cli.capture.hf import TransformersBackend

    be = TransformersBackend(tiny_moe_dir)
    one = be.run_batch([be.tokenize(t.column("prompt")[3])], 6)[0]
    np.testing.assert_array_equal(one.prefill_counts, t.prefill_counts[3])
    np.testing.assert_array_equal(one.decode_picks, t.steps_of(3))
    # and `eldr fit` runs on it unchanged
    assert eldr(["fit", "--trace", str(out), "--decoders", "2", "--out", str(tmp_path / "fit"), "--pairs", "500"]) == 0
    assert (tmp_path / "fit" / "routing" / "manifest.json").is_file()


def test_too_long_prompts_are_skipped_and_counted(tiny_moe_dir, tmp_path):
    rng = np.random.default_rng(0)
    long_text = " ".join("".join(rng.choice(list("qxzjkvw"), 6)) for _ in range(3000))
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"id": "long", "prompt": long_text}) + "\n" + json.dumps({"id": "ok", "prompt": "hi there"})
                 + "\n")
    res = run_capture(tiny_moe_dir, f, tmp_path / "t", max_new_tokens=2, eval_fraction=0, progress=False)
    assert res.metrics["n_skipped_too_long"] == 1 and res.metrics["n_requests"] == 1
    assert read_trace(tmp_path / "t").column("request_id").tolist() == ["ok"]


@pytest.mark.slow
def test_resume_after_kill_matches_an_uninterrupted_capture(tiny_moe_dir, prompts, captured, tmp_path):
    ref_out, _ = captured
    out = tmp_path / "trace"
    args = [sys.executable, "-m", "eldr_cli", "capture", "--model", str(tiny_moe_dir), "--prompts", str(prompts),
            "--out", str(out), "--max-new-tokens", "6", "--batch-size", "4", "--chunk-size", "5",
            "--eval-fraction", "0.34", "--no-progress"]
    proc = subprocess.Popen(args, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    state = staging_dir(out) / "state.json"
    try:
        deadline = time.time() + 180
        while time.time() < deadline:
            if state.is_file() and json.loads(state.read_text())["chunks"]:
                break
            assert proc.poll() is None, proc.stderr.read().decode()
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(30)
    done = json.loads(state.read_text())["chunks"]
    assert 1 <= len(done) < 3 and not out.exists()
    r = subprocess.run(args + ["--resume"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "resuming" in r.stderr
    a, b = read_trace(ref_out), read_trace(out)
    assert a.column("request_id").tolist() == b.column("request_id").tolist()
    for name in ("prefill_counts", "decode_counts", "decode_steps", "decode_picks", "decode_offsets"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert Artifact(out).metrics["n_resumed_requests"] == sum(c["n"] for c in done.values())


def _tree(p: Path) -> set[str]:
    return {x.name for x in p.iterdir()}


@pytest.mark.parametrize("case", ["missing", "empty", "malformed", "no-prompt-column", "not-checkpoint",
                                  "not-moe"])
def test_bad_input_exit_2_and_nothing_written(case, tiny_moe_dir, prompts, tmp_path, capsys):
    model, pf = str(tiny_moe_dir), str(prompts)
    if case == "missing":
        pf = str(tmp_path / "nope.jsonl")
    elif case == "empty":
        (tmp_path / "e.jsonl").write_text("")
        pf = str(tmp_path / "e.jsonl")
    elif case == "malformed":
        (tmp_path / "m.jsonl").write_text('{"prompt": "x"}\n{oops\n')
        pf = str(tmp_path / "m.jsonl")
    elif case == "no-prompt-column":
        (tmp_path / "n.jsonl").write_text('{"question": "x"}\n')
        pf = str(tmp_path / "n.jsonl")
    elif case == "not-checkpoint":
        (tmp_path / "notmodel").mkdir()
        (tmp_path / "notmodel" / "readme.txt").write_text("hi")
        model = str(tmp_path / "notmodel")
    elif case == "not-moe":
        from transformers import LlamaConfig, LlamaForCausalLM

        d = tmp_path / "dense"
        LlamaForCausalLM(LlamaConfig(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=2)).save_pretrained(d)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            (d / f).write_bytes((Path(tiny_moe_dir) / f).read_bytes())
        model = str(d)
    before = _tree(tmp_path)
    code = eldr(["capture", "--model", model, "--prompts", pf, "--out", str(tmp_path / "out"),
                 "--max-new-tokens", "2", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "error:" in err and "Traceback" not in err
    expect = {"missing": "does not exist", "empty": "is empty", "malformed": "not valid JSON",
              "no-prompt-column": "no 'prompt' or 'messages' column", "not-checkpoint": "not a model checkpoint",
              "not-moe": "not a mixture-of-experts"}[case]
    assert expect in " ".join(err.split())
    assert _tree(tmp_path) == before  # no out dir, no staging dir


def test_resume_refuses_another_models_artifact(captured, tmp_path, prompts, capsys):
    from eldr_cli.checkpoints.tiny import build_tiny_moe

    ref_out, _ = captured
    other = build_tiny_moe(tmp_path / "other", num_layers=2, num_experts=8, top_k=2, vocab_size=300,
                           prompts=["some text to train on"] * 20)
    before = sorted(p.name for p in ref_out.iterdir())
    mtime = (ref_out / "manifest.json").stat().st_mtime
    with pytest.raises(EldrError, match="another model"):
        run_capture(other, prompts, ref_out, resume=True, max_new_tokens=6, progress=False)
    code = eldr(["capture", "--model", str(other), "--prompts", str(prompts), "--out", str(ref_out), "--resume",
                 "--no-progress"])
    assert code == 2
    assert sorted(p.name for p in ref_out.iterdir()) == before
    assert (ref_out / "manifest.json").stat().st_mtime == mtime
    assert not staging_dir(ref_out).exists()
