"""`eldr model tiny --train`: deterministic, cached, atomic; bad input exits 2 with nothing written;
capture samples only prompts outside the model's training split."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from eldr_cli.artifacts.trace import read_trace
from eldr_cli.checkpoints.train import MARKER, split_of, train_tiny_moe
from eldr_cli.data import prompts_file
from eldr_cli.pipeline.capture import run_capture

# a ~30-second configuration on a loaded 2-core machine
SMALL = dict(steps=3, num_layers=2, num_experts=4, top_k=2, hidden_size=64, vocab_size=512, seq_len=32,
             batch_size=4)


def _prompts(path: Path, n: int = 80) -> Path:
    rows = [json.loads(line) for line in prompts_file("task").open()][::50][:n]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "eldr_cli", *args], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    d = tmp_path_factory.mktemp("train")
    p = _prompts(d / "p.jsonl")
    return p, train_tiny_moe(d / "a", seed=3, prompt_files=[p], **SMALL)


def test_training_is_deterministic_cached_and_complete(trained, tmp_path):
    p, a = trained
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "split.json",
              "train_log.json", "loss.png", MARKER):
        assert (a / f).is_file(), f
    b = train_tiny_moe(tmp_path / "b", seed=3, prompt_files=[p], **SMALL)
    ha = json.loads((a / MARKER).read_text())["weights_sha256"]
    assert ha == json.loads((b / MARKER).read_text())["weights_sha256"]
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    # a second call with the same inputs reuses the checkpoint (no retraining: file untouched)
    mtime = (a / "model.safetensors").stat().st_mtime_ns
    assert train_tiny_moe(a, seed=3, prompt_files=[p], **SMALL) == a
    assert (a / "model.safetensors").stat().st_mtime_ns == mtime
    log = json.loads((a / "train_log.json").read_text())
    assert len(log["loss"]) == 3 and log["tokens_seen"] == 3 * 4 * 32 and len(log["expert_load_entropy_bits"]) == 2
    split = json.loads((a / "split.json").read_text())
    assert split["training"] and split["heldout"] and not set(split["training"]) & set(split["heldout"])
    assert all(split_of(i) == "training" for i in split["training"])


def test_bad_input_exits_2_and_writes_nothing(tmp_path):
    r = _cli("model", "tiny", "--train", "--steps", "0", "--out", str(tmp_path / "m"))
    assert r.returncode == 2 and "steps" in r.stderr + r.stdout and "Traceback" not in r.stderr
    assert not (tmp_path / "m").exists()
    owned = tmp_path / "mine"
    owned.mkdir()
    (owned / "notes.txt").write_text("keep")
    r = _cli("model", "tiny", "--train", "--steps", "1", "--out", str(owned))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert [f.name for f in owned.iterdir()] == ["notes.txt"] and (owned / "notes.txt").read_text() == "keep"
    empty = tmp_path / "none.jsonl"
    empty.write_text('{"id": "x", "text": "no prompt column"}\n')
    r = _cli("model", "tiny", "--train", "--prompts", str(empty), "--out", str(tmp_path / "m2"))
    assert r.returncode == 2 and "no prompts" in (r.stderr + r.stdout) and "Traceback" not in r.stderr
    assert sorted(f.name for f in tmp_path.iterdir()) == ["mine", "none.jsonl"]  # no temp siblings left


def test_capture_excludes_training_prompts(trained, tmp_path):
    p, a = trained
    training = set(json.loads((a / "split.json").read_text())["training"])
    res = run_capture(a, p, tmp_path / "t", max_new_tokens=2, batch_size=8, chunk_size=64, eval_fraction=0.2,
                      progress=False)
    ids = set(read_trace(res.out).requests["request_id"].to_list())
    assert ids and not ids & training
    all_ids = {json.loads(line)["id"] for line in p.open()}
    assert ids == all_ids - training
    res2 = run_capture(a, p, tmp_path / "t2", max_new_tokens=2, batch_size=8, eval_fraction=0.2, progress=False,
                       exclude_training=False)
    assert set(read_trace(res2.out).requests["request_id"].to_list()) == all_ids
