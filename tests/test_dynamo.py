"""eldr inside a real Dynamo deployment on this machine (``make test-dynamo``): Dynamo's own frontend (1.6.1),
file discovery, stub prefill and decode workers on Dynamo's runtime, eldr's router (``eldr serve-dynamo``), the
official openai client. Skipped, saying why, without ``.venv-dynamo`` (``make venv-dynamo``)."""

from __future__ import annotations

import asyncio
import time

import pytest
from _proxy_util import build_routing

from eldr_cli.dynamo.router import InstanceRouter
from eldr_cli.routing import RoutingModel
from eldr_cli.testing.dynamo import MODEL, DynamoCluster, dynamo_missing
from eldr_cli.testing.dynamo_workers import prefill_answer

pytestmark = [pytest.mark.slow, pytest.mark.dynamo,
              pytest.mark.skipif(dynamo_missing() is not None, reason=str(dynamo_missing()))]

PROMPTS = ["hello world the a", "you that he was for on are", "with as his they", "be at one have this from or",
           "had by word but what some we can out", "other were all", "there when up use your how said"]


@pytest.fixture(scope="module")
def routing(tmp_path_factory):
    return build_routing(tmp_path_factory.mktemp("routing"), decoders=3)


@pytest.fixture(scope="module")
def cluster(routing, tmp_path_factory):
    from eldr_cli.testing.ports import free_port

    port = free_port()  # the router's /metrics; a shadow policy beside eldr-live in its decision log
    c = DynamoCluster(tmp_path_factory.mktemp("dynamo"), routing=routing, n_decode=3, delay_ms=10,
                      router_args=("--metrics-port", str(port), "--shadow", "jsq"))
    c.metrics_url = f"http://127.0.0.1:{port}/metrics"
    try:
        c.wait_ready()
        yield c
    finally:
        c.close()


def client(c: DynamoCluster):
    import openai

    return openai.OpenAI(base_url=c.url + "/v1", api_key="none", max_retries=0, timeout=60)


def by_request(rows: list[dict]) -> dict[str, dict]:
    return {r["request_id"]: r for r in rows}


def test_streams_reach_the_instance_eldr_live_chose(cluster, routing):
    oa = client(cluster)
    before = len(cluster.decisions())
    for p in PROMPTS:
        chunks = list(oa.completions.create(model=MODEL, prompt=p, max_tokens=5, stream=True))
        text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
        assert len(text.split()) == 5
    rows = cluster.decisions(at_least=before + len(PROMPTS))
    assert len(rows) == before + len(PROMPTS)
    at_worker = by_request(cluster.decode_rows())
    for row in rows[before:]:
        seen = at_worker[row["request_id"]]
        assert row["policy"] == "eldr-live" and row["signature"] == "ok" and row["loads"] == [0, 0, 0]
        assert seen["instance_id"] == row["worker"] and seen["ended"] == "done" and seen["sent"] == 5
        assert "eldr_signature" not in seen["kv_transfer_params"]  # popped before the decode engine
        assert seen["kv_transfer_params"]["remote_engine_id"] == "stub"  # the rest handed on as it came
    # every decision so far replayed offline (each request ended before the next began): the same router over
    # the same instances, fed what the prefill handed off, chooses the instance each request streamed from
    ref = InstanceRouter("eldr-live", model=RoutingModel.load(routing))
    ref.sync([int(i) for i in cluster.stats()[0]["instances"]])
    for row in rows:
        seen = at_worker[row["request_id"]]
        req = {"token_ids": seen["token_ids"], "stop_conditions": {"max_tokens": seen["max_tokens"]},
               "prefill_result": prefill_answer(seen["token_ids"], (4, 16))}
        ch = asyncio.run(ref.choose(req, row["request_id"]))
        assert str(ch.instance_id) == row["worker"] and ch.signature == row["signature"]
        assert row["predicted_ms"] == pytest.approx([round(float(x), 4) for x in ch.record.decision.predicted_ms])
        ref.finish(ch)


def test_metrics_count_decisions_per_instance_and_the_shadow_is_in_the_rows(cluster):
    """`--metrics-port`: the proxy's Prometheus metrics, one decision series per Dynamo instance, agreeing with
    the decision log; `--shadow jsq`: its choice beside eldr-live's in every row."""
    import httpx

    oa = client(cluster)
    for p in PROMPTS[:4]:
        assert len(oa.completions.create(model=MODEL, prompt=p, max_tokens=2).choices[0].text.split()) == 2
    text = httpx.get(cluster.metrics_url, timeout=10).text
    count = 'eldr_proxy_decision_seconds_count{policy="eldr-live"} '
    decided = int(float(next(x for x in text.splitlines() if x.startswith(count)).split()[-1]))
    rows = cluster.decisions(at_least=decided)  # the log's rows reach the file within a second
    for iid in cluster.stats()[0]["instances"]:
        n = sum(r["worker"] == iid for r in rows)
        assert f'eldr_proxy_decisions_total{{policy="eldr-live",worker="{iid}"}} {float(n)}' in text
    assert f'eldr_proxy_decision_seconds_count{{policy="eldr-live"}} {float(len(rows))}' in text
    assert 'eldr_proxy_requests_total{endpoint="generate",outcome="ok"}' in text
    for r in rows:
        sh = r["shadow"]["jsq"]
        assert 0 <= sh["chosen"] < len(r["loads"]) and sh["agree"] == (sh["chosen"] == r["chosen"])
    assert f'eldr_proxy_shadow_decisions_total{{shadow="jsq"}} {float(len(rows))}' in text


def test_chat_streams_through_the_openai_client(cluster):
    oa = client(cluster)
    before = len(cluster.decisions())
    stream = oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello world"}],
                                        max_tokens=4, stream=True)
    deltas = [ch.choices[0].delta.content for ch in stream if ch.choices and ch.choices[0].delta.content]
    assert len("".join(deltas).split()) == 4
    rows = cluster.decisions(at_least=before + 1)[before:]
    assert len(rows) == 1 and rows[0]["signature"] == "ok"
    assert by_request(cluster.decode_rows())[rows[0]["request_id"]]["instance_id"] == rows[0]["worker"]


def test_a_prefill_without_a_signature_goes_to_the_least_loaded_and_is_counted(cluster):
    oa = client(cluster)
    before = len(cluster.decisions())
    counted = cluster.stats()[0]["counts"].get("signature_missing", 0)
    for prompt in ("nosig hello world", "badsig hello world"):
        r = oa.completions.create(model=MODEL, prompt=prompt, max_tokens=3)
        assert len(r.choices[0].text.split()) == 3
    rows = cluster.decisions(at_least=before + 2)[before:]
    assert [r["signature"] for r in rows] == ["missing", "malformed"]
    for r in rows:
        assert r["loads"][r["chosen"]] == min(r["loads"])
        assert r["worker"] == by_request(cluster.decode_rows())[r["request_id"]]["instance_id"]
    counts = cluster.stats()[0]["counts"]
    assert counts["signature_missing"] == counted + 1 and counts["signature_malformed"] >= 1


def test_a_client_that_goes_away_cancels_the_decode(cluster):
    import httpx

    before = len(cluster.decode_rows())
    with httpx.stream("POST", cluster.url + "/v1/completions", timeout=60,
                      json={"model": MODEL, "prompt": "hello cancel", "max_tokens": 400, "stream": True}) as r:
        got = 0
        for line in r.iter_lines():
            got += line.startswith("data: {")
            if got == 3:
                break  # closes the connection mid-stream: 400 tokens at 10 ms would take 4 s
    t0 = time.monotonic()
    while len(cluster.decode_rows()) == before and time.monotonic() - t0 < 20:
        time.sleep(0.2)
    row = cluster.decode_rows()[-1]
    assert row["ended"] == "cancelled" and 3 <= row["sent"] < 400
    t0 = time.monotonic()
    while cluster.stats()[0]["in_flight"] and time.monotonic() - t0 < 20:
        time.sleep(0.5)
    st = cluster.stats()[0]
    assert st["in_flight"] == 0 and st["loads"] == [0, 0, 0]


def test_a_decode_instance_that_leaves_is_no_longer_chosen(cluster):
    oa = client(cluster)
    gone, name = next((r["instance_id"], r["worker"]) for r in cluster.decode_rows())  # one that served above
    assert cluster.stop("decode" + name[1:]) == 0  # SIGTERM: it leaves discovery, then exits
    before = len(cluster.decisions())
    for p in PROMPTS:
        r = oa.completions.create(model=MODEL, prompt=p, max_tokens=2)
        assert len(r.choices[0].text.split()) == 2
    after = cluster.decisions(at_least=before + len(PROMPTS))[before:]
    assert len(after) == len(PROMPTS) and gone not in {r["worker"] for r in after}
    assert all(len(r["loads"]) == 2 for r in after)
    st = cluster.stats()[0]
    assert gone not in st["instances"] and len(st["instances"]) == 2 and st["counts"]["rebuilds"] >= 2


def test_a_decode_instance_that_dies_is_retried_elsewhere(cluster):
    """SIGKILL: the instance stays in discovery until its lease expires; a request sent there fails before its
    first token and is decided once more among the others, on the same signature."""
    import signal

    oa = client(cluster)
    alive = {r["worker"] for r in cluster.decode_rows()} & {f"d{i}" for i in range(3)}
    alive = {w for w in alive if "decode" + w[1:] in cluster.procs}
    victim = sorted(alive)[0]
    victim_id = next(r["instance_id"] for r in cluster.decode_rows() if r["worker"] == victim)
    cluster.stop("decode" + victim[1:], signal.SIGKILL)
    retries = cluster.stats()[0]["counts"].get("retries", 0)
    before = len(cluster.decode_rows())
    for p in PROMPTS:
        r = oa.completions.create(model=MODEL, prompt=p, max_tokens=2)
        assert len(r.choices[0].text.split()) == 2
    served = cluster.decode_rows()[before:]
    assert len(served) == len(PROMPTS) and victim_id not in {r["instance_id"] for r in served}
    st = cluster.stats()[0]
    # chosen while still listed: retried once, then left out (not tried again for every request)
    assert st["counts"].get("retries", 0) - retries <= 1
    assert st["in_flight"] == 0 and sum(st["loads"]) == 0
