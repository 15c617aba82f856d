"""The group-aware split (issue 41): a page (or, asked for, a source file) never straddles the split."""

from lifecycle.tasks.data.tokenize.split import MULTI_RECORD, group_key, split_of
from lifecycle.tasks.data.tokenize.stage import TokenizeConfig, run_tokenize
from tests.conftest import corpus_records
from tests.data.test_tokenizer import make_docs

CFG = TokenizeConfig(vocab_size=300, val_fraction=0.2, min_val_docs=0, min_val_tokens=0, max_contamination=1.0)
BY_FILE = CFG.model_copy(update={"split_by": ("url", "source")})


def split_sides(ref) -> dict[str, str]:
    return {r["doc_id"]: r["split"] for r in ref.read(["doc_id", "split"]).to_pylist()}


def test_documents_of_one_source_file_never_straddle_the_split(tmp_path):
    texts = [r["text"] for r in corpus_records(60)]
    sources = [f"/docs/page-{i // 6}.rst" for i in range(60)]  # 10 files of 6 sections each
    ref = run_tokenize(make_docs(tmp_path, texts, sources), BY_FILE, str(tmp_path))
    side = split_sides(ref)
    by_file: dict[str, set] = {}
    for i, s in enumerate(sources):
        by_file.setdefault(s, set()).add(side[f"d{i:04d}"])
    assert all(len(v) == 1 for v in by_file.values()), by_file
    assert {"train", "val"} == {v for sides in by_file.values() for v in sides}
    val_files = {s for s in by_file if split_of(f"source:{s}", BY_FILE) == "val"}
    assert {s for s, v in by_file.items() if v == {"val"}} == val_files
    vs = ref.manifest()["val_split"]
    assert vs["groups"] == 10 and vs["largest_group_docs"] == 6


def test_url_groups_first_and_a_jsonl_source_groups_nothing():
    by = ("url", "source")
    assert group_key("d1", {"url": "https://x/a.html", "source": "/in/a.rst"}, by) == "url:https://x/a.html"
    assert group_key("d1", {"url": None, "source": "/in/a.rst"}, by) == "source:/in/a.rst"
    assert group_key("d1", {"url": None, "source": "/in/crawl.jsonl.gz"}, by) == "d1"  # collect's default source
    assert group_key("d1", {"url": "https://x/a.html", "source": "/in/a.rst"}, ()) == "d1"  # split_by: []
    assert group_key("d1", {"url": "https://x/a.html", "source": "/in/a.rst"}, ("source",)) == "source:/in/a.rst"


def test_multi_record_suffixes_are_collects():
    from lifecycle.tasks.data.collect.stage import file_kind

    assert {file_kind(f"x{s}") for s in MULTI_RECORD} == {"jsonl", "parquet", "warc"}


def test_the_floor_moves_whole_groups_and_a_group_above_the_cap_stays_in_train(tmp_path, capsys):
    texts = [r["text"] for r in corpus_records(40)]
    sources = ["/docs/big.rst"] * 24 + [f"/docs/p{i // 4}.rst" for i in range(16)]  # 24 docs > cap of 20
    cfg = TokenizeConfig(vocab_size=300, val_fraction=0.05, min_val_docs=10, min_val_tokens=0,
                         max_contamination=1.0, split_by=("source",))
    side = split_sides(run_tokenize(make_docs(tmp_path, texts, sources), cfg, str(tmp_path)))
    assert all(side[f"d{i:04d}"] == "train" for i in range(24))
    val = [i for i in range(24, 40) if side[f"d{i:04d}"] == "val"]
    assert len(val) == 12 and all(len({side[f"d{j:04d}"] for j in range(g, g + 4)}) == 1 for g in range(24, 40, 4))
    out = capsys.readouterr().out
    assert "1 split group(s) hold more than max_val_fraction=0.5" in out and "'source:/docs/big.rst', 24" in out
    assert "below min_val_docs=10: the validation split is set to 12 document(s)" in out


def test_sections_of_one_page_stay_together_and_a_corpus_label_groups_nothing(tmp_path):
    recs = corpus_records(60)  # sections of 9 pages of the bundled corpus, `source` python3.11-doc on each
    assert len({r["url"] for r in recs}) < 10 and {r["source"] for r in recs} == {"python3.11-doc"}
    texts, urls, sources = [r["text"] for r in recs], [r["url"] for r in recs], [r["source"] for r in recs]
    floor = CFG.model_copy(update={"min_val_docs": 5})  # 9 pages: the floor makes sure one is val
    side = split_sides(run_tokenize(make_docs(tmp_path, texts, sources, urls), floor, str(tmp_path)))
    by_page: dict[str, set] = {}
    for i, u in enumerate(urls):
        by_page.setdefault(u, set()).add(side[f"d{i:04d}"])
    assert all(len(v) == 1 for v in by_page.values()) and {"train", "val"} == set().union(*by_page.values())
    side = split_sides(run_tokenize(make_docs(tmp_path, texts, sources), CFG, str(tmp_path)))  # no urls
    assert side == {f"d{i:04d}": split_of(f"d{i:04d}", CFG) for i in range(60)}  # by document, as before
