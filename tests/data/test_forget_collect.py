"""The tombstone ledger and the collect stage's `forgotten` rejections (tasks/data/collect/tombstones.py)."""

import json

import pyarrow.parquet as pq
import pytest

from lifecycle.tasks.data.collect import tombstones as tb
from lifecycle.tasks.data.collect.stage import CollectConfig, run_collect
from tests.conftest import corpus_records, jaccard

SECRET = ("Marguerite Okonkwo-Lindqvist lives at 14 Pelican Row and her diary for the spring of that year records "
          "every visit to the lighthouse keeper, the weather on each morning, the ships that passed the headland, "
          "the letters she wrote to her sister in the north and the long walk back along the dunes at dusk.")
# one word changed near the end: the same document for dedup (Jaccard of 5-gram shingles about 0.9)
NEAR = SECRET.replace("long walk back", "slow walk back")


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _collect(inputs, wd, **kw):
    return run_collect(CollectConfig(inputs=[str(p) for p in inputs], **kw), str(wd))


def _forget(wd, source_id, text, reason="erasure request 17"):
    rows = tb.tombstone_rows([{"doc_id": "d-secret", "source_id": source_id, "text": text}], reason,
                             tb.MinHashParams())
    return tb.add_tombstones(wd, rows)


def test_content_hash_normalises_case_and_whitespace():
    assert tb.content_hash("Hello   World\n") == tb.content_hash(" hello world")
    assert tb.content_hash("hello world") != tb.content_hash("hello worlds")


def test_ledger_holds_hashes_and_signatures_never_text(tmp_path):
    assert tb.ForgetFilter.from_workdir(tmp_path) is None  # no ledger: nothing to filter
    fresh = _forget(tmp_path, "diary-1", SECRET)
    assert len(fresh) == 1
    assert _forget(tmp_path, "diary-1", SECRET) == []  # the same request twice: one tombstone
    t = pq.read_table(tmp_path / tb.LEDGER)
    assert t.num_rows == 1
    row = t.to_pylist()[0]
    assert row["source_id"] == "diary-1" and row["reason"] == "erasure request 17"
    assert row["content_hash"] == tb.content_hash(SECRET) and len(row["signature"]) == 112
    raw = (tmp_path / tb.LEDGER).read_bytes() + json.dumps(row).encode()
    for word in ("Okonkwo", "Pelican", "lighthouse", "dunes"):
        assert word.encode() not in raw


def test_ledger_refuses_other_minhash_parameters(tmp_path):
    _forget(tmp_path, "diary-1", SECRET)
    rows = tb.tombstone_rows([{"doc_id": "x", "source_id": "other", "text": NEAR}], "r", tb.MinHashParams(ngram=3))
    with pytest.raises(ValueError, match="ngram"):
        tb.add_tombstones(tmp_path, rows)


def test_matcher_exact_near_and_unrelated(tmp_path):
    _forget(tmp_path, "diary-1", SECRET)
    m = tb.ForgetFilter.from_workdir(tmp_path).matcher()
    assert m.match(SECRET.upper())[1] == "exact"  # case and spacing do not hide a copy
    assert jaccard(SECRET, NEAR) > 0.8
    hit = m.match(NEAR)
    assert hit is not None and hit[1] == "near" and hit[2] > 0.7
    assert all(m.match(r["text"]) is None for r in corpus_records(30))


def test_empty_ledger_leaves_collect_as_it_was(tmp_path):
    src = tmp_path / "in" / "docs.jsonl"
    src.parent.mkdir()
    _write(src, corpus_records(10) + [{"id": "diary-1", "text": SECRET}])
    a = _collect([src], tmp_path / "a")
    (tmp_path / "b").mkdir()
    pq.write_table(tb.SCHEMA.empty_table(), tmp_path / "b" / tb.LEDGER)  # an empty ledger is no ledger
    b = _collect([src], tmp_path / "b")
    assert a.fingerprint == b.fingerprint and a.sha256 == b.sha256
    assert a.read().to_pylist() == b.read().to_pylist()


def test_collect_rejects_exact_and_near_copies_as_forgotten(tmp_path):
    wd = tmp_path / "w"
    first = tmp_path / "in" / "docs.jsonl"
    first.parent.mkdir()
    _write(first, corpus_records(10) + [{"id": "diary-1", "text": SECRET}])
    before = _collect([first], wd, incremental=True)
    from lifecycle.tasks.data.collect.stage import record_collected

    record_collected(str(wd), before)
    kept = {r["source_id"]: r for r in before.read().to_pylist()}
    assert "diary-1" in kept
    _forget(wd, "diary-1", SECRET)
    # a later crawl brings the document back, a near copy under another id, and new documents
    second = tmp_path / "in" / "crawl2.jsonl"
    others = corpus_records(14)[10:]
    _write(second, [{"id": "diary-1-again", "text": SECRET}, {"id": "diary-copy", "text": NEAR}] + others)
    after = _collect([first, second], wd, incremental=True)
    assert after.fingerprint != before.fingerprint
    rej = {r["source_id"]: r for r in after.read_rejected().to_pylist()}
    assert rej["diary-1-again"]["reason"] == "forgotten" and "exact copy of tombstone" in rej["diary-1-again"]["detail"]
    assert rej["diary-copy"]["reason"] == "forgotten" and "near copy of tombstone" in rej["diary-copy"]["detail"]
    assert {r["source_id"] for r in after.read().to_pylist()} == {r.get("id") for r in others}
    assert after.manifest()["stats"]["rejected_by_reason"] == {"forgotten": 2}
    for p in after.files() + after.files("rejected") + [after.manifest_path]:
        data = p.read_bytes() + json.dumps(pq.read_table(p).to_pylist() if p.suffix == ".parquet" else "").encode()
        assert b"Okonkwo" not in data and b"lighthouse keeper" not in data, p
    # the rerun of the very same plan is the committed dataset; a new tombstone makes collect recompute
    assert _collect([first, second], wd, incremental=True).reused
    _forget(wd, "x", corpus_records(14)[-1]["text"])
    again = _collect([first, second], wd, incremental=True)
    assert not again.reused and again.fingerprint != after.fingerprint
    assert again.manifest()["stats"]["rejected_by_reason"] == {"forgotten": 3}


SIMHASH = tb.SimHashParams(k=6, blocks=8, ngram=3)  # NEAR is 6 bits from SECRET under 3-gram features


def test_tombstones_follow_the_configured_dedup_method():
    from lifecycle.tasks.data.dedup.stage import DedupConfig

    assert tb.params_of(DedupConfig()) == tb.MinHashParams()
    assert tb.params_of(DedupConfig(minhash={"ngram": 3, "verify_jaccard": 0.7})) == \
        tb.MinHashParams(ngram=3, verify_jaccard=0.7)  # dedup.minhash, read as dedup uses it
    cfg = DedupConfig(method="simhash", simhash={"k": 4, "blocks": 8, "ngram": 2})
    assert tb.params_of(cfg) == tb.SimHashParams(k=4, blocks=8, ngram=2)


def test_simhash_ledger_holds_a_simhash_and_refuses_minhash_rows(tmp_path):
    from lifecycle.tasks.data.dedup.simhash import simhashes

    rows = tb.tombstone_rows([{"doc_id": "d-secret", "source_id": "diary-1", "text": SECRET}], "r", SIMHASH)
    tb.add_tombstones(tmp_path, rows)
    row = tb.read_ledger(tmp_path).to_pylist()[0]
    assert row["method"] == "simhash" and row["signature"] == [] and (row["simhash_k"], row["simhash_blocks"]) == (6, 8)
    assert row["simhash"] == int(simhashes([SECRET], 3)[0])  # dedup's own SimHash of the text
    with pytest.raises(ValueError, match="dedup.method"):
        tb.add_tombstones(tmp_path, tb.tombstone_rows([{"doc_id": "x", "source_id": "o", "text": NEAR}], "r",
                                                      tb.MinHashParams()))


@pytest.mark.parametrize("params", [tb.MinHashParams(), SIMHASH], ids=["minhash", "simhash"])
def test_matcher_fires_on_near_copies_by_the_ledgers_method(tmp_path, params):
    from lifecycle.tasks.data.dedup.simhash import hamming, simhashes

    tb.add_tombstones(tmp_path, tb.tombstone_rows([{"doc_id": "d", "source_id": "diary-1", "text": SECRET}], "r",
                                                  params))
    f = tb.ForgetFilter.from_workdir(tmp_path)
    assert f.params == params
    m = f.matcher()
    assert m.match(SECRET.upper())[1] == "exact"
    hit = m.match(NEAR)
    assert hit is not None and hit[1] == "near"
    if isinstance(params, tb.SimHashParams):
        d = int(hamming(simhashes([SECRET], 3), simhashes([NEAR], 3))[0])
        assert 0 < d <= 6 and hit[3] == f"simhash hamming distance {d} <= k=6" and hit[2] == 1 - d / 64
    else:
        assert hit[3].startswith("signature agreement") and hit[2] > 0.7
    assert all(m.match(r["text"]) is None for r in corpus_records(30))  # does not fire on unrelated documents


def test_simhash_matcher_keeps_dedups_k(tmp_path):
    """A copy beyond k bits is not a near copy, exactly as dedup would not merge it; within k it is."""
    from lifecycle.tasks.data.dedup.simhash import hamming, simhashes

    edited = SECRET.replace("the weather on each morning", "what the sky did on every single grey morning")
    d = int(hamming(simhashes([SECRET], 3), simhashes([edited], 3))[0])
    assert d > 0
    for k, fires in ((d - 1, False), (d, True)):
        wd = tmp_path / f"k{k}"
        wd.mkdir()
        p = tb.SimHashParams(k=k, blocks=max(6, k + 1), ngram=3)
        tb.add_tombstones(wd, tb.tombstone_rows([{"doc_id": "d", "source_id": "s", "text": SECRET}], "r", p))
        assert (tb.ForgetFilter.from_workdir(wd).matcher().match(edited) is not None) is fires, (k, d)


def test_collect_rejects_near_copies_with_a_simhash_ledger(tmp_path):
    wd = tmp_path / "w"
    wd.mkdir()
    src = tmp_path / "in" / "docs.jsonl"
    src.parent.mkdir()
    tb.add_tombstones(wd, tb.tombstone_rows([{"doc_id": "d", "source_id": "diary-1", "text": SECRET}], "r", SIMHASH))
    _write(src, corpus_records(10) + [{"id": "diary-copy", "text": NEAR}])
    out = _collect([src], wd)
    rej = out.read_rejected().to_pylist()
    assert [r["source_id"] for r in rej] == ["diary-copy"]
    assert rej[0]["reason"] == "forgotten" and "near copy of tombstone" in rej[0]["detail"]
    assert "simhash hamming distance" in rej[0]["detail"]
    assert out.num_rows == 10
