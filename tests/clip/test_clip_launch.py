"""One launched run: clip_train starts 2 real DeepSpeed ranks (DS_ACCELERATOR=cpu, gloo, ZeRO-2) on the tiny
dataset, commits steps 2 and 4 with the text trainer's protocol; with step 4's commit and the stage's dataset
gone (a crash after step 2's commit), a rerun resumes from step 2 and ends with the same weights, byte for byte;
clip_evaluate then scores the held-out pairs."""

from __future__ import annotations

import shutil

from lifecycle.core.fs import sha256_file
from lifecycle.tasks.clip.config import ClipEvalConfig, ClipTrainConfig
from lifecycle.tasks.clip.evaluate.stage import run_clip_evaluate
from lifecycle.tasks.clip.train.stage import run_clip_train
from lifecycle.tasks.train import commit
from tests.clip.test_clip import TINY


def test_two_ranks_commit_resume_exactly_and_are_evaluated(shards, tmp_path):
    cfg = ClipTrainConfig(model=TINY.model_copy(update={"vocab_size": 0}), steps=4, save_every=2, micro_batch=4,
                          ranks=2, zero_stage=2, workers=1, threads_per_rank=1, holdout=0.25)
    first = run_clip_train(shards, cfg, str(tmp_path))
    ckpt_root = first.manifest()["checkpoint"].rsplit("/", 1)[0]
    assert [s for s, _ in commit.list_committed(ckpt_root)] == [2, 4] and first.manifest()["resumed_from"] is None
    weights = sha256_file(first.dir / "model.safetensors")
    figures = first.manifest()["metrics"]
    assert figures["steps"] == 4 and 0 <= figures["stall_fraction"] < 1 and figures["final_loss"] > 0

    assert run_clip_train(shards, cfg, str(tmp_path)).reused  # done: nothing launched
    commit.remove(f"{ckpt_root}/{commit.tag_name(4)}")
    shutil.rmtree(first.dir)
    again = run_clip_train(shards, cfg, str(tmp_path))
    assert again.manifest()["resumed_from"] == 2 and not again.reused
    assert sha256_file(again.dir / "model.safetensors") == weights

    scores = run_clip_evaluate(again, shards, ClipEvalConfig(), str(tmp_path)).manifest()["metrics"]
    n = scores["heldout_pairs"]
    assert n >= 2 and scores["heldout_chance_at_1"] == 1 / n
    assert 0 <= scores["heldout_i2t_recall_at_1"] <= scores["heldout_i2t_recall_at_5"] <= 1
