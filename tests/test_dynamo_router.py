"""eldr's Dynamo decode router without Dynamo: the decision over discovered instances (eldr_cli.dynamo.router), made
by the proxy's dispatcher (decide, hold, reserve, record, shadows: one object for serve-proxy and serve-dynamo)."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import numpy as np
import pytest
from _proxy_util import build_routing

from eldr_cli.artifacts.schema import load_schema
from eldr_cli.dynamo.router import Flight, InstanceRouter, NoDecodeInstance, proxy_shapes
from eldr_cli.errors import EldrError
from eldr_cli.handoff import SIGNATURE_KEY, encode_counts
from eldr_cli.proxy.decisionlog import ROW_SCHEMA, DecisionLog
from eldr_cli.proxy.request import context_tokens
from eldr_cli.routing import RoutingModel, make_router
from eldr_cli.testing.stub_worker import fake_counts

IDS = [907, 13, 5000]  # discovery order is not slot order: slots follow sorted ids


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return RoutingModel.load(build_routing(tmp_path_factory.mktemp("routing"), decoders=3))


def request(text: str | None, max_tokens: int = 8, sig=None) -> dict:
    kv = {"remote_engine_id": "p0", "remote_block_ids": [1, 2]}
    if text is not None:
        kv[SIGNATURE_KEY] = encode_counts(fake_counts(text)) if sig is None else sig
    return {"token_ids": list(range(12)), "stop_conditions": {"max_tokens": max_tokens},
            "prefill_result": {"disaggregated_params": {"kv_transfer_params": kv}}}


def choose(r: InstanceRouter, req: dict, rid: str) -> Flight:
    return asyncio.run(r.choose(req, rid))


def test_decisions_are_make_routers_over_sorted_instances_and_the_signature_is_popped(model):
    r = InstanceRouter("eldr-live", model=model)
    r.sync(IDS)
    ref = make_router("eldr-live", 3, model=model)
    loads = [0, 0, 0]
    for i in range(12):
        req = request(f"prompt {i} " * (i + 1))
        ch = choose(r, req, f"r{i}")
        d = ref.decide(fake_counts(f"prompt {i} " * (i + 1)), loads, tokens=12 + 4)
        ref.on_dispatch(d, f"r{i}")
        loads[d.worker] += 1
        assert ch.instance_id == sorted(IDS)[d.worker] and ch.signature == "ok"
        assert SIGNATURE_KEY not in req["prefill_result"]["disaggregated_params"]["kv_transfer_params"]
        assert r.loads == loads
    assert r.stats()["counts"]["signature_ok"] == 12 and r.stats()["in_flight"] == 12


def test_without_a_signature_decided_as_serve_proxy_does_and_counted(model):
    r = InstanceRouter("eldr-live", model=model)
    r.sync(IDS)
    ref = make_router("eldr-live", 3, model=model)  # the policy without a signature: eldr-live's mean prototype
    for rid, text in (("a", "a"), ("b", "b")):
        ref.on_dispatch(ref.decide(fake_counts(text), r.loads, tokens=16), rid)
        choose(r, request(text), rid)
    d = ref.decide(None, r.loads, tokens=16)
    missing = choose(r, request(None), "m")
    assert missing.signature == "missing" and missing.slot == d.worker
    bad = choose(r, request("x", sig={"v": 1, "shape": [1, 1], "dtype": "u1", "encoding": "zlib+b64",
                                      "data": "!!"}), "bad")
    assert bad.signature == "malformed"
    wrong_shape = choose(r, request("y", sig=encode_counts(np.ones((2, 3), dtype=int))), "shape")
    assert wrong_shape.signature == "malformed"
    c = r.stats()["counts"]
    assert (c["signature_missing"], c["signature_malformed"], c["signature_ok"]) == (1, 2, 2)
    m = r.metrics.render().decode()  # the proxy's counter, by reason
    assert 'eldr_proxy_signature_missing_total{reason="missing"} 1.0' in m
    assert 'eldr_proxy_signature_missing_total{reason="malformed"} 2.0' in m
    jsq = InstanceRouter("eldr", model=model)  # the band policy: JSQ without a signature
    jsq.sync(IDS)
    choose(jsq, request("a"), "a")
    none = choose(jsq, request(None), "n")
    assert none.record.loads[none.slot] == min(none.record.loads)


def test_load_balancers_ignore_the_signature(model):
    r = InstanceRouter("round-robin")
    r.sync(IDS)
    got = [choose(r, request("t"), f"q{i}").instance_id for i in range(6)]
    assert got == sorted(IDS) * 2
    assert r.stats()["counts"]["signature_unused"] == 6


def _in_flight(policy) -> int:
    """Requests in eldr-live's live set: this router's own and the other replicas' (counts per prototype)."""
    return len(policy.live.where) + int(policy.live.remote.sum())


def test_finish_releases_load_and_live_set(model):
    r = InstanceRouter("eldr-live", model=model)
    r.sync(IDS)
    chs = [choose(r, request(f"p{i}"), f"r{i}") for i in range(5)]
    live = r.router.policy
    assert _in_flight(live) == 5
    for ch in chs:
        r.finish(ch)
        r.finish(ch)  # twice: no effect
    assert r.loads == [0, 0, 0] and _in_flight(live) == 0 and not r.live


def test_an_instance_that_leaves_or_joins_rebuilds_and_keeps_the_live_sets(model):
    r = InstanceRouter("eldr-live", model=model)
    r.sync(IDS)
    chs = [choose(r, request(f"p{i}"), f"r{i}") for i in range(9)]
    gone = chs[0].instance_id
    assert r.sync([i for i in IDS if i != gone]) and not r.sync([i for i in IDS if i != gone])
    stayed = [c for c in chs if c.instance_id != gone]
    assert r.loads == [sum(c.instance_id == iid for c in stayed) for iid in r.instances]
    assert _in_flight(r.router.policy) == len(stayed)  # the new router holds the requests still in flight
    assert all(c.slot is None for c in chs if c.instance_id == gone)
    assert r.counts["orphaned"] == len(chs) - len(stayed)
    new = choose(r, request("after"), "after")
    assert new.instance_id != gone
    for c in chs:
        r.finish(c)
    r.sync([*IDS, 77])
    assert r.instances == sorted([*IDS, 77])
    assert r.loads == [int(iid == new.instance_id) for iid in r.instances]
    r.finish(new)
    assert sum(r.loads) == 0


def test_again_decides_elsewhere_on_the_same_signature(model):
    r = InstanceRouter("eldr-live", model=model)
    r.sync(IDS)
    ch = choose(r, request("retry me"), "r")
    first, counts = ch.instance_id, ch.handoff.counts
    assert r.again(ch, {first}) is ch
    assert ch.instance_id != first and ch.signature == "ok" and ch.handoff.counts is counts
    assert r.counts["retries"] == 1 and r.counts["requests"] == 1 and sum(r.loads) == 1
    assert r.loads[ch.slot] == 1 and _in_flight(r.router.policy) == 1  # the hold moved with it
    with pytest.raises(NoDecodeInstance, match="no other"):
        r.again(ch, {first, ch.instance_id})  # two tried: no third
    r.finish(ch)
    assert sum(r.loads) == 0 and r.router.policy.is_empty()


def test_no_instance_and_bad_policies_are_one_clear_error(model):
    r = InstanceRouter("jsq")
    with pytest.raises(NoDecodeInstance, match="no decode instance"):
        choose(r, request("x"), "x")
    with pytest.raises(EldrError, match="unknown policy"):
        InstanceRouter("oracle", model=model)
    with pytest.raises(EldrError, match="routing artifact"):
        InstanceRouter("eldr-live")
    r.sync(IDS)
    choose(r, request("x"), "x")
    with pytest.raises(EldrError, match="already in flight"):
        choose(r, request("x"), "x")


def test_context_tokens_and_decision_log_rows(model, tmp_path):
    def tokens(req: dict) -> int | None:
        return context_tokens(*proxy_shapes(req))

    assert tokens({"token_ids": [1] * 10, "stop_conditions": {"max_tokens": 6}}) == 13
    assert tokens({"token_ids": [1] * 10}) == 10 and tokens({}) is None
    log = DecisionLog(str(tmp_path / "d.jsonl"))
    r = InstanceRouter("eldr-live", model=model, log=log)
    r.sync(IDS)
    chs = [choose(r, request(f"p{i}"), f"r{i}") for i in range(3)] + [choose(r, request(None), "none")]
    log.close()
    rows = [json.loads(x) for x in (tmp_path / "d.jsonl").read_text().splitlines()]
    assert rows == [json.loads(json.dumps(c.record.row())) for c in chs]  # the dispatcher's DecisionRecord rows
    assert [x["request_id"] for x in rows] == ["r0", "r1", "r2", "none"]
    assert [x["worker"] for x in rows] == [str(c.instance_id) for c in chs]
    assert [x["signature"] for x in rows] == ["ok", "ok", "ok", "missing"]
    assert rows[0]["policy"] == "eldr-live" and len(rows[0]["predicted_ms"]) == 3
    assert rows[0]["tau"] == pytest.approx(model.tau)


def test_other_replicas_loads_and_live_sets_count(model):
    r = InstanceRouter("eldr-live", model=model)
    r.sync(IDS)
    assert [w.url for w in r.all_workers()] == [f"dynamo://{i}" for i in sorted(IDS)]
    ch = choose(r, request("p"), "p")
    vecs = r.local_vectors()["live"]
    assert sum(sum(v) for v in vecs.values()) >= 1  # this replica's live set, published with the counts
    other = InstanceRouter("eldr-live", model=model)  # a second replica receives it
    other.sync(IDS)
    for w in other.slots:
        w.remote_inflight = r.slots[other.slots.index(w)].inflight
        w.remote_vectors = {"live": vecs[w.id]}
    other.remote_vectors_changed()
    assert other.loads == r.loads and _in_flight(other.router.policy) == 1
    r.finish(ch)
    assert r.loads == [0, 0, 0] and r.router.policy.is_empty()


class _Reserver:
    """The replicas' reservation answering "the next candidate" (Redis's own is tests/test_dynamo_replicas.py)."""

    def __init__(self):
        self.results = {"ok": 0, "skipped": 0}
        self.released: list = []

    async def choose(self, keys, slack, costs):
        self.results["ok"] += 1
        self.keys = list(keys)
        return (1 if len(keys) > 1 else 0), None

    def release(self, slot):
        self.released.append(slot.key)


def test_a_reservation_that_moves_a_request_moves_its_hold_and_gives_its_slot_back(model):
    from eldr_cli.proxy.replicas.shared import LocalState

    shared = LocalState()
    shared.reserver = rv = _Reserver()  # type: ignore[assignment]
    r = InstanceRouter("jsq", shared=shared)
    r.sync(IDS)
    ch = choose(r, request("p"), "p")
    assert rv.results["ok"] == 1 and ch.ctx.reserved is not None
    assert f"decode|dynamo://{ch.instance_id}" == rv.keys[1] == ch.ctx.reserved.key  # moved to the 2nd candidate
    assert r.loads[ch.slot] == 1 and sum(r.loads) == 1 and ch.record.worker == str(ch.instance_id)
    key = ch.ctx.reserved.key
    r.finish(ch)
    assert rv.released == [key] and sum(r.loads) == 0 and ch.ctx.reserved is None


def _metric(text: str, name: str, **labels: str) -> float:
    """One sample of a Prometheus text exposition (0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))  # the exposition sorts them
    for line in text.splitlines():
        if line.startswith(f"{name}{{{want}}} ") or (not labels and line.startswith(f"{name} ")):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_metrics_are_served_and_count_decisions_per_instance(model):
    import httpx

    from eldr_cli.dynamo.metrics_http import bind_metrics, serve_metrics

    async def run() -> tuple[str, list[Flight], int]:
        r = InstanceRouter("eldr-live", model=model)
        r.sync(IDS)
        sock = bind_metrics("127.0.0.1", 0)
        port = sock.getsockname()[1]
        server = await serve_metrics(r.metrics.render, sock)
        try:
            chs = [await r.choose(request(f"prompt {i} " * (i + 1)), f"r{i}") for i in range(9)]
            r.finish(chs[0])
            async with httpx.AsyncClient() as c:
                resp = await c.get(f"http://127.0.0.1:{port}/metrics")
                missing = (await c.get(f"http://127.0.0.1:{port}/other")).status_code
            assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
            return resp.text, chs, missing
        finally:
            server.close()

    text, chs, missing = asyncio.run(run())
    assert missing == 404
    for iid in IDS:  # the proxy's decisions counter, one series per Dynamo instance
        n = sum(c.record.worker == str(iid) for c in chs)
        assert _metric(text, "eldr_proxy_decisions_total", policy="eldr-live", worker=str(iid)) == n
        inflight = sum(c.record.worker == str(iid) for c in chs[1:])
        assert _metric(text, "eldr_proxy_inflight", role="decode", worker=str(iid), url=f"dynamo://{iid}") == inflight
    assert _metric(text, "eldr_proxy_decision_seconds_count", policy="eldr-live") == 9
    assert _metric(text, "eldr_proxy_requests_in_progress") == 8
    assert _metric(text, "eldr_proxy_policy_info", policy="eldr-live", tau=f"{model.tau:g}") == 1


def test_a_metrics_port_in_use_is_one_clear_error():
    from eldr_cli.dynamo.metrics_http import bind_metrics

    sock = bind_metrics("127.0.0.1", 0)
    try:
        with pytest.raises(EldrError, match=r"--metrics-port \d+: cannot listen on 127.0.0.1"):
            bind_metrics("127.0.0.1", sock.getsockname()[1])
    finally:
        sock.close()


def test_a_shadow_policys_choices_are_in_the_decision_log_rows(model, tmp_path):
    log = DecisionLog(str(tmp_path / "d.jsonl"))
    r = InstanceRouter("jsq", model=model, log=log, shadows=["eldr-live"])

    async def run() -> list[Flight]:
        r.sync(IDS)
        chs = []
        for i in range(8):
            chs.append(await r.choose(request(f"prompt {i} " * (i + 1)), f"r{i}"))
            await asyncio.sleep(0)  # the shadows decide right after the dispatch (call_soon), as in the proxy
        for c in chs:
            r.finish(c)
        await asyncio.sleep(0)
        return chs

    chs = asyncio.run(run())
    log.close()
    rows = [json.loads(x) for x in (tmp_path / "d.jsonl").read_text().splitlines()]
    assert [x["request_id"] for x in rows] == [c.rid for c in chs] and all(x["policy"] == "jsq" for x in rows)
    schema = jsonschema.Draft202012Validator(load_schema(ROW_SCHEMA))  # what `eldr report --decision-log` reads
    for row in rows:
        schema.validate(row)
    # the shadow decided each request on its own counterfactual state: the same router fed the same requests
    ref = make_router("eldr-live", 3, model=model)
    loads = [0, 0, 0]
    for i, (row, c) in enumerate(zip(rows, chs, strict=True)):
        d = ref.decide(fake_counts(f"prompt {i} " * (i + 1)), loads, tokens=16)
        ref.on_dispatch(d, c.rid)
        loads[d.worker] += 1
        sh = row["shadow"]["eldr-live"]
        assert sh["chosen"] == d.worker and sh["agree"] == (d.worker == row["chosen"])
        assert sh["predicted_ms"] == [round(float(x), 4) for x in d.predicted_ms]
    assert row["signature"] == "ok"  # a load balancer live, a shadow that needs the signature: it is decoded
    st = r.stats()["shadow"]
    assert st["policies"] == ["eldr-live"] and 0 <= st["agreement"]["eldr-live"] <= 1
    text = r.metrics.render().decode()
    assert _metric(text, "eldr_proxy_shadow_decisions_total", shadow="eldr-live") == 8
    assert all(_metric(text, "eldr_proxy_shadow_inflight", shadow="eldr-live", worker=str(i)) == 0 for i in IDS)
