"""dedup: exact duplicates (normalised), MinHash near-duplicates, clusters and the keep policy."""

import json

from tasks.collect import CollectConfig, run_collect
from tasks.dedup import DedupConfig, run_dedup, shingles

BASE = ("the committee met on tuesday to discuss the budget for the coming year and agreed that the "
        "library should receive additional funding for new books computers and longer opening hours in winter")


def make(tmp_path, texts):
    p = tmp_path / "in.jsonl"
    p.write_text("".join(json.dumps({"id": f"d{i}", "text": t}) + "\n" for i, t in enumerate(texts)))
    return run_collect(CollectConfig(inputs=[str(p)]), str(tmp_path / "w"))


def test_exact_near_and_unique(tmp_path):
    texts = [
        BASE,                                      # d0 kept, cluster of 3
        "  " + BASE.upper().replace(" ", "\n  "),  # d1 exact duplicate after normalisation
        BASE.replace("winter", "summer"),          # d2 near duplicate (one word changed)
        "an entirely different document about river fishing licences and the rules for catching trout in spring",
    ]
    ref = run_dedup(make(tmp_path, texts), DedupConfig(), str(tmp_path / "w"))
    kept = ref.read().to_pylist()
    assert [r["source_id"] for r in kept] == ["d0", "d3"]
    assert kept[0]["cluster_size"] == 3 and kept[0]["cluster_id"] == kept[0]["doc_id"]
    assert kept[1]["cluster_size"] == 1
    rej = {r["source_id"]: (r["reason"], r["duplicate_of"]) for r in ref.read_rejected().to_pylist()}
    assert rej == {"d1": ("exact_duplicate", kept[0]["doc_id"]), "d2": ("near_duplicate", kept[0]["doc_id"])}
    s = ref.manifest()["stats"]
    assert s["rows_in"] == 4 == s["rows_kept"] + s["rows_rejected"]


def test_switches_and_verification(tmp_path):
    texts = [BASE, BASE, BASE.replace("winter", "summer")]
    parent = make(tmp_path, texts)
    only_exact = run_dedup(parent, DedupConfig(near=False), str(tmp_path / "w"))
    assert [r["source_id"] for r in only_exact.read().to_pylist()] == ["d0", "d2"]
    only_near = run_dedup(parent, DedupConfig(exact=False), str(tmp_path / "w"))
    assert [r["source_id"] for r in only_near.read().to_pylist()] == ["d0"]
    assert only_near.read().to_pylist()[0]["cluster_size"] == 3
    # a strict true-Jaccard check refuses the near pair (Jaccard of 5-gram sets is about 0.85 here)
    strict = run_dedup(parent, DedupConfig(verify_jaccard=0.99), str(tmp_path / "w"))
    assert [r["source_id"] for r in strict.read().to_pylist()] == ["d0", "d2"]


def test_distinct_documents_are_not_merged(tmp_path):
    texts = [BASE, "completely unrelated prose about mountains glaciers valleys and the weather in the alps today"]
    ref = run_dedup(make(tmp_path, texts), DedupConfig(), str(tmp_path / "w"))
    assert ref.num_rows == 2 and ref.read_rejected().num_rows == 0


def test_shingles():
    assert shingles("A b, c d e f", 5) == {b"a b c d e", b"b c d e f"}
    assert shingles("short text", 5) == {b"short text"}
    assert shingles("", 5) == set()
