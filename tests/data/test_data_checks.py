"""Data checks run at tokenize, before any training: a split sharing boilerplate fails there, and a tiny
validation split is raised to its floor with a message."""

import pytest

from lifecycle.tasks.data.decontaminate.ngrams import ContaminationError
from lifecycle.tasks.data.tokenize.checks import check_overlap, train_val_overlap
from lifecycle.tasks.data.tokenize.stage import TokenizeConfig, run_tokenize, split_of, token_shards
from tests.conftest import corpus_records
from tests.data.test_tokenizer import make_docs

BOILERPLATE = ("This article is shared under the terms of the open community licence, version two, which allows "
               "copying and changing it as long as this notice is kept with every copy of the text.")


def test_check_overlap_fails_above_threshold():
    m = {"contamination_doc_rate": 0.25, "contamination_dirty_docs": 1, "contamination_eval_docs": 4}
    check_overlap(m, 13, 0.25)  # at the threshold: passes
    with pytest.raises(ContaminationError, match="1 of 4 val documents .* above tokenize.max_contamination=0.2"):
        check_overlap(m, 13, 0.2)


def test_streamed_overlap_matches_the_definition():
    docs = {"a": "one two three four five", "b": "three four five six", "c": "seven eight nine"}
    batches = lambda: [(list(docs), list(docs.values()))]  # noqa: E731
    m = train_val_overlap(batches, {"b", "c"}, 3)
    assert m["contamination_dirty_docs"] == 1 and m["contamination_eval_docs"] == 2
    assert m["contamination_ngram_rate"] == pytest.approx(1 / 3)  # b: 2 trigrams, 1 in train; c: 1 trigram


def test_shared_boilerplate_fails_at_tokenize_before_training(tmp_path):
    texts = [f"{r['text']} {BOILERPLATE}" for r in corpus_records(40)]
    cfg = TokenizeConfig(vocab_size=300, val_fraction=0.2, min_val_docs=5, min_val_tokens=0)
    with pytest.raises(ContaminationError, match=r"share a 13-gram .* the run stops before training"):
        run_tokenize(make_docs(tmp_path, texts), cfg, str(tmp_path))
    clean = TokenizeConfig(vocab_size=300, val_fraction=0.2, min_val_docs=5, min_val_tokens=0, max_contamination=1.0)
    ref = run_tokenize(make_docs(tmp_path, texts), clean, str(tmp_path))
    assert ref.manifest()["contamination"]["contamination_doc_rate"] == 1.0


def test_tiny_validation_split_is_raised_to_the_floor(tmp_path, capsys):
    texts = [r["text"] for r in corpus_records(40)]
    cfg = TokenizeConfig(vocab_size=300, val_fraction=0.05, min_val_docs=8, min_val_tokens=0, max_contamination=1.0)
    by_fraction = sum(split_of(f"d{i:04d}", cfg) == "val" for i in range(40))
    assert by_fraction < 8
    ref = run_tokenize(make_docs(tmp_path, texts), cfg, str(tmp_path))
    side = ref.read(["doc_id", "split"]).to_pylist()
    assert sum(r["split"] == "val" for r in side) == 8
    vs = ref.manifest()["val_split"]
    assert vs["raised"] and vs["docs"] == 8 and vs["docs_by_val_fraction"] == by_fraction
    assert f"gives {by_fraction} validation document(s), below min_val_docs=8" in capsys.readouterr().out
    # the documents val_fraction picked stay in val: the floor adds, never swaps
    assert all(r["split"] == "val" for r in side if split_of(r["doc_id"], cfg) == "val")


def test_token_floor_moves_documents_and_retrains_without_them(tmp_path, capsys):
    texts = [r["text"] for r in corpus_records(40)]
    cfg = TokenizeConfig(vocab_size=300, val_fraction=0.05, min_val_docs=2, min_val_tokens=20_000,
                         max_contamination=1.0)
    ref = run_tokenize(make_docs(tmp_path, texts), cfg, str(tmp_path))
    meta = token_shards(ref)
    vs = ref.manifest()["val_split"]
    assert meta.num_tokens["val"] >= 20_000 or vs["docs"] == vs["cap_docs"]
    assert "below min_val_tokens=20000" in capsys.readouterr().out
    assert vs["tokens"] == meta.num_tokens["val"]


def test_no_floor_without_a_validation_split(tmp_path):
    texts = [r["text"] for r in corpus_records(10)]
    ref = run_tokenize(make_docs(tmp_path, texts), TokenizeConfig(vocab_size=300, val_fraction=0.0),
                       str(tmp_path))
    assert ref.manifest()["val_split"]["docs"] == 0 and token_shards(ref).num_tokens["val"] == 0
