"""dedup's other methods: SimHash near-duplicates (permuted-table blocking) and paragraph-level exact dedup with a
persisted Bloom filter; and the default (MinHash) fingerprints and outputs left as they were before them."""

import hashlib
import json

import numpy as np
import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from lifecycle.lineage.charts import funnel_rows
from lifecycle.tasks.data.collect.stage import CollectConfig, run_collect
from lifecycle.tasks.data.dedup import paragraphs as para
from lifecycle.tasks.data.dedup import simhash
from lifecycle.tasks.data.dedup.stage import (
    BLOOM_FILE, DedupConfig, fingerprint_config, run_dedup, signature_config,
)

BASE = ("the committee met on tuesday to discuss the budget for the coming year and agreed that the "
        "library should receive additional funding for new books computers and longer opening hours in winter")
OTHER = "an entirely different document about river fishing licences and the rules for catching trout in spring"
FOOTER = "this paragraph is a shared boilerplate footer that appears on many pages of the same site"
SIMHASH = {"method": "simhash"}
PARAS = {"paragraphs": {"enabled": True}}


def make(tmp_path, texts, name="in"):
    p = tmp_path / f"{name}.jsonl"
    p.write_text("".join(json.dumps({"id": f"{name}{i}", "text": t}) + "\n" for i, t in enumerate(texts)))
    return run_collect(CollectConfig(inputs=[str(p)]), str(tmp_path / "w"))


def sources(ref):
    return [r["source_id"] for r in ref.read().to_pylist()]


def rejected(ref):
    return {r["source_id"]: r for r in ref.read_rejected().to_pylist()}


# --------------------------------------------------------------------------------------------------
# the default is untouched


def test_default_fingerprint_config_is_the_one_before_the_new_methods():
    """The config part of the fingerprints (dedup and dedup-signatures) of the default config: the literal dicts
    main hashed before `method`, `simhash` and `paragraphs` existed."""
    assert fingerprint_config(DedupConfig()) == {
        "exact": True, "near": True, "ngram": 5, "bands": 14, "rows": 8, "seed": 1, "verify_jaccard": None,
        "incremental": True}
    assert signature_config(DedupConfig()).model_dump(mode="json") == {
        "ngram": 5, "bands": 14, "rows": 8, "seed": 1, "minhash": True}
    # settings of a method not in use do not move the fingerprint; switching it on does
    assert fingerprint_config(DedupConfig(simhash={"k": 5, "blocks": 8})) == fingerprint_config(DedupConfig())
    assert fingerprint_config(DedupConfig(paragraphs={"min_chars": 7})) == fingerprint_config(DedupConfig())
    assert "simhash" in fingerprint_config(DedupConfig(**SIMHASH))
    assert "paragraphs" in fingerprint_config(DedupConfig(**PARAS))
    assert signature_config(DedupConfig(**SIMHASH)).model_dump(mode="json")["simhash"] == {"k": 3, "blocks": 6, "ngram": 3}
    # the `minhash` section's fields stand where they stood before it was a section; a decision
    # (verify_jaccard) moves dedup's fingerprint, not the signatures'
    tight = DedupConfig(minhash={"verify_jaccard": 0.9, "ngram": 3})
    assert fingerprint_config(tight) == {**fingerprint_config(DedupConfig()), "verify_jaccard": 0.9, "ngram": 3}
    assert signature_config(tight).model_dump(mode="json") == {
        "ngram": 3, "bands": 14, "rows": 8, "seed": 1, "minhash": True}


def test_the_old_minhash_spelling_names_the_new_field():
    """`dedup.bands` and its siblings are `dedup.minhash.*` now: the error says so rather than 'extra input'."""
    from lifecycle.config import ConfigError, validate_config

    with pytest.raises(ConfigError, match=r"field `dedup`: `dedup.ngram`, `dedup.bands` moved into the "
                                          r"`dedup.minhash` section: write `dedup.minhash.ngram`, "
                                          r"`dedup.minhash.bands`"):
        validate_config({"collect": {"inputs": ["x"]}, "dedup": {"ngram": 5, "bands": 14}})


def test_default_outputs_are_the_ones_before_the_new_methods(tmp_path):
    """Kept and rejected rows of the default config on a fixed corpus, hashed; the hashes were taken from main
    before the new methods (same corpus, same calls)."""
    texts = [BASE, "  " + BASE.upper(), BASE.replace("winter", "summer"), OTHER, OTHER + "\n\n" + FOOTER]
    ref = run_dedup(make(tmp_path, texts), DedupConfig(), str(tmp_path / "w"))
    kept = ref.read()
    assert kept.column_names[-2:] == ["cluster_id", "cluster_size"] and "dedup_cuts" not in kept.column_names
    digest = lambda rows: hashlib.sha256(json.dumps(rows, sort_keys=True, default=str).encode()).hexdigest()[:16]
    assert sources(ref) == ["in0", "in3", "in4"]
    assert digest([{k: r[k] for k in ("doc_id", "text", "cluster_id", "cluster_size")} for r in kept.to_pylist()]) \
        == KEPT_DIGEST
    assert digest(sorted((r["doc_id"], r["detail"], r["duplicate_kind"]) for r in ref.read_rejected().to_pylist())) \
        == REJECTED_DIGEST
    assert not (tmp_path / "w" / "dedup-bloom").exists() and not (ref.dir / BLOOM_FILE).exists()


KEPT_DIGEST = "3abe6edb79eb1a02"  # main at 301f353, before the new methods
REJECTED_DIGEST = "53cbf964703ac8c5"


# --------------------------------------------------------------------------------------------------
# SimHash


def test_simhash_fingerprints_and_tables():
    h = simhash.simhashes([BASE, BASE.upper(), BASE.replace("winter", "summer"), OTHER, ""], 3)
    assert h[0] == h[1] and h[4] == 0  # case does not matter; no words, fingerprint 0
    d = simhash.hamming(h[[0, 0]], h[[2, 3]])
    assert d[0] < d[1] and d[1] > 10  # one word changed: close; another text: about 32 bits away
    masks = simhash.table_masks(3, 6)
    assert len(masks) == 20 and all(bin(int(x)).count("1") in (31, 32, 33) for x in masks)
    # pigeonhole: any two fingerprints within k bits share a key in some table; 4 bits apart need not
    rng = np.random.default_rng(0)
    a = rng.integers(0, 2**63, 200, dtype=np.uint64)
    for bits in (1, 2, 3):
        flips = np.array([sum(1 << int(i) for i in rng.choice(64, bits, replace=False)) for _ in a], np.uint64)
        b = a ^ flips
        assert (simhash.table_keys(a, 3, 6) == simhash.table_keys(b, 3, 6)).any(axis=1).all()
    with pytest.raises(ValidationError, match="k < blocks"):
        DedupConfig(method="simhash", simhash={"k": 6, "blocks": 6})


def test_simhash_fires_on_near_copies_and_keeps_the_first(tmp_path):
    texts = [BASE, "  " + BASE.upper(), BASE + " indeed", OTHER]
    ref = run_dedup(make(tmp_path, texts), DedupConfig(**SIMHASH), str(tmp_path / "w"))
    assert sources(ref) == ["in0", "in3"]
    kept = ref.read().to_pylist()
    assert kept[0]["cluster_size"] == 3 and kept[0]["cluster_id"] == kept[0]["doc_id"]
    rej = rejected(ref)
    assert rej["in1"]["duplicate_kind"] == "exact" and rej["in1"]["detail"] == f"exact duplicate of {kept[0]['doc_id']}"
    assert rej["in2"]["duplicate_kind"] == "near" and rej["in2"]["duplicate_of"] == kept[0]["doc_id"]
    assert rej["in2"]["detail"] == f"near duplicate of {kept[0]['doc_id']} (simhash, hamming <= 3)"
    m = ref.manifest()
    assert m["stats"]["counters"] == {"duplicate_exact": 1, "duplicate_simhash": 1}
    assert funnel_rows({"dedup": m})[0]["top_reasons"] == [("duplicate (exact)", 1), ("duplicate (near, simhash)", 1)]


def test_simhash_does_not_fire_beyond_k(tmp_path):
    near = BASE.replace("winter", "summer").replace("books", "films").replace("tuesday", "friday")
    h = simhash.simhashes([BASE, near], 3)
    d = int(simhash.hamming(h[:1], h[1:])[0])
    assert d > 0
    wd = str(tmp_path / "w")
    parent = make(tmp_path, [BASE, near, OTHER])
    strict = run_dedup(parent, DedupConfig(method="simhash", simhash={"k": d - 1, "blocks": d}), wd)
    assert sources(strict) == ["in0", "in1", "in2"] and strict.read_rejected().num_rows == 0
    loose = run_dedup(parent, DedupConfig(method="simhash", simhash={"k": d, "blocks": d + 1}), wd)
    assert sources(loose) == ["in0", "in2"]


def test_simhash_incremental_rerun_and_history(tmp_path):
    wd = str(tmp_path / "w")
    cfg = DedupConfig(**SIMHASH)
    first_parent = make(tmp_path, [BASE, OTHER], "a")
    first = run_dedup(first_parent, cfg, wd)
    again = run_dedup(first_parent, cfg, wd)
    assert again.fingerprint == first.fingerprint and again.sha256 == first.sha256  # reused, not rebuilt
    second = run_dedup(make(tmp_path, [BASE + " indeed", FOOTER], "b"), cfg, wd)
    assert sources(second) == ["b1"]
    r = rejected(second)["b0"]
    assert r["duplicate_kind"] == "near" and r["duplicate_of"] == first.read().to_pylist()[0]["doc_id"]
    assert "kept by an earlier run" in r["detail"]
    # the MinHash index and the SimHash index are apart
    assert len(list((tmp_path / "w" / "dedup-index").iterdir())) == 1
    run_dedup(first_parent, DedupConfig(), wd)
    assert len(list((tmp_path / "w" / "dedup-index").iterdir())) == 2


# --------------------------------------------------------------------------------------------------
# paragraphs + Bloom filter


def test_bloom_filter_sizing_and_rates():
    b = para.Bloom.sized(1000, 0.01)
    assert b.m == 9586 and b.nhash == 7  # -n ln p / ln^2 2, m/n ln 2
    keys = para.keys_of([f"paragraph number {i}".encode() for i in range(21000)])
    seen = b.check_add(keys[:1000])
    assert b.inserted == 1000 - seen.sum() and seen.sum() < 10  # a false positive while filling is not added
    assert b.check_add(keys[:1000], add=False).all()  # every key added is found: no false negatives
    fp = b.check_add(keys[1000:], add=False).mean()  # 20,000 keys never added
    assert 0.006 < fp < 0.016 and b.inserted == 1000 - seen.sum()
    assert abs(b.expected_fpr() - 0.01) < 0.001 and abs(b.measured_fpr() - 0.01) < 0.004
    c = para.Bloom.from_bytes(b.to_bytes(), "x")
    assert (c.bits == b.bits).all() and (c.m, c.nhash, c.inserted) == (b.m, b.nhash, b.inserted)
    with pytest.raises(ValueError, match="not a lifecycle Bloom"):
        para.Bloom.from_bytes(b"garbage" * 10, "file.bloom")


def test_paragraph_split_and_cut_ranges():
    text = b"first para\n\nsecond para\n  \n\nthird"
    spans = para.split(text, "blank_line")
    assert [text[s:e] for s, e in spans] == [b"first para", b"second para", b"third"]
    lines = b"a\nb\n\nc"
    assert [lines[s:e] for s, e in para.split(lines, "line")] == [b"a", b"b", b"c"]
    assert para.cut_ranges(spans, [False, True, False], len(text)) == [(10, 23)]  # with the separator before
    assert para.cut_ranges(spans, [True, False, False], len(text)) == [(0, 12)]  # first: the separator after
    assert para.cut_ranges(spans, [True, True, True], len(text)) == [(0, len(text))]


def test_paragraphs_fire_trim_and_reject(tmp_path):
    body2 = "other unrelated content about cooking pasta with a slow tomato sauce for a family dinner"
    texts = [OTHER + "\n\n" + FOOTER,           # in0: kept whole, footer remembered
             body2 + "\n\n" + FOOTER,           # in1: footer cut, trimmed text kept
             FOOTER + "\n\n" + FOOTER[:20],     # in2: footer cut, 20 chars left: under min_doc_chars 30, rejected
             "short line\n\nshort line"]        # in3: paragraphs under min_chars: never cut
    cfg = DedupConfig(paragraphs={"enabled": True, "min_chars": 20, "min_doc_chars": 30})
    ref = run_dedup(make(tmp_path, texts), cfg, str(tmp_path / "w"))
    kept = {r["source_id"]: r for r in ref.read().to_pylist()}
    assert list(kept) == ["in0", "in1", "in3"]
    assert kept["in0"]["text"] == texts[0] and kept["in0"]["dedup_cuts"] == []
    assert kept["in1"]["text"] == body2
    assert kept["in1"]["dedup_cuts"] == [{"start": len(body2), "end": len(texts[1]), "reason": "paragraph"}]
    assert kept["in3"]["text"] == texts[3] and kept["in3"]["dedup_cuts"] == []
    r = rejected(ref)["in2"]
    assert (r["reason"], r["duplicate_kind"], r["duplicate_of"]) == ("duplicate", "paragraph", None)
    assert r["detail"].startswith("1 of 2 paragraphs (") and "bloom filter" in r["detail"]
    m = ref.manifest()
    s = m["stats"]
    assert s["rows_in"] == 4 == s["rows_kept"] + s["rows_rejected"]
    assert s["counters"] == {"paragraphs_cut": 2, "paragraph_bytes_cut": 2 * (len(FOOTER) + 2),
                             "documents_trimmed": 1, "duplicate_paragraph": 1}
    assert funnel_rows({"dedup": m})[0]["top_reasons"] == [("duplicate (paragraphs, bloom)", 1)]
    bloom = m["paragraph_bloom"]
    assert bloom["keys_inserted"] == 3 and bloom["fp_rate_configured"] == 1e-4
    assert bloom["fp_rate_expected"] < 1e-20 and bloom["fp_rate_measured"] < 1e-20


def test_paragraphs_do_not_fire_on_distinct_text(tmp_path):
    texts = [OTHER + "\n\n" + FOOTER, BASE + "\n\n" + FOOTER.replace("site", "town")]
    ref = run_dedup(make(tmp_path, texts), DedupConfig(**PARAS), str(tmp_path / "w"))
    assert [r["dedup_cuts"] for r in ref.read().to_pylist()] == [[], []]
    assert [r["text"] for r in ref.read().to_pylist()] == texts and ref.read_rejected().num_rows == 0


def test_paragraph_filter_persists_across_runs_and_reruns_are_reused(tmp_path):
    wd = str(tmp_path / "w")
    cfg = DedupConfig(**PARAS)
    first_parent = make(tmp_path, [OTHER + "\n\n" + FOOTER], "a")
    first = run_dedup(first_parent, cfg, wd)
    assert run_dedup(first_parent, cfg, wd).fingerprint == first.fingerprint  # idempotent: same filter state
    second = run_dedup(make(tmp_path, [BASE + "\n\n" + FOOTER], "b"), cfg, wd)
    assert second.read().to_pylist()[0]["text"] == BASE  # the footer was seen by the first run
    directory = para.bloom_dir(wd, cfg.paragraphs)
    parts = json.loads((directory / "_bloom.json").read_text())["parts"]
    assert [p["dataset"] for p in parts] == [first.fingerprint, second.fingerprint]
    assert run_dedup(first_parent, cfg, wd).fingerprint == first.fingerprint  # still against its own base
    # not incremental: a fresh filter per run, the footer is kept
    alone = run_dedup(make(tmp_path, [BASE + "\n\n" + FOOTER], "b"), DedupConfig(incremental=False, **PARAS), wd)
    assert alone.read().to_pylist()[0]["dedup_cuts"] == []
    # a damaged state is refused with the file named
    (directory / parts[-1]["path"]).write_bytes(b"x")
    with pytest.raises(RuntimeError, match="paragraph filter .*state-00001.bloom"):
        run_dedup(make(tmp_path, [OTHER], "c"), cfg, wd)


def make_rows(tmp_path, rows, name, incremental=False):
    p = tmp_path / f"{name}.jsonl"
    p.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in rows))
    return run_collect(CollectConfig(inputs=[str(p)], incremental=incremental), str(tmp_path / "w"))


def test_a_rerun_over_the_same_documents_keeps_their_paragraphs(tmp_path):
    """collect.incremental false re-reads every input: documents the last run kept come back after any upstream
    change. Their paragraphs are in the published filter because of them, so they are checked against this
    run's paragraphs only: kept as they were, while a paragraph they share with an earlier document of this
    run, or a new document's copy of history, is still cut."""
    wd = str(tmp_path / "w")
    cfg = DedupConfig(paragraphs={"enabled": True, "min_chars": 20, "min_doc_chars": 30})
    body = "other unrelated content about cooking pasta with a slow tomato sauce for a family dinner"
    first = run_dedup(make_rows(tmp_path, [("a0", OTHER + "\n\n" + FOOTER), ("a1", body + "\n\n" + FOOTER)], "one"),
                      cfg, wd)
    assert [r["text"] for r in first.read().to_pylist()] == [OTHER + "\n\n" + FOOTER, body]
    again = run_dedup(make_rows(tmp_path, [("a0", OTHER + "\n\n" + FOOTER), ("a1", body + "\n\n" + FOOTER),
                                           ("n0", BASE + "\n\n" + OTHER)], "two"), cfg, wd)
    kept = {r["source_id"]: r for r in again.read().to_pylist()}
    assert kept["a0"]["text"] == OTHER + "\n\n" + FOOTER and kept["a0"]["dedup_cuts"] == []  # not a copy of itself
    assert kept["a1"]["text"] == body  # its footer follows a0's in this run, as before
    assert kept["n0"]["text"] == BASE  # a new document: OTHER is a paragraph of a0
    assert again.manifest()["stats"]["counters"]["documents_met_again"] == 2
    # an incremental collect that delivers kept text again: a duplicate of history (exact, before paragraphs)
    later = run_dedup(make_rows(tmp_path, [("a0", OTHER + "\n\n" + FOOTER), ("z0", BASE + "\n\n" + body)], "three",
                                incremental=True), cfg, wd)
    assert "kept by an earlier run" in rejected(later)["a0"]["detail"]
    assert rejected(later)["z0"]["duplicate_kind"] == "paragraph"  # both paragraphs seen in history


def test_paragraphs_after_simhash_and_index_follows_the_final_decision(tmp_path):
    wd = str(tmp_path / "w")
    cfg = DedupConfig(method="simhash", paragraphs={"enabled": True, "min_chars": 20})
    ref = run_dedup(make(tmp_path, [OTHER + "\n\n" + FOOTER, BASE, FOOTER]), cfg, wd)
    assert sources(ref) == ["in0", "in1"] and rejected(ref)["in2"]["duplicate_kind"] == "paragraph"
    # the index of kept documents (what later runs dedup against) holds exactly the documents kept
    index_ids = pq.read_table(ref.dir / "dedup-index.parquet").column("doc_id").to_pylist()
    assert index_ids == [r["doc_id"] for r in ref.read().to_pylist()]


def test_empty_parent_and_exact_only_simhash(tmp_path):
    wd = str(tmp_path / "w")
    empty = make(tmp_path, [""], "e")  # collect rejects the empty text: a parent without files
    ref = run_dedup(empty, DedupConfig(method="simhash", paragraphs={"enabled": True}), wd)
    assert ref.num_rows == 0 and ref.manifest()["paragraph_bloom"]["keys_inserted"] == 0
    # SimHash without near-duplicate removal: exact copies only, the index still fed for later runs
    ref = run_dedup(make(tmp_path, [BASE, BASE + " indeed", BASE.upper()]), DedupConfig(method="simhash", near=False), wd)
    assert sources(ref) == ["in0", "in1"] and rejected(ref)["in2"]["duplicate_kind"] == "exact"
    assert pq.read_table(ref.dir / "dedup-index.parquet").column_names == ["doc_id", "exact_hash", "band_keys", "simhash"]
