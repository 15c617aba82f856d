"""Quality scores apart from the decision: the quality step scores every document and drops none; select keeps by
a rule on the score (`low_quality` otherwise); a new threshold reuses the scores; scores reach the side table."""

import json

import numpy as np
import pytest

from lifecycle.tasks.data.quality.classifier import prf
from lifecycle.tasks.data.quality.stage import COLUMN, QualityConfig, run_quality
from lifecycle.tasks.data.select.stage import SelectConfig, run_select
from lifecycle.tasks.data.tokenize.stage import TokenizeConfig, run_tokenize
from lifecycle.core.fs import sha256_file
from tests.conftest import corpus_records, docs_table, make_collect

SPAM = "buy cheap pills now click here free casino bonus winner limited offer deal discount viagra loans".split()


def spam(i: int, rng) -> str:
    return " ".join(rng.choice(SPAM, size=60)) + f" offer {i}"


@pytest.fixture(scope="module")
def scored(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("quality")
    recs = corpus_records(120)
    refs = tmp / "reference.jsonl"
    refs.write_text("".join(json.dumps(r) + "\n" for r in recs[:60]))  # the positives, in a collect format
    rng = np.random.default_rng(0)
    texts = [r["text"] for r in recs[60:]] + [spam(i, rng) for i in range(60)]
    parent = make_collect(tmp, [docs_table(texts)])
    cfg = QualityConfig(enabled=True, reference_inputs=[str(refs)], negatives_per_positive=1.0, heldout_fraction=0.2)
    return tmp, parent, cfg, run_quality(parent, cfg, str(tmp))


def test_scores_every_document_and_drops_none(scored):
    tmp, parent, cfg, ref = scored
    m = ref.manifest()
    assert m["stats"]["rows_in"] == m["stats"]["rows_kept"] == 120 and ref.num_rows == 120
    scores = ref.read(["doc_id", COLUMN]).column(COLUMN).to_pylist()
    assert np.mean(scores[:60]) > 0.5 > np.mean(scores[60:])  # reference-like pages score above spam
    assert m["model_sha256"] == sha256_file(ref.dir / m["model_file"])
    assert m["metrics"]["classifier_f1"] > 0 and m["metrics"]["classifier_heldout_docs"] > 0
    assert run_quality(parent, cfg, str(tmp)).reused  # rerun: the committed scores


def test_select_threshold_and_a_new_threshold_reuses_the_scores(scored):
    tmp, parent, cfg, ref = scored
    sel = run_select(ref, SelectConfig(threshold=0.5), str(tmp))
    scores = dict(zip(*ref.read(["doc_id", COLUMN]).to_pydict().values()))
    kept = sel.read(["doc_id"]).column(0).to_pylist()
    assert kept == [d for d, s in scores.items() if s >= 0.5] and 0 < len(kept) < 120
    rej = sel.read_rejected().to_pylist()
    assert {r["reason"] for r in rej} == {"low_quality"} and len(rej) == 120 - len(kept)
    detail = json.loads(rej[0]["detail"])
    assert detail["column"] == COLUMN and detail["threshold"] == 0.5 and detail["score"] < 0.5
    again = run_quality(parent, cfg, str(tmp))  # the flow asks for the scores again: reused, same folder
    stricter = run_select(again, SelectConfig(threshold=0.9), str(tmp))
    assert again.reused and again.path == ref.path and stricter.path != sel.path
    assert stricter.num_rows <= sel.num_rows
    assert run_select(again, SelectConfig(threshold=0.5), str(tmp)).reused


def test_select_top_fraction_keeps_that_share(scored):
    tmp, _, _, ref = scored
    sel = run_select(ref, SelectConfig(threshold=None, top_fraction=0.25), str(tmp))
    assert sel.num_rows == 30
    best = sorted(zip(*ref.read(["doc_id", COLUMN]).to_pydict().values()), key=lambda r: (-r[1], r[0]))[:30]
    assert set(sel.read(["doc_id"]).column(0).to_pylist()) == {d for d, _ in best}
    with pytest.raises(ValueError, match="exactly one of select.threshold and select.top_fraction"):
        SelectConfig(threshold=0.5, top_fraction=0.5)


def test_scores_reach_the_token_side_table(scored):
    tmp, _, _, ref = scored
    sel = run_select(ref, SelectConfig(threshold=0.0), str(tmp))
    tokens = run_tokenize(sel, TokenizeConfig(vocab_size=300, val_fraction=0.1, min_val_docs=5, min_val_tokens=0,
                                              max_contamination=1.0), str(tmp))
    side = tokens.read(["doc_id", COLUMN]).to_pydict()
    scores = dict(zip(*ref.read(["doc_id", COLUMN]).to_pydict().values()))
    assert side[COLUMN] == [pytest.approx(scores[d]) for d in side["doc_id"]]


def test_prf_on_literal_scores():
    m = prf([0.9, 0.8, 0.2, 0.6], [True, False, True, False])
    assert m["precision"] == pytest.approx(1 / 3) and m["recall"] == pytest.approx(0.5)
    assert m["f1"] == pytest.approx(0.4)
    with pytest.raises(ValueError, match="quality.reference_inputs is empty"):
        QualityConfig(enabled=True)
