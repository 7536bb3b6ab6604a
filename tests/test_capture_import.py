"""`eldr capture --from-trace`: the Orders-in-Chaos layout, streamed into a trace artifact."""

from __future__ import annotations

import json

import numpy as np
import pytest

from eldr_cli.artifacts.trace import read_trace
from eldr_cli.capture import import_file
from eldr_cli.capture import import_trace as importer
from eldr_cli.capture.oic_fixtures import write_oic_tree
from eldr_cli.capture.staging import staging_dir
from eldr_cli.errors import EldrError
from eldr_cli.main import run as eldr


def _expected(files, E):
    """Counts straight from the JSON documents, the slow obvious way."""
    by_id = {}
    for f in files:
        moe = f["moe_layers"]
        pre = np.zeros((len(moe), E), int)
        for li, l in enumerate(moe):
            for tok in f["prefill"][str(l)]:
                for e in tok:
                    pre[li, e] += 1
        dec = np.zeros((len(moe), E), int)
        for st in f["steps"]:
            for li, l in enumerate(moe):
                for e in st[str(l)][0]:
                    dec[li, e] += 1
        by_id[f["path"]] = (pre, dec, len(f["prefill"][str(moe[0])]), len(f["steps"]))
    return by_id


def test_import_counts_domains_and_null_layers(tmp_path):
    files = write_oic_tree(tmp_path / "src", n_per_subject=4, num_layers=8, num_experts=16, top_k=2)
    root = tmp_path / "src" / "acme" / "Tiny-MoE"
    code = eldr(["capture", "--from-trace", str(root), "--out", str(tmp_path / "t"), "--no-progress"])
    assert code == 0
    t = read_trace(tmp_path / "t")
    assert t.model["moe_layer_ids"] == [1, 3, 5, 7]  # dense (null) layers dropped
    assert t.prefill_counts.shape == (12, 4, 16) and t.model["top_k"] == 2
    exp = _expected(files, 16)
    for r, rid in enumerate(t.column("request_id")):
        pre, dec, T, N = exp[root / f"{rid}.json"]
        np.testing.assert_array_equal(t.prefill_counts[r], pre)
        np.testing.assert_array_equal(t.decode_counts[r], dec)
        assert t.prompt_tokens[r] == T and t.decode_steps[r] == N
    assert set(t.column("domain")) == {"law", "medicine", "main"}
    assert set(t.column("source")) == {"mmlu", "gsm8k"}
    assert t.column("request_id")[0].count("/") == 2  # <benchmark>/<subject>/<n>
    assert t.manifest["params"]["num_experts_inferred"] is True
    assert eldr(["fit", "--trace", str(tmp_path / "t"), "--decoders", "3", "--out", str(tmp_path / "fit"),
                 "--pairs", "300", "--split", "all"]) == 0


def test_fast_parser_equals_json_parser(tmp_path, monkeypatch):
    files = write_oic_tree(tmp_path, n_per_subject=3, num_layers=6, num_experts=40, top_k=3, seed=5)
    # a file with keys out of order and extra whitespace: still the same content
    f0 = files[0]["path"]
    doc = json.loads(f0.read_text())
    shuffled = [dict(reversed(list(el.items()))) for el in doc]
    (f0.parent / "99.json").write_text(json.dumps(shuffled, indent=1))
    for f in list(f0.parent.glob("*.json")):
        fast = importer.parse_trace_file(str(f))
        with monkeypatch.context() as m:
            m.setattr(import_file, "_fast_parse", lambda raw: None)
            slow = importer.parse_trace_file(str(f))
        assert fast[0] == slow[0] and fast[3:] == slow[3:]
        np.testing.assert_array_equal(fast[1], slow[1])
        np.testing.assert_array_equal(fast[2], slow[2])
    assert import_file._fast_parse(b'[{"1": [[1.5, 2]]}]') is None  # floats -> the JSON path decides


def test_bad_files_are_skipped_and_counted(tmp_path, capsys):
    write_oic_tree(tmp_path / "src", n_per_subject=2)
    root = tmp_path / "src" / "acme" / "Tiny-MoE"
    (root / "mmlu" / "law" / "7.json").write_text("[{")
    (root / "mmlu" / "law" / "8.json").write_text('[{"1": [[1, 2], [3]]}]')
    assert eldr(["capture", "--from-trace", str(root), "--out", str(tmp_path / "t"), "--no-progress"]) == 0
    t = read_trace(tmp_path / "t")
    assert t.n_requests == 6 and t.manifest["metrics"]["n_skipped_files"] == 2
    assert "skipping" in capsys.readouterr().err


def test_import_errors(tmp_path, capsys):
    write_oic_tree(tmp_path / "two", model="A")
    write_oic_tree(tmp_path / "two", model="B")
    (tmp_path / "empty").mkdir()
    for src, msg in ((tmp_path / "two", "several models"), (tmp_path / "empty", "no *.json"),
                     (tmp_path / "nope", "not a directory")):
        assert eldr(["capture", "--from-trace", str(src), "--out", str(tmp_path / "out"), "--no-progress"]) == 2
        assert msg in " ".join(capsys.readouterr().err.split())
        assert not (tmp_path / "out").exists() and not staging_dir(tmp_path / "out").exists()
    with pytest.raises(EldrError, match="smaller than"):
        importer.import_trace(tmp_path / "two" / "acme" / "A", tmp_path / "o2", num_experts=4, progress=False)


def _both(path, monkeypatch):
    fast = import_file._fast_parse(path.read_bytes())
    with monkeypatch.context() as m:
        m.setattr(import_file, "_fast_parse", lambda raw: None)
        try:
            slow = importer.parse_trace_file(str(path))
        except importer.BadTraceFile:
            slow = None
    return fast, slow


def _assert_same(fast, slow):
    assert fast is not None and slow is not None
    assert fast[0] == slow[0] and fast[3:] == slow[3:]
    np.testing.assert_array_equal(fast[1], slow[1])
    np.testing.assert_array_equal(fast[2], slow[2])
    assert fast[1].dtype == slow[1].dtype and fast[2].dtype == slow[2].dtype


@pytest.mark.parametrize("top_k,num_experts", [(1, 128), (8, 128), (4, 1000), (2, 7)])
def test_fast_parser_every_shape_and_layout(tmp_path, monkeypatch, top_k, num_experts):
    """top-1 and top-8 shapes, 3- and 1-digit ids, and the same documents written compact, indented,
    with tabs/CRLF and reversed key order: the fast path takes each and agrees with the JSON parse."""
    files = write_oic_tree(tmp_path, n_per_subject=1, num_layers=10, num_experts=num_experts, top_k=top_k,
                           prompt_tokens=(3, 9), decode_steps=5, seed=top_k)
    for i, f in enumerate(files):
        doc = json.loads(f["path"].read_text())
        variants = {
            "default": json.dumps(doc),
            "compact": json.dumps(doc, separators=(",", ":")),
            "indent": json.dumps(doc, indent=2),
            "tabs-crlf": json.dumps(doc, indent="\t").replace("\n", "\r\n") + "\r\n",
            "reversed-keys": json.dumps([dict(reversed(list(el.items()))) for el in doc], separators=(", ", " : ")),
        }
        for name, text in variants.items():
            p = tmp_path / f"{i}-{name}.json"
            p.write_text(text)
            fast, slow = _both(p, monkeypatch)
            _assert_same(fast, slow)


def test_fast_parser_declines_what_it_cannot_prove(tmp_path, monkeypatch):
    """Malformed or unusual files: the fast path returns None (the JSON path decides) or, where the
    file is valid after all, the same result; it never accepts what the JSON parse rejects."""
    good = '[{"0": null, "1": [[1, 2], [3, 4]], "3": [[5, 6], [7, 0]]}, {"0": null, "1": [[2, 1]], "3": [[9, 8]]}]'
    extra_null_key = good.replace('{"0": null, "1": [[2, 1]]', '{"7": null, "1": [[2, 1]]')
    no_decode_step = good.replace(', {"0": null, "1": [[2, 1]], "3": [[9, 8]]}', "")
    cases = [
        good,
        good.replace("[[1, 2], [3, 4]]", "[1, 2, 3, 4]"),            # token lists flattened
        good.replace("[[1, 2], [3, 4]]", "[[1, 2, 3], [4]]"),        # ragged token lists
        good.replace("[[1, 2], [3, 4]]", "[[1], [2, 3, 4]]"),
        good.replace("[[9, 8]]", "[[9, 8, 7]]"),                    # decode k differs
        good.replace('"3": [[9, 8]]', '"5": [[9, 8]]'),              # decode layer not in prefill
        good.replace("null", "nlul"),
        good.replace("[[5, 6]", "[[05, 6]"),                        # leading zero: not JSON
        good.replace("[[5, 6]", "[[5000, 6]"),                      # long ids: JSON path
        good.replace("[[5, 6]", "[[5.0, 6]"),
        good.replace('"1":', '"1" :').replace('"3":', '"3"\n:'),
        good[:-1],                                                # truncated
        good.replace("{", "[", 1),
        good.replace("]]}", "]]]}", 1),
        good.replace('"0": null, "1"', '"1": [[1, 1], [2, 2]], "1"', 1),  # duplicate key
        good.replace('{"0": null, "1": [[2, 1]]', '{"0": null, "1": null'),  # MoE layer null in a decode step
        extra_null_key,  # still valid
        no_decode_step,  # still valid
        good.replace(', {"0": null, "1": [[2, 1]], "3": [[9, 8]]}', ", {}"),  # empty decode step
        good.replace("[[9, 8]]", "[[9, 8], [1, 2]]"),  # two lists in a decode step
        good + " x",  # trailing garbage
        "\ufeff" + good,  # byte order mark
    ]
    for i, text in enumerate(cases):
        p = tmp_path / f"{i}.json"
        p.write_text(text)
        fast, slow = _both(p, monkeypatch)
        if fast is not None:
            _assert_same(fast, slow)
        if slow is None:
            assert fast is None, text
    assert import_file._fast_parse(good.encode()) is not None
    # valid variants the fast path takes itself (and, above, agrees on with the JSON parse)
    for text in (extra_null_key, no_decode_step):
        assert import_file._fast_parse(text.encode()) is not None, text


def test_two_workers_write_the_same_artifact_and_input_hash(tmp_path):
    """--workers 2 (forked parser processes, per-file digests) == one process, byte for byte, and the
    source tree's input hash (from the digests taken while parsing) == hashing the tree from disk."""
    from eldr_cli.artifacts.store import input_hash

    write_oic_tree(tmp_path / "src", n_per_subject=9, num_layers=5, num_experts=24, top_k=2, seed=3)
    root = tmp_path / "src" / "acme" / "Tiny-MoE"
    (root / "NOTES.txt").write_text("not a trace, but part of the tree's hash\n")
    bad = next(root.rglob("*.json")).with_name("broken.json")
    bad.write_text("[{")
    manifests = []
    for w in (1, 2):
        out = tmp_path / f"out{w}"
        res = importer.import_trace(root, out, workers=w, chunk_files=7, progress=False)
        assert res.metrics["n_skipped_files"] == 1
        manifests.append(json.loads((out / "manifest.json").read_text()))
    one, two = manifests
    assert one["files"] == two["files"] and one["content_hash"] == two["content_hash"]
    assert one["inputs"] == two["inputs"]
    assert one["inputs"]["source_tree"]["content_hash"] == input_hash(root)
    t1, t2 = read_trace(tmp_path / "out1"), read_trace(tmp_path / "out2")
    np.testing.assert_array_equal(t1.prefill_counts, t2.prefill_counts)
    assert t1.n_requests == 27


@pytest.mark.parametrize("workers,chunk_files", [(1, 256), (1, 2), (2, 2)])
def test_files_that_disagree_are_named_in_or_across_batches(tmp_path, capsys, workers, chunk_files):
    """Parser processes stage a batch of files each; a file whose MoE layers or k differ from the first
    file's is still named (whether it shares a batch with good files or not) and nothing is left."""
    good = '[{"0": [[1, 2], [3, 4]], "1": [[0, 5], [2, 3]]}, {"0": [[1, 2]], "1": [[0, 3]]}]'
    for bad, msg in (('[{"0": [[1, 2]], "2": [[0, 5]]}, {"0": [[1, 2]], "2": [[0, 3]]}]', "MoE layers"),
                     ('[{"0": [[1]], "1": [[0]]}, {"0": [[1]], "1": [[0]]}]', "1 experts per token")):
        root = tmp_path / msg.split()[-1] / "acme" / "M"
        d = root / "mmlu" / "law"
        d.mkdir(parents=True)
        for i in range(5):
            (d / f"{i}.json").write_text(bad if i == 3 else good)
        out = tmp_path / f"out-{workers}-{chunk_files}"
        with pytest.raises(EldrError, match=msg) as e:
            importer.import_trace(root, out, workers=workers, chunk_files=chunk_files, progress=False)
        assert "3.json" in str(e.value)
        assert not out.exists() and not staging_dir(out).exists()


def test_chunk_aggregates_merge_to_the_whole_trace_sums():
    """The parser processes sum their own chunks (E' = the chunk's largest id + 1); merged, they equal
    the sums over every row at the final E, bit for bit (what fig. 1 and fig. 3 are drawn from)."""
    from eldr_cli.capture.figures import Aggregates

    rng = np.random.default_rng(0)
    L, k, E = 3, 2, 9
    chunks = []
    for Ec, n in ((5, 4), (9, 3), (7, 5)):
        pre, dec = rng.integers(0, 50, (n, L, Ec)), rng.integers(0, 9, (n, L, Ec))
        chunks.append((pre, dec, rng.integers(1, 90, n), rng.integers(0, 9, n), list(rng.choice(["a", "b", "c"], n))))
    whole = Aggregates(L, E, k)
    merged = None
    for pre, dec, toks, steps, doms in chunks:
        pad = ((0, 0), (0, 0), (0, E - pre.shape[2]))
        whole.update(np.pad(pre, pad), np.pad(dec, pad), toks, steps, doms)
        part = Aggregates(L, pre.shape[2], k)
        part.update(pre, dec, toks, steps, doms)
        merged = part if merged is None else merged.merge(part)
    assert merged is not None and merged.E == E
    np.testing.assert_array_equal(merged.prefill, whole.prefill)
    np.testing.assert_array_equal(merged.decode, whole.decode)
    assert (merged.prompt_tokens, merged.decode_steps) == (whole.prompt_tokens, whole.decode_steps)
    assert merged.domain_tokens == whole.domain_tokens
    for d in whole.domain_prefill:
        np.testing.assert_array_equal(merged.domain_prefill[d], whole.domain_prefill[d])
    np.testing.assert_array_equal(merged.prefill_decode_corr(), whole.prefill_decode_corr())
    with pytest.raises(ValueError, match="L=4"):
        merged.merge(Aggregates(4, E, k))


def test_staged_chunks_of_an_older_eldr_still_assemble(tmp_path):
    """A staging directory written before chunks were folders of .npy files (chunk-N.npz) is read the
    same, so `capture --resume` after an upgrade does not lose the chunks already captured."""
    from eldr_cli.capture.staging import Staging

    arrays = {"prefill_counts": np.arange(24, dtype=np.int32).reshape(2, 3, 4),
              "decode_steps": np.array([5, 6], np.int32)}
    st = Staging(tmp_path / "out", {"x": 1})
    st.start_fresh()
    np.savez(st.dir / "chunk-000000.npz", **arrays)
    from eldr_cli.capture.staging import write_chunk_arrays

    write_chunk_arrays(st.dir, 1, arrays)
    for c in (0, 1):
        a = st.chunk_arrays(c)
        assert sorted(a.files) == sorted(arrays)
        for n, v in arrays.items():
            np.testing.assert_array_equal(a[n], v)
    assert sorted(p.name for p in st.dir.iterdir()) == ["chunk-000000.npz", "chunk-000001.arrays", "state.json"]


def test_an_interrupt_while_the_parsers_start_leaves_nothing(tmp_path, monkeypatch):
    """Ctrl-C while the parser processes start (loading the parser takes a moment) used to leave the
    staging directory behind: it is removed like at any later point."""
    write_oic_tree(tmp_path / "src", n_per_subject=2, num_layers=3, num_experts=8, top_k=2, seed=0)

    def interrupted(workers):
        raise KeyboardInterrupt

    monkeypatch.setattr(importer, "_start_pool", interrupted)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        importer.import_trace(tmp_path / "src" / "acme" / "Tiny-MoE", out, workers=2, progress=False)
    assert not out.exists() and not staging_dir(out).exists()
