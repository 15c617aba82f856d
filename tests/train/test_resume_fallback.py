"""The console names a damaged DeepSpeed `.pt` file the ranks fell back from (issue 44, 6: 8c6205f said it only
in train.log while training silently restarted earlier)."""

from lifecycle.tasks.train import commit
from lifecycle.tasks.train.resume import fallback_note


def _commit(root, step: int):
    tag = root / commit.tag_name(step)
    tag.mkdir(parents=True)
    (tag / "mp_rank_00_model_states.pt").write_bytes(bytes(range(256)) * 4)
    commit.commit(tag, step)
    return tag


def test_a_damaged_pt_file_is_named_with_the_steps_trained_again(tmp_path):
    _commit(tmp_path, 4)
    newest = _commit(tmp_path, 8)
    assert fallback_note(tmp_path, 8, 8) is None  # the newest was restored
    pt = newest / "mp_rank_00_model_states.pt"
    data = bytearray(pt.read_bytes())
    data[100] ^= 0xFF  # a flipped bit: the size still matches, the hash does not
    pt.write_bytes(bytes(data))
    assert fallback_note(tmp_path, 8, 4) == (f"damaged checkpoint {newest} (mp_rank_00_model_states.pt: sha256 "
                                             "mismatch): training resumed from step 4 instead of step 8 and trains "
                                             "4 steps again")
    note = fallback_note(tmp_path, 8, None)
    assert note is not None and "from step 0 (no valid commit left)" in note and "trains 8 steps again" in note
