"""The validation floor at tokenize: a tiny validation split is raised to its floor with a message. The train/val
overlap gate (issue 41: near copies, boilerplate, the report) is tested in tests/data/test_split_overlap.py."""

from lifecycle.tasks.data.tokenize.stage import TokenizeConfig, run_tokenize, split_of, token_shards
from tests.conftest import corpus_records
from tests.data.test_tokenizer import make_docs


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
