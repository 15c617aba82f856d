"""Decontamination before tokenize: a document sharing a 13-gram with an eval item is rejected as `contaminated`
with the set and item named; one sharing 12 words is kept; built-in HumanEval; reruns reuse; off by default."""

import json
from pathlib import Path

import pytest

from lifecycle.config import PipelineConfig
from lifecycle.core.dataset import DatasetRef
from lifecycle.tasks.data.decontaminate.ngrams import overlap, words
from lifecycle.tasks.data.decontaminate.sets import read_items, resolve_set
from lifecycle.tasks.data.decontaminate.stage import DecontaminateConfig, run_decontaminate
from lifecycle.tasks.stages import BY_NAME, enabled, input_of
from tests.conftest import docs_table, make_collect

ITEM = ("Question: a train leaves the station at nine and travels sixty miles per hour, how far has it gone "
        "by noon when it stops for lunch")


def eval_file(tmp_path, text=ITEM):
    p = tmp_path / "mathqa.jsonl"
    p.write_text(json.dumps({"id": "q-7", "question": text}) + "\n" + json.dumps({"id": "q-8", "question": "short"})
                 + "\n")
    return p


def decontaminate(tmp_path, texts, cfg):
    parent = make_collect(tmp_path, [docs_table(texts)])
    return run_decontaminate(parent, cfg, str(tmp_path))


def test_overlap_counts_docs_sharing_a_13gram():
    train = [" ".join(f"w{i}" for i in range(40))]
    clean = " ".join(f"x{i}" for i in range(40))
    dirty = "Intro words. " + " ".join(f"W{i}" for i in range(10, 23)) + " then other words"  # 13 words, any case
    near = " ".join(f"w{i}" for i in range(10, 22))  # only 12 words in common: not a 13-gram
    m = overlap([clean, dirty, near], train, 13)
    assert m["contamination_dirty_docs"] == 1 and m["contamination_doc_rate"] == pytest.approx(1 / 3)
    assert 0 < m["contamination_ngram_rate"] < 1
    assert words("Don't STOP, now!") == ["don", "t", "stop", "now"]


def test_contaminated_document_is_rejected_with_set_and_item(tmp_path):
    cfg = DecontaminateConfig(enabled=True, sets=(str(eval_file(tmp_path)),), text_fields=("question",))
    planted = "Some preamble. " + ITEM.upper().replace(" ", "  ") + "!!! and then the page goes on."
    twelve = " ".join(ITEM.split()[1:13]) + " and nothing more of it"  # 12 words shared: kept
    clean = "A page about gardening: water the tomatoes every morning and keep the soil loose."
    ref = decontaminate(tmp_path, [planted, twelve, clean], cfg)
    assert ref.read(["doc_id"]).column(0).to_pylist() == ["d1", "d2"]
    rej = ref.read_rejected().to_pylist()
    assert [r["doc_id"] for r in rej] == ["d0"] and rej[0]["reason"] == "contaminated"
    detail = json.loads(rej[0]["detail"])
    assert detail["set"] == "mathqa" and detail["item"] == "q-7" and len(detail["ngram"].split()) == 13
    stats = ref.manifest()["stats"]
    assert stats["rejected_by_reason"] == {"contaminated": 1} and stats["counters"]["contaminated_mathqa"] == 1
    again = decontaminate(tmp_path, [planted, twelve, clean], cfg)  # rerun: the committed dataset, reused
    assert again.reused and again.path == ref.path


def test_edited_eval_set_changes_the_fingerprint(tmp_path):
    path = eval_file(tmp_path)
    cfg = DecontaminateConfig(enabled=True, sets=(str(path),), text_fields=("question",))
    first = decontaminate(tmp_path, ["nothing in common here at all"], cfg)
    path.write_text(json.dumps({"id": "q-9", "question": "a different question " * 5}) + "\n")
    second = decontaminate(tmp_path, ["nothing in common here at all"], cfg)
    assert second.path != first.path and not second.reused


def test_humaneval_builtin(tmp_path):
    s = resolve_set("humaneval")
    items = read_items(s, ("text",), ("id",))
    assert len(items) == 164 and items[0][0] == "HumanEval/0"
    code = "# my utils\n" + items[0][1] + "\n# end"
    ref = decontaminate(tmp_path, [code, "def add(a, b):\n    return a + b\n"],
                        DecontaminateConfig(enabled=True, sets=("humaneval",)))
    rej = ref.read_rejected().to_pylist()
    assert [r["doc_id"] for r in rej] == ["d0"]
    assert json.loads(rej[0]["detail"])["item"] == "HumanEval/0" and ref.num_rows == 1


def test_config_errors_name_the_field(tmp_path):
    with pytest.raises(ValueError, match="decontaminate.sets is empty"):
        DecontaminateConfig(enabled=True)
    with pytest.raises(Exception, match="neither a built-in"):
        resolve_set(str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1, "prompt": "x"}\n')
    with pytest.raises(Exception, match="no text field"):
        read_items(resolve_set(str(bad)), ("text",), ("id",))


def test_off_by_default_tokenize_reads_scrub():
    cfg = PipelineConfig(collect={"inputs": ["x.jsonl"]})
    assert not cfg.decontaminate.enabled and not cfg.quality.enabled
    assert not any(enabled(BY_NAME[s], cfg) for s in ("decontaminate", "quality", "select"))
    assert input_of("tokenize", {"collect", "filter", "dedup", "scrub"}) == "scrub"
    assert input_of("tokenize", {"scrub", "decontaminate"}) == "decontaminate"
    assert input_of("tokenize", {"scrub", "decontaminate", "quality", "select"}) == "select"
    on = PipelineConfig(collect={"inputs": ["x.jsonl"]}, decontaminate={"enabled": True, "sets": ["humaneval"]})
    assert enabled(BY_NAME["decontaminate"], on) and on.tokenize == cfg.tokenize  # tokenize's config unchanged


def test_default_run_is_unchanged_and_enabled_run_inserts_the_step(tmp_path):
    """Off (even with sets named) the data stages' datasets are the default run's; on, tokenize reads the step."""
    from tests.conftest import corpus_records
    from tests.flows.test_one_cache import run_data_stages

    src = tmp_path / "docs.jsonl"
    recs = corpus_records(30)
    planted = [dict(r, id=f"planted-{i}", text=r["text"] + "\n" + ITEM) for i, r in enumerate(recs[:10])]
    src.write_text("".join(json.dumps(r) + "\n" for r in recs + planted))
    qa = eval_file(tmp_path)
    lax = "tokenize.max_contamination=1.0"  # the planted item is in train and val pages alike in the default run
    default = run_data_stages([str(src)], tmp_path / "w", (lax,))
    off = run_data_stages([str(src)], tmp_path / "w", (lax, "decontaminate.enabled=false",
                                                       f"decontaminate.sets=[{json.dumps(str(qa))}]"))
    assert {k: v[0] for k, v in off.items()} == {k: v[0] for k, v in default.items()}
    assert all(reused for _, reused in off.values()) and "decontaminate" not in off
    on = run_data_stages([str(src)], tmp_path / "w", (lax, "decontaminate.enabled=true",
                                                      f"decontaminate.sets=[{json.dumps(str(qa))}]",
                                                      "decontaminate.text_fields=[question]"))
    assert on["scrub"] == off["scrub"] and on["tokenize"][0] != off["tokenize"][0]
    scrubbed = DatasetRef.from_dir(Path(on["scrub"][0])).read(["text"]).column(0).to_pylist()
    reaching = sum(ITEM in t for t in scrubbed)  # planted pages that got through filter and dedup
    ref = DatasetRef.from_dir(Path(on["decontaminate"][0]))
    assert reaching > 0 and ref.manifest()["stats"]["rejected_by_reason"] == {"contaminated": reaching}
