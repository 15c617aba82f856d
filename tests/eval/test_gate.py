"""The champion gate compares like with like: val_bpb of two versions counts only on the same evaluation-set
digest; on another digest the champion is re-scored on the candidate's set, or promotion is refused with the
reason. Real MLflow SQLite registry; `rescore_package` on a real token dataset and model package. (The
contamination gate on boilerplate-sharing documents is a data check at tokenize: tests/data/test_data_checks.py.)"""

import json

import numpy as np
import pytest
import torch
from mlflow import MlflowClient
from pydantic import BaseModel

from lifecycle.core.dataset import materialize
from lifecycle.lineage.registry import CHAMPION, EVAL_SET_TAG, Registry
from lifecycle.lineage.tracking import Tracker, TrackingConfig
from lifecycle.tasks.data.tokenize.stage import TokenizeConfig, run_tokenize, token_shards
from lifecycle.tasks.eval.evaluate.gate import eval_set_digest, rescore_package
from lifecycle.tasks.eval.evaluate.stage import (EvaluateConfig, _loss, token_byte_lengths)
from lifecycle.tasks.train import commit as ckpt
from lifecycle.tasks.train.config import ModelConfig
from lifecycle.tasks.train.model import GPT
from tests.conftest import corpus_records, docs_table, make_collect

class Cfg(BaseModel):
    workdir: str


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """One MLflow SQLite store for the registry tests (creating one takes ~20 s here); each test its own model."""
    return tmp_path_factory.mktemp("store")


@pytest.fixture
def reg(store, request) -> Registry:
    t = Tracker(TrackingConfig(model_name=request.node.name[:60]), str(store), "exp")
    t.start("run", Cfg(workdir=str(store)), {"prefect.flow_run_id": "fr"})
    return Registry(t)


def register(reg, tmp_path, bpb, digest, package="pkg"):
    (tmp_path / package).mkdir(exist_ok=True)
    (tmp_path / package / "w.txt").write_text(package)
    tags = {"metric.val_bpb": repr(bpb), "lifecycle.model_package_manifest": str(tmp_path / package / "manifest.json")}
    if digest:
        tags[EVAL_SET_TAG] = digest
    return reg.register_model(tmp_path / package, tags)


def test_same_digest_compares_registered_values(reg, tmp_path):
    calls = []
    decisions = []
    for bpb in (2.0, 2.5, 1.5):
        name, v = register(reg, tmp_path, bpb, "A" * 64)
        decisions.append(reg.promote(name, v, bpb, "A" * 64, rescore=lambda p: calls.append(p)))
    assert [d["decision"] for d in decisions] == ["promoted", "not_promoted", "promoted"]
    assert calls == []  # same set: nothing re-scored
    assert decisions[1]["comparison"] == "same eval set AAAAAAAAAAAA"
    assert str(MlflowClient(reg.tracker.uri).get_model_version_by_alias(reg.model_name, CHAMPION).version) == "3"


def test_a_champion_trained_on_forgotten_documents_gives_way_to_the_next_clean_version(reg, tmp_path):
    """`lifecycle forget` tags the versions trained on the documents (Registry.taint): the tainted champion is
    replaced by the next version without them, even one the metric gate would refuse (a retrain with a new
    tokenizer is not comparable), and a tainted candidate never wins that way."""
    name, v1 = register(reg, tmp_path, 1.0, "A" * 64, package="old")
    assert reg.promote(name, v1, 1.0, "A" * 64)["decision"] == "promoted"
    assert reg.champion_taint() is None
    assert reg.taint([{"name": name, "version": v1}], ["t2", "t1"]) == [f"{name}/{v1}"]
    reg.taint([{"name": name, "version": v1}], ["t1", "t3"])
    assert reg.champion_taint() == (str(v1), "t1,t2,t3")
    _, tainted = register(reg, tmp_path, 0.5, "A" * 64, package="also-tainted")
    reg.taint([{"name": name, "version": tainted}], ["t1"])
    d = reg.promote(name, tainted, 0.5, "A" * 64)  # better metric, same set: promoted by the metric only
    assert d["decision"] == "promoted" and "forgotten" not in d["reason"]
    _, clean = register(reg, tmp_path, 9.0, "B" * 64, package="retrained")  # worse, and not comparable
    d = reg.promote(name, clean, 9.0, "B" * 64)
    assert d["decision"] == "promoted" and "trained on forgotten documents (tombstones t1)" in d["reason"]
    assert reg.champion_taint() is None


def test_different_digest_rescores_the_champion_on_the_candidates_set(reg, tmp_path):
    name, v1 = register(reg, tmp_path, 2.0, "A" * 64, package="champ")
    reg.promote(name, v1, 2.0, "A" * 64)
    seen = []

    def rescore(package):
        seen.append(package)
        return 1.7, "re-scored on eval set BBBBBBBBBBBB"

    # 1.9 beats the champion's registered 2.0, but that was on set A; on set B the champion scores 1.7
    _, v2 = register(reg, tmp_path, 1.9, "B" * 64, package="cand")
    d = reg.promote(name, v2, 1.9, "B" * 64, rescore=rescore)
    assert seen == [tmp_path / "champ"]
    assert d["decision"] == "not_promoted" and d["champion_value_compared"] == 1.7
    assert "was scored on eval set AAAAAAAAAAAA, the candidate on BBBBBBBBBBBB" in d["reason"]
    # and a candidate that beats the re-scored champion is promoted
    _, v3 = register(reg, tmp_path, 1.6, "B" * 64, package="cand2")
    assert reg.promote(name, v3, 1.6, "B" * 64, rescore=rescore)["decision"] == "promoted"
    tags = MlflowClient(reg.tracker.uri).get_model_version(reg.model_name, v3).tags
    assert tags["lifecycle.promotion.champion_value_compared"] == "1.7"
    assert tags["lifecycle.promotion.candidate_eval_set"] == "B" * 64


def test_different_digest_without_rescoring_refuses_with_the_reason(reg, tmp_path):
    name, v1 = register(reg, tmp_path, 2.0, None)  # a champion from before digests existed
    reg.promote(name, v1, 2.0, None)
    _, v2 = register(reg, tmp_path, 1.0, "B" * 64)
    d = reg.promote(name, v2, 1.0, "B" * 64, rescore=lambda p: (None, "the champion's package is gone"))
    assert d["decision"] == "not_promoted"
    assert d["reason"] == ("not comparable: champion version 1 was scored on eval set None, the candidate on "
                           "BBBBBBBBBBBB; the champion's package is gone")
    _, v3 = register(reg, tmp_path, 1.0, "B" * 64)
    assert "no re-scoring available" in reg.promote(name, v3, 1.0, "B" * 64)["reason"]
    assert str(MlflowClient(reg.tracker.uri).get_model_version_by_alias(reg.model_name, CHAMPION).version) == "1"


def test_digest_names_the_documents_tokenizer_and_cut():
    docs = [("d1", "one"), ("d2", "two")]
    base = eval_set_digest(docs, "t" * 64, None, 8)
    assert base == eval_set_digest(docs, "t" * 64, None, 4)  # batch size changes nothing without a cut
    assert len({base, eval_set_digest(docs[:1], "t" * 64, None, 8), eval_set_digest(docs, "u" * 64, None, 8),
                eval_set_digest(docs, "t" * 64, 2, 8), eval_set_digest([("d1", "one!"), docs[1]], "t" * 64, None, 8)}) == 5


@pytest.fixture(scope="module")
def scored(tmp_path_factory):
    """A real token dataset, an evaluate dataset over it and two model packages (one per tokenizer)."""
    wd = tmp_path_factory.mktemp("wd")
    texts = [r["text"] for r in corpus_records(40)]
    collect = make_collect(wd, [docs_table(texts)])
    tcfg = TokenizeConfig(vocab_size=300, val_fraction=0.3)
    tokens = run_tokenize(collect, tcfg, str(wd))
    meta = token_shards(tokens)
    ecfg = EvaluateConfig(max_batches=2, batch_size=2)

    def package(name, tokenizer_sha):
        torch.manual_seed(len(name))
        mcfg = ModelConfig(vocab_size=meta.vocab_size, n_layer=1, n_head=2, n_embd=32, seq_len=16)
        model = GPT(mcfg).eval()

        def build(w):
            ckpt.write_model(w.path(ckpt.WEIGHTS).parent, model.export_state(), mcfg)
            for f in (ckpt.WEIGHTS, ckpt.MODEL_CONFIG):
                w.add_file(f)
            w.path("lineage.json").write_text(json.dumps({"tokenizer_sha256": tokenizer_sha}))
            w.add_file("lineage.json")
            return {"num_rows": 0}
        return materialize(str(wd), "checkpoint", {"name": name}, "test", build), model

    evaluate = materialize(str(wd), "evaluate", {"evaluate": ecfg.model_dump(mode="json")}, "test",
                           lambda w: {"num_rows": 0, "extra": {"eval_set_sha256": "B" * 64}}, parents=[tokens])
    return tokens, meta, ecfg, evaluate, package


def test_rescore_package_scores_the_champion_exactly_as_evaluate_scores(scored):
    from tokenizers import Tokenizer

    tokens, meta, ecfg, evaluate, package = scored
    ref, model = package("same-tokenizer", meta.tokenizer_sha256)
    value, how = rescore_package(ref.dir, evaluate)
    data = np.concatenate(meta.memmap("val"))
    expected = _loss(model, data, token_byte_lengths(Tokenizer.from_file(meta.tokenizer_path)), ecfg)["val_bpb"]
    assert value == pytest.approx(expected, rel=1e-6) and how == "re-scored on eval set BBBBBBBBBBBB"
    other, _ = package("other-tokenizer", "f" * 64)
    value, why = rescore_package(other.dir, evaluate)
    assert value is None and "is not the candidate's" in why
    (ref.dir / "model.safetensors").write_bytes(b"damaged")
    value, why = rescore_package(ref.dir, evaluate)
    assert value is None and "does not verify" in why
