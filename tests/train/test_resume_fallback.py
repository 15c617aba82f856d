"""The console names a damaged DeepSpeed `.pt` file the ranks fell back from (issue 44, 6: 8c6205f said it only
in train.log while training silently restarted earlier)."""

from lifecycle.tasks.train import commit
from lifecycle.tasks.train.resume import fallback_note


def test_a_damaged_commit_is_named_with_the_steps_trained_again(tmp_path):
    """The damaged commits come from the restore record (commit.latest_valid lists what it passes over)."""
    tag = tmp_path / commit.tag_name(8)
    tag.mkdir(parents=True)
    (tag / "mp_rank_00_model_states.pt").write_bytes(bytes(range(256)) * 4)
    commit.commit(tag, 8)
    pt = tag / "mp_rank_00_model_states.pt"
    data = bytearray(pt.read_bytes())
    data[100] ^= 0xFF  # a flipped bit: the size still matches, the hash does not
    pt.write_bytes(bytes(data))
    damaged: list[str] = []
    assert commit.latest_valid(tmp_path, damaged=damaged) is None
    assert damaged == [f"{tag} (mp_rank_00_model_states.pt: sha256 mismatch)"]
    assert fallback_note(damaged, 8, 8) is None and fallback_note([], 8, 4) is None
    assert fallback_note(damaged, 8, 4) == (f"damaged checkpoint {tag} (mp_rank_00_model_states.pt: sha256 "
                                            "mismatch): training resumed from step 4 instead of step 8 and trains "
                                            "4 steps again")
    note = fallback_note(damaged, 8, None)
    assert note is not None and "from step 0 (no valid commit left)" in note and "trains 8 steps again" in note


import pytest  # noqa: E402


@pytest.mark.slow  # two launches of 2 ranks
def test_run_train_says_on_the_console_which_damaged_commit_it_fell_back_from(tmp_path, caplog):
    """Through the real supervisor and ranks: the step-20 commit's model states get a flipped byte (same size), a
    longer rerun starts, the ranks fall back to step 10, and the supervisor's log (the console) names the file."""
    import logging

    from lifecycle.tasks.train.launch import run_train
    from tests.train.test_train import CFG, make_tokens, with_

    tokens = make_tokens(tmp_path / "tok", 600)
    cfg = with_(CFG, max_steps=20, **{"checkpoint.every": 10, "checkpoint.async_save": False,
                                      "optimizer.decay_steps": 40})
    first = run_train(tokens, cfg, str(tmp_path / "w"))
    pt = __import__("pathlib").Path(first.checkpoint_dir) / "mp_rank_00_model_states.pt"
    data = bytearray(pt.read_bytes())
    data[len(data) // 2] ^= 0xFF
    pt.write_bytes(bytes(data))
    logger = logging.getLogger("lifecycle.tasks.train.launch")
    logger.addHandler(caplog.handler)  # the lifecycle loggers may not propagate to the root's handler
    try:
        again = run_train(tokens, with_(cfg, max_steps=30), str(tmp_path / "w"))
    finally:
        logger.removeHandler(caplog.handler)
    assert again.resumed_from == 10
    assert any("damaged checkpoint" in r.message and "mp_rank_00_model_states.pt" in r.message
               and "instead of step 20" in r.message for r in caplog.records)
