"""Prompt input: formats, chat messages, selection and the disjoint calibration/evaluation split."""

from __future__ import annotations

import json

import polars as pl
import pytest

from eldr_cli.capture.prompts import load_prompts
from eldr_cli.data import prompts_file
from eldr_cli.errors import EldrError

TASK = str(prompts_file("task"))


def _rows(n=40):
    return [{"id": f"r{i}", "prompt": f"prompt number {i}", "domain": "ab"[i % 2], "language": "en"}
            for i in range(n)]


def test_jsonl_csv_parquet_read_the_same(tmp_path):
    rows = _rows()
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pl.DataFrame(rows).write_csv(tmp_path / "p.csv")
    pl.DataFrame(rows).write_parquet(tmp_path / "p.parquet")
    got = [load_prompts(tmp_path / f"p.{ext}", eval_fraction=0.25, seed=3) for ext in ("jsonl", "csv", "parquet")]
    key = [[(p.request_id, p.text, p.domain, p.language, p.split) for p in g] for g in got]
    assert key[0] == key[1] == key[2]
    assert [p.text for p in got[0]] == [r["prompt"] for r in rows]


def test_split_is_disjoint_stratified_and_seeded():
    rows = load_prompts(TASK, sample=400, seed=1, eval_fraction=0.25)
    ev = [r for r in rows if r.split == "evaluation"]
    cal = [r for r in rows if r.split == "calibration"]
    assert len(ev) + len(cal) == 400 and not ({r.request_id for r in ev} & {r.request_id for r in cal})
    for d in {r.domain for r in rows}:
        n = sum(r.domain == d for r in rows)
        assert abs(sum(r.domain == d for r in ev) - 0.25 * n) <= 1
    again = load_prompts(TASK, sample=400, seed=1, eval_fraction=0.25)
    assert [(r.request_id, r.split) for r in again] == [(r.request_id, r.split) for r in rows]
    other = load_prompts(TASK, sample=400, seed=2, eval_fraction=0.25)
    assert [r.request_id for r in other] != [r.request_id for r in rows]


def test_limit_then_sample(tmp_path):
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows(100)))
    rows = load_prompts(tmp_path / "p.jsonl", limit=30, sample=10, seed=0)
    ids = [int(r.request_id[1:]) for r in rows]
    assert len(ids) == 10 and max(ids) < 30 and ids == sorted(ids)


def test_messages_use_the_chat_template(tmp_path, tiny_moe_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_moe_dir)
    (tmp_path / "c.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hello"}]}) + "\n")
    [row] = load_prompts(tmp_path / "c.jsonl", tokenizer=tok)
    assert row.text == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    assert row.request_id == "c/0" and row.domain == "unknown"


@pytest.mark.parametrize("content,match", [
    (None, "does not exist"),
    ("", "is empty"),
    ('{"prompt": "ok"}\n{"prompt": \n', r"p.jsonl:2: not valid JSON"),
    ('{"text": "no prompt column"}\n', "no 'prompt' or 'messages' column"),
    ('["a list"]\n', "expected a JSON object"),
    ('{"id": 1, "prompt": "a"}\n{"id": 1, "prompt": "b"}\n', "duplicate request id"),
    ('{"prompt": 5}\n', "must be a string"),
])
def test_bad_prompt_files(tmp_path, content, match):
    f = tmp_path / "p.jsonl"
    if content is not None:
        f.write_text(content)
    with pytest.raises(EldrError, match=match):
        load_prompts(f)
