"""Perplexity under the champion (tasks/eval/perplexity/stage.py): scores written for every document, never a
drop; deterministic; gibberish scores higher than text like the training data; the champion's version and package
digest are in the fingerprint (a new champion rescores, the same one reuses); select keeps the lowest perplexities;
changing the selection recomputes no score. A tiny GPT is trained here in a plain torch loop on a real token
dataset and packaged by the real checkpoint stage."""

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lifecycle.tasks.data.select.stage import SelectConfig, run_select
from lifecycle.tasks.data.tokenize.stage import TokenizeConfig, run_tokenize, token_shards
from lifecycle.tasks.eval.checkpoint.stage import package_model
from lifecycle.tasks.eval.perplexity.stage import (COLUMN, PerplexityConfig, ScoringModel, Scorer,
                                                   run_perplexity)
from lifecycle.tasks.train import commit as ckpt
from lifecycle.tasks.train.config import ModelConfig
from lifecycle.tasks.train.model import GPT
from tests.conftest import corpus_records, docs_table, make_collect

GIBBERISH = " ".join("".join(random.Random(i).choices("qxzjvkwy", k=7)) for i in range(40))


def train_package(wd, tokens, steps: int, seed: int = 0):
    """A GPT trained `steps` AdamW steps on the token dataset's train split, committed and packaged."""
    meta = token_shards(tokens)
    data = torch.from_numpy(np.concatenate(meta.memmap("train")).astype(np.int64))
    torch.manual_seed(seed)
    mcfg = ModelConfig(vocab_size=meta.vocab_size, n_layer=1, n_head=2, n_embd=32, seq_len=32)
    model = GPT(mcfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, len(data) - mcfg.seq_len - 1, (16,), generator=g)
        x = torch.stack([data[s: s + mcfg.seq_len] for s in starts])
        y = torch.stack([data[s + 1: s + 1 + mcfg.seq_len] for s in starts])
        logits, _ = model(x)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    tag = wd / f"ckpt-{seed}-{steps}" / ckpt.tag_name(steps)
    tag.mkdir(parents=True)
    ckpt.write_model(tag, model.eval().export_state(), mcfg)
    ckpt.commit(tag, steps)
    return package_model(SimpleNamespace(checkpoint_dir=str(tag)), tokens, str(wd))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    wd = tmp_path_factory.mktemp("wd")
    texts = [r["text"] for r in corpus_records(60)]
    tokens = run_tokenize(make_collect(wd, [docs_table(texts, "train")]), TokenizeConfig(
        vocab_size=300, val_fraction=0.05, min_val_docs=0, min_val_tokens=0), str(wd))
    package = train_package(wd, tokens, steps=100)
    held_out = [r["text"] for r in corpus_records(70)[60:]]
    scored = make_collect(wd, [docs_table(held_out + [GIBBERISH, ""], "new")], fixture="to-score")
    return wd, tokens, package, scored


def test_scores_every_document_and_gibberish_scores_higher(setup):
    wd, _, package, scored = setup
    model = ScoringModel.of_package("1", package.dir)
    cfg = PerplexityConfig(enabled=True, max_tokens=64, batch_docs=4, threads=1)
    ref = run_perplexity(scored, cfg, str(wd), model=model)
    t = ref.read()
    assert t.num_rows == scored.num_rows and t.column("doc_id").to_pylist() == scored.read().column("doc_id").to_pylist()
    scores = t.column(COLUMN).to_pylist()
    assert scores[-1] is None  # the empty document has no token to score
    normal, gibberish = scores[:-2], scores[-2]
    assert all(s is not None and s > 1 for s in normal)
    assert gibberish > 2 * max(normal), (gibberish, normal)
    m = ref.manifest()
    assert m["scoring_model"]["version"] == "1" and m["scoring_model"]["package_sha256"] == package.sha256
    assert m["config"]["champion_version"] == "1" and m["stats"]["counters"] == {"scored_docs": 11, "unscored_docs": 1}
    # the same champion: the committed dataset is reused; scores are the same when computed again elsewhere
    assert run_perplexity(scored, cfg, str(wd), model=model).reused
    again = Scorer(package.dir, cfg.model_copy(update={"batch_docs": 1})).perplexities(
        scored.read().column("text").to_pylist())
    assert again[-1] is None and np.allclose(again[:-1], scores[:-1], rtol=1e-4)


def test_new_champion_rescores_same_champion_reuses(setup):
    wd, tokens, package, scored = setup
    cfg = PerplexityConfig(enabled=True, max_tokens=32, threads=1)
    first = run_perplexity(scored, cfg, str(wd), model=ScoringModel.of_package("1", package.dir))
    assert run_perplexity(scored, cfg, str(wd), model=ScoringModel.of_package("1", package.dir)).fingerprint == first.fingerprint
    other = train_package(wd, tokens, steps=20, seed=1)  # another model: a new champion version
    second = run_perplexity(scored, cfg, str(wd), model=ScoringModel.of_package("2", other.dir))
    assert not second.reused and second.fingerprint != first.fingerprint
    assert second.read().column(COLUMN).to_pylist() != first.read().column(COLUMN).to_pylist()
    with pytest.raises(ValueError, match="no scoring model"):
        run_perplexity(scored, cfg, str(wd))


def test_select_on_perplexity_keeps_the_lowest_and_reuses_the_scores(setup):
    wd, _, package, scored = setup
    ref = run_perplexity(scored, PerplexityConfig(enabled=True, max_tokens=32, threads=1), str(wd),
                         model=ScoringModel.of_package("1", package.dir))
    scores = dict(zip(ref.read().column("doc_id").to_pylist(), ref.read().column(COLUMN).to_pylist()))
    ranked = sorted((s, d) for d, s in scores.items() if s is not None)
    top = run_select(ref, SelectConfig(column=COLUMN, threshold=None, top_fraction=0.5), str(wd))
    assert set(top.read().column("doc_id").to_pylist()) == {d for _, d in ranked[: round(len(ranked) / 2)]}
    rejected = {r["doc_id"]: r for r in top.read_rejected().to_pylist()}
    assert ranked[-1][1] in rejected and rejected[ranked[-1][1]]["reason"] == "low_quality"  # the gibberish
    cut = ranked[3][0]
    under = run_select(ref, SelectConfig(column=COLUMN, threshold=cut), str(wd))
    assert set(under.read().column("doc_id").to_pylist()) == {d for s, d in ranked if s <= cut}
    # a new rule is a new select dataset over the very same scores
    assert under.fingerprint != top.fingerprint
    assert run_perplexity(scored, PerplexityConfig(enabled=True, max_tokens=32, threads=1), str(wd),
                          model=ScoringModel.of_package("1", package.dir)).reused


def test_either_scorer_runs_alone_and_select_names_a_scored_column():
    from lifecycle.config import load_config
    from lifecycle.tasks.stages import BY_NAME, enabled, input_of

    alone = load_config(None, ["perplexity.enabled=true", f"select.column={COLUMN}", "select.threshold=40"])
    assert enabled(BY_NAME["perplexity"], alone) and enabled(BY_NAME["select"], alone)
    assert not enabled(BY_NAME["quality"], alone)
    assert input_of("select", {"scrub", "perplexity"}) == "perplexity" and input_of("select", {"scrub"}) == "scrub"
    with pytest.raises(Exception, match="select.column is quality_fasttext, written by quality, which is off"):
        load_config(None, ["perplexity.enabled=true"])
    both = load_config(None, ["perplexity.enabled=true", "quality.enabled=true",
                              "quality.reference_inputs=[corpus/python-docs/part-00000.jsonl.gz]"])
    assert both.select.column == "quality_fasttext"
    assert not enabled(BY_NAME["perplexity"], load_config(None, []))
