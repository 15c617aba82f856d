"""Substring dedup in a real `lifecycle run` (deploy/configs/data-all.yaml, which turns it on with SimHash and the
paragraph Bloom filter), `--until dedup`: a span planted inside several real documents is kept in the first that
survives filter and cut from the others, `lineage doc` shows the cut, and a second run reuses the dataset."""

import json
from pathlib import Path

import pytest

from lifecycle.core.dataset import DatasetRef
from tests.conftest import ROOT, corpus_records, last_json, lifecycle

pytestmark = pytest.mark.e2e

SPAN = ("Planted boilerplate: this sentence of more than one hundred bytes is copied into the middle of several "
        "documents of the corpus, so substring dedup must keep its first occurrence only.")


def test_data_all_cuts_a_planted_span_and_lineage_doc_shows_it(tmp_path):
    recs = corpus_records(40)
    for r in recs[:20]:  # inside a paragraph (at a space), so no paragraph repeats whole: only substring fires
        cut = r["text"].find(" ", 300)
        r["text"] = r["text"][:cut] + " " + SPAN + r["text"][cut:]
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in recs))
    wd = tmp_path / "w"
    args = ["run", ROOT / "deploy/configs/data-all.yaml", "--json", "--until", "dedup", "--set", f"workdir={wd}",
            "--set", f"collect.inputs={json.dumps([str(src)])}", "--set", "orchestration.retry_backoff_s=0.1"]
    out = last_json(lifecycle(*args).stdout)
    dedup = DatasetRef.from_dir(Path(out["datasets"]["dedup"]).parent)
    filtered = {r["doc_id"]: r["text"] for r in DatasetRef.from_dir(Path(out["datasets"]["filter"]).parent).read().to_pylist()}
    planted = {r["id"] for r in recs[:20]}
    kept = [r for r in dedup.read().to_pylist() if r["source_id"] in planted]  # the corpus has repeats of its own
    with_span = [r for r in kept if SPAN in r["text"]]
    assert len(kept) >= 3 and with_span == kept[:1], (len(kept), len(with_span))  # the first copy stays, alone
    for r in kept[1:]:  # each later one lost a range (of the text as it entered dedup) that holds the span
        original = filtered[r["doc_id"]].encode()
        spans = [original[c["start"] : c["end"]].decode() for c in r["dedup_cuts"] if c["reason"] == "substring"]
        assert any(SPAN in s for s in spans), spans
    cut = kept[1:]
    m = dedup.manifest()
    assert m["substring"]["windows_repeated"] > 0 and m["stats"]["counters"]["substrings_cut"] >= len(cut)
    assert m["substring"]["documents"] == len(dedup.read(["doc_id"])) + m["stats"]["counters"].get("duplicate_substring", 0)

    doc = last_json(lifecycle("lineage", "doc", cut[0]["source_id"], "--workdir", wd, "--json").stdout)
    event = next(e for e in doc["events"] if e["stage"] == "dedup")
    assert event["outcome"] == "kept" and any(c["reason"] == "substring" for c in event["dedup_cuts"])

    again = last_json(lifecycle(*args).stdout)
    assert again["datasets"]["dedup"] == out["datasets"]["dedup"]  # reused: same fingerprint, nothing rebuilt
    assert DatasetRef.from_dir(Path(again["datasets"]["dedup"]).parent).sha256 == dedup.sha256
