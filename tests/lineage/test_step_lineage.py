"""`lifecycle lineage step`: the documents a training step read, recomputed from the sampler. What it reports is
what the trainer's get_batch reads, under every split of the global batch, and after rollbacks."""

import json

import numpy as np
import pytest

from lifecycle.lineage.steps import step_documents
from lifecycle.tasks.data.tokenize.stage import token_shards
from lifecycle.tasks.train.loader import get_batch
from tests.conftest import lifecycle_in_process
from tests.train.test_train import CFG, make_tokens, with_


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    wd = tmp_path_factory.mktemp("steps")
    ref = make_tokens(wd, 300)
    return wd, ref, token_shards(ref)


def run_dir(wd, name, cfg, shards, metrics=()):
    d = wd / "train" / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({"train": cfg.model_dump(mode="json"), "tokens": shards.model_dump(),
                                               "run_dir": str(d)}))
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics))
    return d


def test_each_sequence_is_the_window_get_batch_reads_and_its_documents_fill_it(world):
    wd, ref, shards = world
    cfg = with_(CFG, **{"batch.grad_accum": 2})  # dp=2 x accum=2 x micro 8 = 32 sequences
    r = step_documents(run_dir(wd, "a", cfg, shards), 3)
    assert r["data_step"] == 2 and len(r["sequences"]) == cfg.global_batch == 32 and r["layout"] == "pp=1,dp=2,sp=1,tp=1"
    data = {p.split("/")[-1]: np.fromfile(p, dtype=shards.dtype) for p in shards.train}
    T = cfg.model.seq_len
    for s in r["sequences"]:
        x, y = get_batch(shards, cfg, 2, s["dp_rank"], s["micro"])
        row = s["sequence"] % cfg.batch.micro_batch_size
        window = data[s["shard"]][s["token_start"]:s["token_end"]]
        assert np.array_equal(window[:T], x[row].numpy()) and np.array_equal(window[1:], y[row].numpy())
        # every token of the window is a document's or an end-of-text between two
        assert sum(d["tokens"] for d in s["documents"]) + int((window == shards.eot_id).sum()) == T + 1
    assert {s["dp_rank"] for s in r["sequences"]} == {0, 1} and {s["micro"] for s in r["sequences"]} == {0, 1}
    side = {d["doc_id"] for d in ref.read(["doc_id"]).to_pylist()}
    assert r["documents"] and {d["doc_id"] for d in r["documents"]} <= side
    assert sum(d["sequences"] for d in r["documents"]) >= len(r["sequences"])


def test_the_same_global_batch_under_another_layout_reads_the_same_documents(world):
    wd, _, shards = world
    two = step_documents(run_dir(wd, "dp2", with_(CFG, **{"batch.grad_accum": 2}), shards), 7)
    one = step_documents(run_dir(wd, "dp1", with_(CFG, **{"batch.num_ranks": 1, "batch.grad_accum": 4}), shards), 7)
    strip = lambda r: [(s["shard"], s["token_start"], s["documents"]) for s in r["sequences"]]  # noqa: E731
    assert strip(one) == strip(two) and one["documents"] == two["documents"]
    assert [s["dp_rank"] for s in one["sequences"]] == [0] * 32 and one["layout"] == "pp=1,dp=1,sp=1,tp=1"
    other = step_documents(run_dir(wd, "dp2", with_(CFG, **{"batch.grad_accum": 2}), shards), 8)
    assert strip(other) != strip(two)


def test_rollbacks_shift_the_data_step_and_bad_requests_are_refused(world, capsys):
    wd, _, shards = world
    rolled = run_dir(wd, "rb", CFG, shards, [{"kind": "rollback", "step": 2, "bad_step": 3,
                                             "skipped_data_steps": [2]}])
    r = step_documents(rolled, 3)
    assert r["data_step"] == 3 and r["skipped_data_steps"] == [2]
    plain = step_documents(run_dir(wd, "plain", CFG, shards), 4)
    assert [s["token_start"] for s in r["sequences"]] == [s["token_start"] for s in plain["sequences"]]
    with pytest.raises(ValueError, match="outside 1..30"):
        step_documents(rolled, 31)
    rc, out = lifecycle_in_process(capsys, "lineage", "step", "plain", "4", "--workdir", str(wd))
    assert rc == 0 and out["documents"] == plain["documents"]
    rc, out = lifecycle_in_process(capsys, "lineage", "step", "/tmp", "4", "--workdir", str(wd))
    assert rc == 2 and "not inside the work dir" in out["error"]
