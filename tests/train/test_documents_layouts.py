"""Document-aware attention (`train.model.attention: document`) under pipeline and sequence parallelism, through
the real launch path: pp=2, sp=2 and tp2×pp2 against one rank with the same setting, 20 steps on the same global
batches (windows starting at documents, `train.batch.window_starts: documents`, so every rank of a group reads
the same document windows). Slow: four launches of 1-4 CPU ranks. The fast checks that a later pipeline stage and
a sequence slice apply the documents are in test_parallel_pp.py and test_parallel_sp.py."""

from __future__ import annotations

import pytest

from tests.train.test_parallel_pp import _max_rel, _records, pp_config

DOCS = {"model.attention": "document", "batch.window_starts": "documents"}


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    from tests.train.test_train import make_tokens

    return make_tokens(tmp_path_factory.mktemp("tokens"), 600)  # documents of 10-60 tokens: windows of 64 hold several


@pytest.fixture(scope="module")
def one(tokens, tmp_path_factory):
    from lifecycle.tasks.train.launch import run_train

    return run_train(tokens, pp_config(ranks=1, pp=1, **DOCS), str(tmp_path_factory.mktemp("one")))


LAYOUTS = {
    "pp2": dict(ranks=2, pp=2),
    "sp2": dict(ranks=2, pp=1, **{"parallel.sp": 2}),
    "tp2pp2": dict(ranks=4, pp=2, **{"parallel.tp": 2}),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_document_attention_under_pp_and_sp_trains_the_single_rank_loss_curve(tokens, one, tmp_path, name):
    from lifecycle.tasks.train.launch import run_train

    run = run_train(tokens, pp_config(**LAYOUTS[name], **DOCS), str(tmp_path / name))
    a, b = ([r["loss"] for r in _records(r.metrics_path, "train")] for r in (run, one))
    rel = _max_rel(a, b)
    print(f"attention=document, {name} vs one rank, 20 steps: max relative loss difference {rel:.3g}")
    assert len(a) == 20 and a[-1] < 0.8 * a[0] and rel <= 1e-5
    assert _max_rel(*([r["val_loss"] for r in _records(r.metrics_path, "eval")] for r in (run, one))) <= 1e-5
