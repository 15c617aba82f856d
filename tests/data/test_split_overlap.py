"""The group-aware split and the train/val overlap gate (issue 41): a page (or, asked for, a source file) never
straddles the split; a planted leak fails the gate, which names the leaked pair and its report; a standard sentence repeated
across many documents does not."""

import json

import pytest

from lifecycle.tasks.data.decontaminate.ngrams import ContaminationError
from lifecycle.tasks.data.tokenize import checks
from lifecycle.tasks.data.tokenize.split import MULTI_RECORD, group_key, split_of
from lifecycle.tasks.data.tokenize.stage import TokenizeConfig, run_tokenize
from tests.conftest import corpus_records
from tests.data.test_tokenizer import make_docs

CFG = TokenizeConfig(vocab_size=300, val_fraction=0.2, min_val_docs=0, min_val_tokens=0)
BY_FILE = CFG.model_copy(update={"split_by": ("url", "source")})
# a standard paragraph of a reference manual, longer than the text of the short pages below
STANDARD = ("Only superusers can change this setting. The default value is shown in the table of settings, and a "
            "change takes effect after the server configuration is reloaded with the signal described in the "
            "chapter on server administration, or after a restart of every process that reads the file.")


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
                         max_contamination=1.0, split_by=("source",), max_val_fraction=0.5)
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


def leak_corpus(n_leaks: int) -> tuple[list[str], list[str]]:
    """Real pages, each its own url, then copies of `n_leaks` val pages (two words changed) whose urls land in
    train."""
    texts = [r["text"] for r in corpus_records(200) if len(r["text"].split()) >= 150][:40]
    urls = [f"https://docs.example/p{i}.html" for i in range(len(texts))]
    val = [i for i, u in enumerate(urls) if split_of(f"url:{u}", CFG) == "val"]
    for k, i in enumerate(val[:n_leaks]):
        w = texts[i].split(" ")
        w[len(w) // 3], w[2 * len(w) // 3] = "changed", "edited"
        texts.append(" ".join(w))
        urls.append(next(u for j in range(100) if split_of(f"url:{(u := f'https://copy.example/{k}-{j}')}", CFG)
                         == "train"))
    return texts, urls


def test_a_planted_leak_fails_the_gate_naming_the_pair_and_the_report(tmp_path):
    texts, urls = leak_corpus(n_leaks=3)
    with pytest.raises(ContaminationError) as e:
        run_tokenize(make_docs(tmp_path, texts, urls=urls), CFG, str(tmp_path))
    msg = str(e.value)
    assert "\n" not in msg and "are near copies of training text" in msg and "the run stops before training" in msg
    assert f"above tokenize.max_contamination={CFG.max_contamination}" in msg
    report_path = msg.rsplit("what overlaps: ", 1)[1]
    report = json.loads(open(report_path).read())
    near = [r for r in report["closest_val_docs"] if r["near_copy"]]
    assert len(near) == 3 and all(r["share"] > 0.8 for r in near)
    leaked = {f"d{i:04d}": f"d{len(urls) - 3 + k:04d}" for k, i in enumerate(
        [i for i, u in enumerate(urls[:-3]) if split_of(f"url:{u}", CFG) == "val"][:3])}
    assert {r["val_doc_id"]: r["train_doc_id"] for r in near} == leaked  # each names its copy
    assert {(r["val_doc_id"], r["train_doc_id"]) for r in report["top_pairs"][:3]} == set(leaked.items())
    assert near[0]["val_source_id"] in msg and near[0]["train_source_id"] in msg
    assert report["contamination_near_copy_docs"] == 3 and report["rule"] == checks.rule(CFG)
    # the same corpus without the copies passes, and the report is there too
    clean = run_tokenize(make_docs(tmp_path, texts[:-3], urls=urls[:-3]), CFG, str(tmp_path))
    assert clean.manifest()["contamination"]["contamination_near_copy_docs"] == 0
    assert (clean.dir / checks.REPORT).is_file()


def short_pages_with_a_standard_paragraph(n: int = 40) -> list[str]:
    """Short pages (25 words of their own) that each also hold STANDARD: most of their n-grams are shared."""
    words = " ".join(r["text"] for r in corpus_records(200)).split()
    return [f"{' '.join(words[i * 25:(i + 1) * 25])} {STANDARD}" for i in range(n)]


def test_a_standard_paragraph_on_every_page_passes_and_is_reported_as_boilerplate(tmp_path):
    texts = short_pages_with_a_standard_paragraph()
    ref = run_tokenize(make_docs(tmp_path, texts), CFG, str(tmp_path))
    m = ref.manifest()["contamination"]
    assert m["contamination_doc_rate"] == 1.0  # GPT-3's "dirty": every val page shares a 13-gram with train
    assert m["contamination_near_copy_docs"] == 0 and m["contamination_boilerplate_ngrams"] > 0
    report = json.loads((ref.dir / checks.REPORT).read_text())
    [passage] = [p for p in report["top_passages"] if p["boilerplate"]]
    assert passage["text"].startswith("only superusers can change this setting")
    assert passage["val_docs"] == m["contamination_eval_docs"] and passage["train_docs"] > 10
    # counted as any other n-gram, the paragraph makes every short page a near copy
    strict = CFG.model_copy(update={"contamination_boilerplate_docs": None})
    with pytest.raises(ContaminationError, match="are near copies of training text"):
        run_tokenize(make_docs(tmp_path, texts), strict, str(tmp_path))


def test_streamed_overlap_matches_the_definitions():
    docs = {"a": "one two three four five", "b": "three four five six", "c": "seven eight nine"}
    batches = lambda: [(list(docs), [f"{d}.txt" for d in docs], list(docs.values()))]  # noqa: E731
    cfg = CFG.model_copy(update={"contamination_ngram": 3, "contamination_min_share": 0.5})
    m, report = checks.train_val_overlap(batches, {"b", "c"}, cfg)
    assert m["contamination_dirty_docs"] == 1 and m["contamination_eval_docs"] == 2  # GPT-3: any shared n-gram
    assert m["contamination_ngram_rate"] == pytest.approx(1 / 3)  # b: 2 trigrams, 1 in train; c: 1 trigram
    assert m["contamination_near_copy_docs"] == 1  # b: half of its trigrams are in a
    [b] = report["closest_val_docs"]
    assert (b["val_source_id"], b["train_source_id"], b["share"], b["near_copy"]) == ("b.txt", "a.txt", 0.5, True)
    assert checks.train_val_overlap(batches, {"b", "c"}, cfg.model_copy(update={"contamination_min_share": 0.6})
                                    )[0]["contamination_near_copy_docs"] == 0


def test_check_overlap_threshold_is_inclusive(tmp_path):
    m = {"contamination_near_copy_rate": 0.25, "contamination_near_copy_docs": 1, "contamination_eval_docs": 4}
    checks.check_overlap(m, CFG.model_copy(update={"max_contamination": 0.25}), tmp_path / "none.json")
    with pytest.raises(ContaminationError, match=r"1 of 4 val documents \(25.0%\) .* what overlaps: .*none.json"):
        checks.check_overlap(m, CFG.model_copy(update={"max_contamination": 0.2}), tmp_path / "none.json")
