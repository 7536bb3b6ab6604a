"""eldr's Dynamo decode router without Dynamo: the decision over discovered instances (eldr_cli.dynamo.router)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from _proxy_util import build_routing

from eldr_cli.dynamo.router import DecisionLogRecorder, InstanceRouter, NoDecodeInstance, context_tokens
from eldr_cli.errors import EldrError
from eldr_cli.handoff import SIGNATURE_KEY, encode_counts
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


def test_decisions_are_make_routers_over_sorted_instances_and_the_signature_is_popped(model):
    r = InstanceRouter("eldr-live", model=model)
    r.sync(IDS)
    ref = make_router("eldr-live", 3, model=model)
    loads = [0, 0, 0]
    for i in range(12):
        req = request(f"prompt {i} " * (i + 1))
        ch = r.choose(req, f"r{i}")
        d = ref.decide(fake_counts(f"prompt {i} " * (i + 1)), loads, tokens=12 + 4)
        ref.on_dispatch(d, f"r{i}")
        loads[d.worker] += 1
        assert ch.instance_id == sorted(IDS)[d.worker] and ch.signature == "ok"
        assert SIGNATURE_KEY not in req["prefill_result"]["disaggregated_params"]["kv_transfer_params"]
        assert r.loads == loads
    assert r.stats()["counts"]["signature_ok"] == 12 and r.stats()["in_flight"] == 12


def test_without_a_signature_least_loaded_and_counted(model):
    r = InstanceRouter("eldr-live", model=model)
    r.sync(IDS)
    r.choose(request("a"), "a")
    r.choose(request("b"), "b")
    missing = r.choose(request(None), "m")
    assert r.loads[missing.slot] == 1 and missing.signature == "missing"
    assert missing.loads[missing.slot] == min(missing.loads)
    bad = r.choose(request("x", sig={"v": 1, "shape": [1, 1], "dtype": "u1", "encoding": "zlib+b64",
                                     "data": "!!"}), "bad")
    assert bad.signature == "malformed" and bad.loads[bad.slot] == min(bad.loads)
    wrong_shape = r.choose(request("y", sig=encode_counts(np.ones((2, 3), dtype=int))), "shape")
    assert wrong_shape.signature == "malformed"
    c = r.stats()["counts"]
    assert (c["signature_missing"], c["signature_malformed"], c["signature_ok"]) == (1, 2, 2)


def test_load_balancers_ignore_the_signature(model):
    r = InstanceRouter("round-robin")
    r.sync(IDS)
    got = [r.choose(request("t"), f"q{i}").instance_id for i in range(6)]
    assert got == sorted(IDS) * 2
    assert r.stats()["counts"]["signature_unused"] == 6


def _in_flight(policy) -> int:
    """Requests in eldr-live's live set: this router's own and the other replicas' (counts per prototype)."""
    return len(policy.live.where) + int(policy.live.remote.sum())


def test_finish_releases_load_and_live_set(model):
    r = InstanceRouter("eldr-live", model=model)
    r.sync(IDS)
    chs = [r.choose(request(f"p{i}"), f"r{i}") for i in range(5)]
    live = r.router.policy
    assert _in_flight(live) == 5
    for ch in chs:
        r.finish(ch)
        r.finish(ch)  # twice: no effect
    assert r.loads == [0, 0, 0] and _in_flight(live) == 0 and not r.live


def test_an_instance_that_leaves_or_joins_rebuilds_and_keeps_the_live_sets(model):
    r = InstanceRouter("eldr-live", model=model)
    r.sync(IDS)
    chs = [r.choose(request(f"p{i}"), f"r{i}") for i in range(9)]
    gone = chs[0].instance_id
    assert r.sync([i for i in IDS if i != gone]) and not r.sync([i for i in IDS if i != gone])
    stayed = [c for c in chs if c.instance_id != gone]
    assert r.loads == [sum(c.instance_id == iid for c in stayed) for iid in r.instances]
    assert _in_flight(r.router.policy) == len(stayed)  # the new router holds the requests still in flight
    assert all(c.slot is None for c in chs if c.instance_id == gone)
    assert r.counts["orphaned"] == len(chs) - len(stayed)
    new = r.choose(request("after"), "after")
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
    ch = r.choose(request("retry me"), "r")
    ch2 = r.again(ch, {ch.instance_id})
    assert ch2.instance_id != ch.instance_id and ch2.signature == "ok" and ch2.counts is ch.counts
    assert r.counts["retries"] == 1 and r.counts["requests"] == 1 and sum(r.loads) == 1


def test_no_instance_and_bad_policies_are_one_clear_error(model):
    r = InstanceRouter("jsq")
    with pytest.raises(NoDecodeInstance, match="no decode instance"):
        r.choose(request("x"), "x")
    with pytest.raises(EldrError, match="unknown policy"):
        InstanceRouter("oracle", model=model)
    with pytest.raises(EldrError, match="routing artifact"):
        InstanceRouter("eldr-live")
    r.sync(IDS)
    r.choose(request("x"), "x")
    with pytest.raises(EldrError, match="already in flight"):
        r.choose(request("x"), "x")


def test_context_tokens_and_decision_log_rows(model, tmp_path):
    assert context_tokens({"token_ids": [1] * 10, "stop_conditions": {"max_tokens": 6}}) == 13
    assert context_tokens({"token_ids": [1] * 10}) == 10 and context_tokens({}) is None
    rec = DecisionLogRecorder(str(tmp_path / "d.jsonl"))
    r = InstanceRouter("eldr-live", model=model, recorder=rec)
    r.sync(IDS)
    chs = [r.choose(request(f"p{i}"), f"r{i}") for i in range(3)] + [r.choose(request(None), "none")]
    rec.close()
    rows = [json.loads(x) for x in (tmp_path / "d.jsonl").read_text().splitlines()]
    assert [x["request_id"] for x in rows] == ["r0", "r1", "r2", "none"]
    assert [x["worker"] for x in rows] == [str(c.instance_id) for c in chs]
    assert [x["signature"] for x in rows] == ["ok", "ok", "ok", "missing"]
    assert rows[0]["policy"] == "eldr-live" and len(rows[0]["predicted_ms"]) == 3 and rows[3]["predicted_ms"] is None


def test_other_replicas_loads_and_live_sets_count_and_a_reservation_moves_a_request(model):
    r = InstanceRouter("eldr-live", model=model)
    r.sync(IDS)
    assert [w.url for w in r.all_workers()] == [f"dynamo://{i}" for i in sorted(IDS)]
    ch = r.choose(request("p"), "p")
    vecs = r.local_vectors()["live"]
    assert sum(sum(v) for v in vecs.values()) >= 1  # this replica's live set, published with the counts
    other = InstanceRouter("eldr-live", model=model)  # a second replica receives it
    other.sync(IDS)
    for w in other.slots:
        w.remote_inflight = r.slots[other.slots.index(w)].inflight
        w.remote_vectors = {"live": vecs[w.id]}
    other.remote_vectors_changed()
    assert other.loads == r.loads and _in_flight(other.router.policy) == 1
    dest = (ch.slot + 1) % 3
    r.move(ch, dest)
    assert ch.slot == dest and ch.instance_id == sorted(IDS)[dest] and r.loads[dest] == 1 and sum(r.loads) == 1
    r.finish(ch)
    assert r.loads == [0, 0, 0] and r.router.policy.is_empty()
