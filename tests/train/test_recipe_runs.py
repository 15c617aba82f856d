"""Issue 47's recipe options in real 2-rank DeepSpeed runs on the CPU (slow: about a minute each on 2 cores):
a warmup-stable-decay run extended from its last commit trains the steps an uninterrupted run trains, with the
same lr curve; an anneal branched off a long WSD run follows that run exactly up to its branch step and then
decays; document-aware attention trains and differs from packed attention on the same batches."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lifecycle.tasks.train.launch import run_train
from tests.train.test_train import CFG, make_tokens, with_


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return make_tokens(tmp_path_factory.mktemp("tokens"))


def _train(path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, open(path)) if r["kind"] == "train"}


WSD = with_(CFG, max_steps=20, **{"optimizer.schedule": "wsd", "optimizer.decay_steps": 30,
                                  "optimizer.decay_fraction": 0.2, "checkpoint.every": 10, "logging.every": 1,
                                  "logging.eval_every": 0})


@pytest.mark.slow
def test_wsd_run_extended_from_its_commit_trains_what_an_uninterrupted_run_trains(tokens, tmp_path):
    short = run_train(tokens, WSD, str(tmp_path / "a"))
    longer = run_train(tokens, with_(WSD, max_steps=30), str(tmp_path / "a"))
    assert longer.launched and longer.resumed_from == 20 and longer.run_dir == short.run_dir
    straight = run_train(tokens, with_(WSD, max_steps=30), str(tmp_path / "b"))
    got, want = _train(longer.metrics_path), _train(straight.metrics_path)
    assert sorted(got) == sorted(want) == list(range(1, 31))
    for step in range(1, 31):
        assert got[step]["loss"] == want[step]["loss"], step  # exact: same batches, same lr, restored state
        assert got[step]["lr"] == pytest.approx(WSD.lr_at(step - 1)), step
    assert got[24]["lr"] == WSD.optimizer.lr and got[30]["lr"] < got[26]["lr"] < got[25]["lr"]


@pytest.mark.slow
def test_an_anneal_branches_off_the_long_wsd_runs_commit_and_trains_what_a_fresh_anneal_trains(tokens, tmp_path):
    """An anneal of a long WSD run (decay starting at 18 instead of 800) starts from the long run's last commit
    in its stable phase (step 10) instead of recomputing it, and trains every later step as an anneal run from
    scratch does, loss for loss and lr for lr."""
    long = with_(WSD, max_steps=24, **{"optimizer.decay_steps": 1000, "checkpoint.keep_last": 3})  # keeps step 10
    anneal = with_(WSD, max_steps=24, **{"optimizer.decay_steps": 24, "optimizer.decay_fraction": 0.25,
                                         "checkpoint.keep_last": 3})
    assert anneal.decay_start == 18
    trunk = run_train(tokens, long, str(tmp_path / "w"))
    branched = run_train(tokens, anneal, str(tmp_path / "w"))
    assert branched.resumed_from == 10 and branched.run_dir != trunk.run_dir
    assert f"branched from {trunk.run_dir}/checkpoints/step_00000010" in (Path(branched.run_dir) / "train.log").read_text()
    fresh = run_train(tokens, anneal, str(tmp_path / "fresh"))
    b, t, f = (_train(r.metrics_path) for r in (branched, trunk, fresh))
    assert sorted(b) == list(range(11, 25))
    for step in range(11, 25):
        assert b[step]["loss"] == f[step]["loss"] and b[step]["lr"] == f[step]["lr"], step
    for step in range(11, 19):  # the anneal's steps before its decay are the long run's
        assert b[step]["loss"] == t[step]["loss"] and b[step]["lr"] == t[step]["lr"] == long.optimizer.lr, step
    for step in range(20, 25):  # record `step` holds the lr of update step-1
        assert b[step]["lr"] == pytest.approx(anneal.lr_at(step - 1)) and b[step]["lr"] < t[step]["lr"]


@pytest.mark.slow
def test_document_attention_trains_and_differs_from_packed_attention(tokens, tmp_path):
    cfg = with_(CFG, max_steps=12, **{"checkpoint.every": 12, "logging.every": 1, "logging.eval_every": 0,
                                      "model.attention": "document"})
    doc = run_train(tokens, cfg, str(tmp_path))
    packed = run_train(tokens, with_(cfg, **{"model.attention": "packed"}), str(tmp_path))
    assert doc.run_dir != packed.run_dir  # another trajectory, another run
    d, p = _train(doc.metrics_path), _train(packed.metrics_path)
    assert sum(d[s]["loss"] for s in (10, 11, 12)) < 0.9 * sum(d[s]["loss"] for s in (1, 2, 3))  # it learns
    assert d[1]["loss"] != p[1]["loss"]  # the same batches, attended differently
    assert json.loads((Path(doc.checkpoint_dir) / "model_config.json").read_text())["attention"] == "document"


MUON = with_(CFG, max_steps=10, **{"optimizer.name": "muon", "optimizer.muon_lr": 0.02, "optimizer.grad_clip": 0.0,
                                   "checkpoint.every": 5,
                                   "logging.every": 1, "logging.eval_every": 0})


@pytest.mark.slow
def test_muon_under_zero2_resumes_exactly(tokens, tmp_path):
    """Muon's momentum and the AdamW half's moments are in the checkpoint: 5 steps, a relaunch to 10, loss for
    loss the uninterrupted 10 steps."""
    half = run_train(tokens, with_(MUON, max_steps=5), str(tmp_path / "a"))
    resumed = run_train(tokens, MUON, str(tmp_path / "a"))
    assert resumed.resumed_from == 5 and resumed.run_dir == half.run_dir
    straight = run_train(tokens, MUON, str(tmp_path / "b"))
    got, want = _train(resumed.metrics_path), _train(straight.metrics_path)
    assert [got[s]["loss"] for s in range(1, 11)] == [want[s]["loss"] for s in range(1, 11)]
    assert want[10]["loss"] < 0.9 * want[1]["loss"]


@pytest.mark.slow
@pytest.mark.parametrize("zero", [0, 1, 3])
def test_muon_trains_under_zero(tokens, tmp_path, zero):
    r = run_train(tokens, with_(MUON, **{"engine.zero_stage": zero}), str(tmp_path))
    got = _train(r.metrics_path)
    assert got[10]["loss"] < 0.9 * got[1]["loss"]
    adamw = _train(run_train(tokens, with_(MUON, **{"engine.zero_stage": zero, "optimizer.name": "adamw"}),
                             str(tmp_path)).metrics_path)
    assert got[2]["loss"] != adamw[2]["loss"]  # the first update differs: Muon is in use, not AdamW
