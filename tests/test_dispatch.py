"""The hand-off as one object (issue 36): a Dispatcher built from explicit parts, without a proxy app around it,
decides, holds, records and releases; its DecisionRecord's row is the decision log's row and matches the row's
versioned schema, which `eldr report --decision-log` checks on reading."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest

from eldr_cli.artifacts.schema import load_schema
from eldr_cli.errors import EldrError
from eldr_cli.handoff import SIGNATURE_KEY, encode_counts
from eldr_cli.proxy.base import ProxyState
from eldr_cli.proxy.config import ProxyConfig
from eldr_cli.proxy.decisionlog import ROW_SCHEMA, DecisionLog
from eldr_cli.proxy.dispatch import DecisionRecord, Dispatcher, Recorder
from eldr_cli.proxy.metrics import ProxyMetrics
from eldr_cli.proxy.replicas.shared import LocalState
from eldr_cli.proxy.request import RequestContext
from eldr_cli.proxy.workers import WorkerPool
from eldr_cli.routing import make_router

DECODE = ["http://127.0.0.1:9001", "http://127.0.0.1:9002", "http://127.0.0.1:9003"]


def _metrics() -> ProxyMetrics:
    cfg = ProxyConfig(prefill=["http://127.0.0.1:9000"], decode=DECODE, policy="jsq").validate()
    return ProxyMetrics(ProxyState(cfg))


def _parts(tmp_path, policy="jsq"):
    pool = WorkerPool("decode", DECODE)
    log = DecisionLog(str(tmp_path / "d.jsonl"))
    disp = Dispatcher(make_router(policy, len(pool)), pool, LocalState(), Recorder(_metrics(), log), tau=0.5)
    return disp, pool, log


def test_a_dispatcher_from_its_parts_decides_holds_records_and_releases(tmp_path):
    disp, pool, log = _parts(tmp_path)
    pool.workers[0].inflight = 2  # JSQ: the least loaded of (2, 0, 0) is worker 1
    ctx = RequestContext(rid="r1", endpoint="completions", domain="law")
    h = disp.handoff(ctx.t0, {"usage": {"prompt_tokens": 10}}, {"max_tokens": 4}, {"other": 1})
    assert (h.signature, h.tokens, h.counts) == ("missing", 12, None)
    rec = asyncio.run(disp.dispatch(ctx, h))
    assert isinstance(rec, DecisionRecord)
    assert (rec.decision.worker, rec.worker, rec.first, rec.loads) == (1, pool.workers[1].id, pool.workers[1].id,
                                                                       (2, 0, 0))
    assert ctx.held is pool.workers[1] and pool.loads() == [2, 1, 0] and ctx.policy == "jsq"
    with pytest.raises(AttributeError):  # frozen
        rec.worker = "x"  # type: ignore[misc]
    # a connect failure on worker 1: the same router decides again among the others, and the hold moves
    again = disp.retry(ctx, h, {pool.workers[1].id})
    assert again is not None and again.worker == 2 and pool.loads() == [2, 0, 1]
    assert disp.retry(ctx, h, {pool.workers[1].id, pool.workers[2].id}) is None  # two tried: no third
    disp.release(ctx)
    disp.release(ctx)  # once only
    assert pool.loads() == [2, 0, 0] and ctx.held is None
    log.close()
    rows = [json.loads(x) for x in (tmp_path / "d.jsonl").read_text().splitlines()]
    assert rows == [json.loads(json.dumps(rec.row()))]
    assert rows[0]["tau"] == 0.5 and rows[0]["domain"] == "law" and rows[0]["signature"] == "missing"


def test_the_row_matches_its_schema_with_and_without_replay_fields(tmp_path):
    import numpy as np

    disp, pool, log = _parts(tmp_path)
    v = jsonschema.Draft202012Validator(load_schema(ROW_SCHEMA))
    counts = np.arange(8, dtype=np.int64).reshape(2, 4)
    for replay in (False, True):
        log.replay = replay
        ctx = RequestContext(rid=f"r{replay}", endpoint="chat")
        h = disp.handoff(ctx.t0, {"usage": {"prompt_tokens": 3}}, {}, {SIGNATURE_KEY: encode_counts(counts)})
        row = asyncio.run(disp.dispatch(ctx, h)).row()
        disp.release(ctx)
        assert ("log_v" in row) is replay and ("sig" in row) is replay
        v.validate(json.loads(json.dumps(row)))
        with pytest.raises(jsonschema.ValidationError):
            v.validate({**json.loads(json.dumps(row)), "chosen": "d0"})
    log.close()


def test_a_row_that_does_not_match_the_schema_is_refused_naming_its_line_and_field(tmp_path):
    from eldr_cli.pipeline.decision_replay import read_rows

    disp, _, log = _parts(tmp_path)
    for i in range(3):
        ctx = RequestContext(rid=f"r{i}", endpoint="chat")
        asyncio.run(disp.dispatch(ctx, disp.handoff(ctx.t0, {}, {}, None)))
        disp.release(ctx)
    log.close()
    path = tmp_path / "d.jsonl"
    assert len(read_rows(path)) == 3
    lines = path.read_text().splitlines()
    bad = json.loads(lines[1])
    bad["loads"] = [0, -1, 0]
    path.write_text("\n".join([lines[0], json.dumps(bad), lines[2]]) + "\n")
    with pytest.raises(EldrError, match=r"line 2 does not match decision-log\.v2\.schema\.json at loads/1"):
        read_rows(path)



def test_a_signatures_inflate_gives_zlibs_bytes_and_refusals_and_the_wire_width_on_request():
    """The hand-off's inflate (ISA-L where installed) gives zlib's bytes for every stream zlib takes (every level,
    trailing bytes, two streams back to back) and refuses what zlib refuses (truncated, bit-flipped, another
    format), with zlib's message; ``widen=False`` keeps the wire's width (the proxy's request path), the same
    values."""
    import gzip
    import zlib

    import numpy as np

    from eldr_cli.handoff import SignatureDecodeError, _inflate, decode_counts

    rng = np.random.default_rng(1)
    cases = []
    for level in range(10):
        z = zlib.compress((rng.poisson(0.3, (48, 128)) * rng.integers(0, 3, (48, 128))).astype(np.uint8).tobytes(),
                          level)
        cases += [z, z + b"junk", z + z, z[:-1], z[2:], gzip.compress(b"abc"), zlib.compress(b""), b"", b"xx"]
        for _ in range(40):
            bad = bytearray(z)
            bad[int(rng.integers(0, len(bad)))] ^= 1 << int(rng.integers(0, 8))
            cases.append(bytes(bad))
    for data in cases:
        try:
            want: bytes | str = zlib.decompress(data)
        except zlib.error as e:
            want = str(e)
        try:
            have: bytes | str = _inflate(data)
        except zlib.error as e:
            have = str(e)
        assert have == want
    counts = rng.integers(0, 70_000, size=(6, 10))
    for top, dtype in ((255, np.uint8), (65_535, np.uint16), (70_000, np.uint32)):
        c = np.minimum(counts, top)
        narrow = decode_counts(encode_counts(c), widen=False)
        assert narrow.dtype == dtype and narrow.dtype.isnative and narrow.tolist() == c.tolist()
        assert not narrow.flags.writeable  # a view of the inflated bytes (the compiled loops read it as it is)
    with pytest.raises(SignatureDecodeError, match="incorrect header check"):
        decode_counts({**encode_counts(counts), "data": "QUJD"})


def test_a_signature_decodes_to_its_counts_and_refuses_what_the_standard_library_refuses():
    """The hand-off's base64 (pybase64 where installed) gives the counts back and takes exactly the data fields the
    standard library's ``b64decode(validate=True)`` takes: excess padding (which pybase64 alone refuses) decodes as
    before; whitespace, the URL-safe alphabet, missing or leading padding are refused by both."""
    import base64

    import numpy as np

    from eldr_cli.handoff import SignatureDecodeError, _b64decode, decode_counts

    counts = np.random.default_rng(0).integers(0, 300, size=(6, 10))
    enc = encode_counts(counts)
    got = decode_counts(enc)
    assert got.dtype == np.int64 and got.tolist() == counts.tolist()
    with pytest.raises(SignatureDecodeError):
        decode_counts({**enc, "data": " " + enc["data"]})
    for data in ("QUJD", "QQ==", "QUJD====", "QQ", "QQ=", "=QUJD", "QU JD", "QUJD\n", "QUJ-", "QUJ_", "é"):
        try:
            want: bytes | None = base64.b64decode(data, validate=True)
        except ValueError:
            want = None
        try:
            have: bytes | None = _b64decode(data)
        except ValueError:
            have = None
        assert have == want, data


def test_small_counts_travel_in_zlibs_stored_blocks_and_large_ones_deflated():
    """The encoder stores counts of up to STORED_MAX bytes uncompressed inside the zlib stream (a copy and a checksum
    to inflate on the proxy's request path) and deflates larger ones; both are the one wire format (any zlib reader,
    the standard library's included, takes them) and decode to the same counts."""
    import base64
    import zlib

    import numpy as np

    from eldr_cli.handoff import STORED_MAX, decode_counts

    rng = np.random.default_rng(1)
    small = rng.poisson(0.3, (48, 128)).astype(np.int64)  # u1: 6,144 bytes
    large = rng.poisson(0.3, (64, 512)).astype(np.int64)  # u1: 32,768 bytes
    for counts, stored in ((small, True), (large, False)):
        assert (counts.size <= STORED_MAX) == stored
        enc = encode_counts(counts)
        z = base64.b64decode(enc["data"])
        raw = zlib.decompress(z)
        assert raw == counts.astype(np.uint8).tobytes()
        # a stored stream holds its bytes verbatim (2-byte header, 5-byte block header, 4-byte Adler-32); level 1
        # shrinks these sparse counts well below their size
        assert (len(z) == len(raw) + 11 and raw in z) if stored else len(z) < len(raw) // 2
        assert decode_counts(enc).tolist() == counts.tolist()
