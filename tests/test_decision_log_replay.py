"""The decision log's replay fields (--decision-log-replay) through a real proxy in front of stub PD workers,
and the log never failing a request (a full disk: counted drops, one log line)."""

from __future__ import annotations

import json
import logging
import time

import httpx
import pytest
from _proxy_util import Cluster, build_routing

from eldr_cli.artifacts.store import read_manifest
from eldr_cli.handoff import decode_counts
from eldr_cli.proxy import build_config
from eldr_cli.proxy.decisionlog import REPLAY_FIELDS, DecisionLog
from eldr_cli.testing.stub_worker import fake_counts

PROMPTS = [f"request {i}: explain topic number {i * 7} in a few words" for i in range(8)]


@pytest.fixture(scope="module")
def routing3(tmp_path_factory):
    return build_routing(tmp_path_factory.mktemp("routing3"), decoders=3)


def test_replay_fields_rebuild_each_request(routing3, tmp_path):
    c = Cluster(routing=str(routing3), policy="jsq", decision_log=str(tmp_path / "d.jsonl"),
                decision_log_replay=True)
    try:
        t_start = time.time()
        for i, p in enumerate(PROMPTS):
            r = httpx.post(c.url + "/v1/completions", json={"model": "m", "prompt": p, "max_tokens": 3 + i})
            assert r.status_code == 200, r.text
        t_end = time.time()
        c.app.decision_log.flush()
        rows = [json.loads(x) for x in open(c.cfg.decision_log)]
        assert c.metric("eldr_proxy_decision_log_rows_total") == len(PROMPTS)
        assert c.metric("eldr_proxy_decision_log_dropped_total") == 0
    finally:
        c.close()
    want_id = read_manifest(routing3 / "routing")["content_hash"][:16]
    assert len(rows) == len(PROMPTS)
    arrivals = [row["arrival_s"] for row in rows]
    assert arrivals == sorted(arrivals) and t_start <= arrivals[0] and arrivals[-1] <= t_end
    for i, (row, p) in enumerate(zip(rows, PROMPTS, strict=True)):
        assert set(REPLAY_FIELDS) <= set(row)
        assert row["arrival_s"] <= row["ts"]
        assert row["prompt_tokens"] == len(p.split()) and row["max_tokens"] == 3 + i
        sig = {"v": 1, "encoding": "zlib+b64", **row["sig"]}
        assert (decode_counts(sig) == fake_counts(p)).all()  # the prefill counts exactly as handed off
        assert row["routing_id"] == want_id


def test_rows_without_the_option_carry_no_replay_fields(routing3, tmp_path):
    c = Cluster(routing=str(routing3), policy="jsq", decision_log=str(tmp_path / "d.jsonl"))
    try:
        assert httpx.post(c.url + "/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 2}).status_code == 200
        c.app.decision_log.flush()
        row = json.loads(open(c.cfg.decision_log).readline())
    finally:
        c.close()
    assert not set(REPLAY_FIELDS) & set(row)


def test_full_disk_drops_rows_and_serves(routing3, tmp_path, caplog):
    c = Cluster(routing=str(routing3), policy="jsq", decision_log=str(tmp_path / "d.jsonl"),
                decision_log_replay=True)
    try:
        dlog = c.app.decision_log
        dlog.flush()
        dlog._fh = open("/dev/full", "wb", buffering=0)  # fault injection: every write fails with ENOSPC
        with caplog.at_level(logging.WARNING, logger="eldr.proxy"):
            for p in PROMPTS:
                assert httpx.post(c.url + "/v1/completions", json={"prompt": p, "max_tokens": 2}).status_code == 200
            dlog.flush()
        assert c.metric("eldr_proxy_decision_log_dropped_total") == len(PROMPTS)
        assert c.metric("eldr_proxy_requests_total", outcome="ok") == len(PROMPTS)
    finally:
        c.close()
    lines = [r for r in caplog.records if "decision log" in r.getMessage()]
    assert len(lines) == 1 and "No space left" in lines[0].getMessage()


def test_full_queue_drops_without_blocking(tmp_path):
    log = DecisionLog(str(tmp_path / "d.jsonl"), queue_rows=1)
    log._worker.close(5)  # the writer stops, so nothing drains the queue
    log.write({"request_id": "fills the one slot"})
    for i in range(5):
        log.write({"request_id": i})
    assert log.dropped == 5
    log.close()


def test_replay_option_needs_a_log():
    from eldr_cli.errors import EldrError

    with pytest.raises(EldrError, match="--decision-log-replay"):
        build_config(None, prefill=["http://a:1"], decode=["http://b:1"], policy="jsq", decision_log_replay=True)
