"""Incremental dedup: a later run removes documents that duplicate anything kept by earlier runs, against the
persisted index (signatures and band keys in Parquet), without recomputing the earlier signatures."""

import json
from pathlib import Path

import pyarrow as pa
import pytest

import lifecycle.tasks.data.dedup.stage as dedup_mod
from lifecycle.core.dataset import DatasetRef
from lifecycle.tasks.data.dedup import minhash
from lifecycle.tasks.data.collect.stage import CollectConfig, run_collect
from lifecycle.tasks.data.dedup.stage import INDEX_MANIFEST, DedupConfig, index_dir, run_dedup

A = ("the committee met on tuesday to discuss the budget for the coming year and agreed that the library should "
     "receive additional funding for new books computers and longer opening hours in winter")
B = "an entirely different document about river fishing licences and the rules for catching trout in spring"
C = "completely unrelated prose about mountains glaciers valleys and the weather in the alps on a cold day"
D = "a fourth text describing how the city council plans to repair the old bridge over the canal next summer"


def collect(tmp_path, name, texts, wd):
    p = tmp_path / f"{name}.jsonl"
    p.write_text("".join(json.dumps({"id": f"{name}{i}", "text": t}) + "\n" for i, t in enumerate(texts)))
    return run_collect(CollectConfig(inputs=[str(p)]), wd)


def by_source(ref):
    return {r["source_id"]: r for r in ref.read_rejected().to_pylist()}


@pytest.fixture
def two_runs(tmp_path, monkeypatch):
    wd = str(tmp_path / "w")
    first = run_dedup(collect(tmp_path, "a", [A, B, A.upper()], wd), DedupConfig(), wd)
    hashed = []  # every text the second run computes a signature for
    real = minhash.signatures
    monkeypatch.setattr(minhash, "signatures",
                        lambda texts, *a, **k: hashed.extend(pa.array(texts).to_pylist()) or real(texts, *a, **k))
    second_parent = collect(tmp_path, "b", [A.replace("winter", "summer"), "  " + B.upper(), C, D], wd)
    second = run_dedup(second_parent, DedupConfig(), wd)
    monkeypatch.setattr(minhash, "signatures", real)
    return wd, first, second, second_parent, hashed


def test_second_run_drops_duplicates_of_the_first(two_runs):
    wd, first, second, _, hashed = two_runs
    kept1 = {r["source_id"]: r["doc_id"] for r in first.read().to_pylist()}
    assert set(kept1) == {"a0", "a1"} and set(by_source(first)) == {"a2"}  # within the first run, as before
    assert sorted(r["source_id"] for r in second.read().to_pylist()) == ["b2", "b3"]
    rej = by_source(second)
    assert (rej["b0"]["reason"], rej["b0"]["duplicate_kind"], rej["b0"]["duplicate_of"]) == ("duplicate", "near", kept1["a0"])
    assert (rej["b1"]["reason"], rej["b1"]["duplicate_kind"], rej["b1"]["duplicate_of"]) == ("duplicate", "exact", kept1["a1"])
    assert first.fingerprint[:20] in rej["b0"]["detail"] and first.fingerprint[:20] in rej["b1"]["detail"]
    assert rej["b0"]["detail"].startswith(f"near duplicate of {kept1['a0']}; kept by an earlier run")
    s = second.manifest()["stats"]
    assert s["rows_in"] == 4 and s["rejected_by_reason"] == {"duplicate": 2}
    assert s["counters"] == {"duplicate_exact": 1, "duplicate_near": 1, "duplicate_of_earlier_run": 2}
    # only the second run's documents were hashed, once each: the first run's signatures came from the index
    assert sorted(hashed) == sorted([A.replace("winter", "summer"), "  " + B.upper(), C, D])


def test_index_holds_kept_docs_and_is_part_of_the_fingerprint(two_runs, tmp_path):
    wd, first, second, second_parent, _ = two_runs
    parts = json.loads((index_dir(wd, DedupConfig()) / INDEX_MANIFEST).read_text())["parts"]
    assert [p["dataset"] for p in parts] == [first.fingerprint, second.fingerprint]
    assert [p["num_rows"] for p in parts] == [2, 2]
    # the same inputs against an empty index: a different dataset that keeps the near-copy
    alone = run_dedup(second_parent, DedupConfig(), str(tmp_path / "other"))
    assert alone.fingerprint != second.fingerprint and alone.num_rows == 4
    # switched off: the index is neither read nor written
    off = run_dedup(second_parent, DedupConfig(incremental=False), wd)
    assert off.num_rows == 4
    assert len(json.loads((index_dir(wd, DedupConfig()) / INDEX_MANIFEST).read_text())["parts"]) == 2


def test_rerun_reuses_its_dataset_and_never_dedups_against_itself(two_runs):
    wd, first, second, second_parent, _ = two_runs
    again = run_dedup(second_parent, DedupConfig(), wd)
    assert again.reused and again.sha256 == second.sha256
    first_parent = first.manifest()["parents"][0]
    again1 = run_dedup(DatasetRef.from_dir(first_parent["manifest"].rsplit("/", 1)[0]), DedupConfig(), wd)
    assert again1.reused and again1.sha256 == first.sha256 and again1.num_rows == 2
    assert len(json.loads((index_dir(wd, DedupConfig()) / INDEX_MANIFEST).read_text())["parts"]) == 2


def test_crash_between_commit_and_publish_is_healed_by_a_rerun(tmp_path, monkeypatch):
    wd = str(tmp_path / "w")
    parent = collect(tmp_path, "a", [A, B], wd)
    real = dedup_mod.publish

    def crash(*a, **k):
        raise KeyboardInterrupt("killed after the dataset commit")

    monkeypatch.setattr(dedup_mod, "publish", crash)
    with pytest.raises(KeyboardInterrupt):
        run_dedup(parent, DedupConfig(), wd)
    monkeypatch.setattr(dedup_mod, "publish", real)
    ref = run_dedup(parent, DedupConfig(), wd)
    assert ref.reused  # the committed dataset is found, not recomputed, and now published
    second = run_dedup(collect(tmp_path, "b", [A.replace("winter", "summer")], wd), DedupConfig(), wd)
    assert second.num_rows == 0 and by_source(second)["b0"]["duplicate_kind"] == "near"


def test_a_damaged_index_is_restored_from_its_dataset_and_refused_when_that_copy_is_damaged_too(tmp_path):
    """Issue 44, 6: a damaged part is restored from the committed dedup dataset it was copied from, and the run
    goes on; with that copy damaged as well there is nothing good to restore from, and the run is refused naming
    the part."""
    from lifecycle.tasks.data.dedup.restore import INDEX_FILE

    wd = str(tmp_path / "w")
    run_dedup(collect(tmp_path, "a", [A, B], wd), DedupConfig(), wd)
    part = index_dir(wd, DedupConfig()) / "part-00000.parquet"
    good = part.read_bytes()
    part.write_bytes(good[:-10])
    run_dedup(collect(tmp_path, "b", [C], wd), DedupConfig(), wd)
    assert part.read_bytes() == good
    entry = json.loads((part.parent / "_index.json").read_text())["parts"][0]
    part.write_bytes(good[:-10])
    (Path(entry["dataset_path"]) / INDEX_FILE).write_bytes(b"not parquet")
    with pytest.raises(RuntimeError, match="part-00000.parquet"):
        run_dedup(collect(tmp_path, "c", [C.upper()], wd), DedupConfig(), wd)


@pytest.mark.parametrize("threshold, b0_kept", [(0.5, False), (0.99, True)])
def test_verification_against_the_index_uses_the_signature_estimate(tmp_path, threshold, b0_kept):
    """With `verify_jaccard`, a candidate pair against an earlier run's document is merged only when the
    signatures' Jaccard estimate reaches the threshold (the index keeps no texts); exact copies are unaffected."""
    wd = str(tmp_path / "w")
    run_dedup(collect(tmp_path, "a", [A, B], wd), DedupConfig(), wd)
    second = run_dedup(collect(tmp_path, "b", [A.replace("winter", "summer"), B.upper(), C], wd),
                       DedupConfig(minhash={"verify_jaccard": threshold}), wd)
    kept = sorted(r["source_id"] for r in second.read().to_pylist())
    assert kept == (["b0", "b2"] if b0_kept else ["b2"])
    assert by_source(second)["b1"]["duplicate_kind"] == "exact"


def collect_rows(tmp_path, name, rows, wd, incremental=False):
    p = tmp_path / f"{name}.jsonl"
    p.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in rows))
    return run_collect(CollectConfig(inputs=[str(p)], incremental=incremental), wd)


def test_a_rerun_over_the_same_documents_keeps_them_and_still_drops_copies_of_history(tmp_path):
    """collect.incremental false (the default) re-reads every input: after any upstream change the documents
    the last run kept reach dedup again. They are this run's corpus, not copies of themselves (same doc_id =
    same source and text); a copy under another source is still a duplicate of history."""
    wd = str(tmp_path / "w")
    first = run_dedup(collect_rows(tmp_path, "one", [("a0", A), ("a1", B)], wd), DedupConfig(), wd)
    assert first.num_rows == 2
    # the same inputs plus more, as a rerun after a changed filter would see them (a new parent dataset)
    again = run_dedup(collect_rows(tmp_path, "two", [("a0", A), ("a1", B), ("c0", C), ("x9", B.upper())], wd),
                      DedupConfig(), wd)
    assert sorted(r["source_id"] for r in again.read().to_pylist()) == ["a0", "a1", "c0"]
    rej = by_source(again)
    assert set(rej) == {"x9"} and rej["x9"]["duplicate_kind"] == "exact"
    # a near copy of a re-read document is a duplicate within this run (of its doc_id), not of history
    near = run_dedup(collect_rows(tmp_path, "three", [("a0", A), ("n1", A.replace("winter", "summer"))], wd),
                     DedupConfig(), wd)
    assert [r["source_id"] for r in near.read().to_pylist()] == ["a0"]
    assert "earlier run" not in by_source(near)["n1"]["detail"]


def test_an_incremental_collect_that_delivers_a_document_again_drops_it_as_a_copy_of_history(tmp_path):
    wd = str(tmp_path / "w")
    run_dedup(collect_rows(tmp_path, "one", [("a0", A), ("a1", B)], wd, incremental=True), DedupConfig(), wd)
    later = run_dedup(collect_rows(tmp_path, "two", [("a0", A), ("c0", C)], wd, incremental=True), DedupConfig(), wd)
    assert [r["source_id"] for r in later.read().to_pylist()] == ["c0"]
    assert "kept by an earlier run" in by_source(later)["a0"]["detail"]
