"""The commit protocol on plain files (the DeepSpeed side runs for real in test_train.py)."""

import json
import logging
from pathlib import Path

import pytest
import torch

from lifecycle.core.fs import sha256_file
from lifecycle.tasks.train import commit as ckpt
from lifecycle.tasks.train.model import GPT, ModelConfig


def make_tag(root: Path, step: int, committed: bool = True, payload: bytes = b"") -> Path:
    d = root / ckpt.tag_name(step)
    (d / "sub").mkdir(parents=True)
    (d / "mp_rank_00_model_states.pt").write_bytes(payload or f"weights at {step}".encode() * 100)
    (d / "sub" / "zero_pp_rank_1_optim_states.pt").write_bytes(f"optimizer {step}".encode())
    if committed:
        ckpt.commit(d, step, {"loss": 1.0 / step})
    return d


def test_marker_lists_every_file_with_hash_and_size(tmp_path):
    d = make_tag(tmp_path, 10)
    marker = ckpt.read_marker(d)
    assert marker["step"] == 10 and marker["loss"] == 0.1
    assert {f["path"] for f in marker["files"]} == {"mp_rank_00_model_states.pt", "sub/zero_pp_rank_1_optim_states.pt"}
    assert all(len(f["sha256"]) == 64 and f["bytes"] > 0 for f in marker["files"])
    assert not list(d.glob("*.tmp"))
    assert ckpt.verify(d) is None


def test_uncommitted_tag_does_not_exist(tmp_path):
    make_tag(tmp_path, 10)
    make_tag(tmp_path, 20)
    make_tag(tmp_path, 30, committed=False)  # crashed before its marker
    (tmp_path / "not_a_tag").mkdir()
    assert [s for s, _ in ckpt.list_committed(tmp_path)] == [10, 20]
    assert ckpt.latest_valid(tmp_path) == tmp_path / "step_00000020"
    assert ckpt.verify(tmp_path / "step_00000030") == "no commit marker"
    assert ckpt.latest_valid(tmp_path / "missing") is None


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "marker"])
def test_damaged_commit_falls_back_to_previous(tmp_path, caplog, damage):
    make_tag(tmp_path, 10)
    d = make_tag(tmp_path, 20)
    target = d / "mp_rank_00_model_states.pt"
    if damage == "flip":
        data = bytearray(target.read_bytes())
        data[7] ^= 0xFF
        target.write_bytes(bytes(data))
    elif damage == "truncate":
        target.write_bytes(target.read_bytes()[:-1])
    elif damage == "delete":
        target.unlink()
    else:
        (d / ckpt.MARKER).write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="lifecycle.tasks.train.commit"):
        assert ckpt.latest_valid(tmp_path) == tmp_path / "step_00000010"
    expected = {"flip": "sha256 mismatch", "truncate": "bytes", "delete": "missing file", "marker": "unreadable marker"}
    assert expected[damage] in caplog.text and "step_00000020" in caplog.text
    # sizes only (the supervisor before a launch: the ranks hash what they load): a flipped byte passes
    sizes_only = ckpt.latest_valid(tmp_path, hashes=False)
    assert sizes_only == tmp_path / ("step_00000020" if damage == "flip" else "step_00000010")


def test_latest_valid_respects_max_step(tmp_path):
    for s in (10, 20, 30):
        make_tag(tmp_path, s)
    assert ckpt.latest_valid(tmp_path, max_step=25) == tmp_path / "step_00000020"
    assert ckpt.latest_valid(tmp_path, max_step=5) is None


def test_marker_for_another_step_is_rejected(tmp_path):
    d = make_tag(tmp_path, 10)
    d.rename(tmp_path / "step_00000040")
    assert "marker step 10" in ckpt.verify(tmp_path / "step_00000040")


def test_prune_keeps_last_k_and_clears_crash_leftovers(tmp_path):
    for s in (10, 20, 30, 40):
        make_tag(tmp_path, s)
    make_tag(tmp_path, 25, committed=False)  # leftover of a crash, older than the newest commit
    make_tag(tmp_path, 50, committed=False)  # possibly being written: newer than every commit
    gone = ckpt.prune(tmp_path, keep_last=2, keep=(tmp_path / "step_00000010",))
    assert {p.name for p in gone} == {"step_00000020", "step_00000025"}
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["step_00000010", "step_00000030", "step_00000040", "step_00000050"]
    with pytest.raises(ValueError):
        ckpt.prune(tmp_path, keep_last=0)


def test_model_weights_round_trip_through_safetensors(tmp_path):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=50, n_layer=1, n_head=2, n_embd=16, seq_len=8)
    model = GPT(cfg).eval()
    d = tmp_path / ckpt.tag_name(7)
    d.mkdir()
    written = ckpt.write_model(d, model.export_state(), cfg)
    assert written == {p.name: (sha256_file(p), p.stat().st_size) for p in d.iterdir()}
    ckpt.commit(d, 7, known=written)
    assert json.loads((d / ckpt.MODEL_CONFIG).read_text())["vocab_size"] == 50
    loaded = ckpt.load_model(d)
    assert loaded.cfg == cfg and not loaded.training
    idx = torch.randint(0, 50, (2, 8))
    torch.testing.assert_close(loaded(idx)[0], model(idx)[0])
    # a damaged weights file is refused, never silently loaded
    data = bytearray((d / ckpt.WEIGHTS).read_bytes())
    data[-3] ^= 0x01
    (d / ckpt.WEIGHTS).write_bytes(bytes(data))
    with pytest.raises(ValueError, match="sha256 mismatch"):
        ckpt.load_model(d)


def test_safetensors_written_from_the_tensors_memory_match_safetensors_own(tmp_path):
    from safetensors.torch import load_file, save

    cfg = ModelConfig(vocab_size=50, n_layer=2, n_head=2, n_embd=16, seq_len=8)
    state = GPT(cfg).export_state()
    d = tmp_path / ckpt.tag_name(1)
    d.mkdir()
    ckpt.write_model(d, state, cfg)
    assert (d / ckpt.WEIGHTS).read_bytes() == save(state, metadata={"format": "pt"})  # fp32: the same bytes
    mixed = {"b": torch.ones(3, dtype=torch.bfloat16), "a": torch.randn(4, 5), "z": torch.arange(7),
             "m": torch.tensor([True, False]), "e": torch.zeros(0), "s": torch.tensor(2.5, dtype=torch.float64),
             "t": torch.arange(12.0).view(3, 4).t()}  # non-contiguous: written as its contiguous copy
    path = tmp_path / "mixed.safetensors"
    with ckpt.hashed_atomic_file(path) as w:
        ckpt.write_safetensors(w, mixed, {"format": "pt"})
    assert w.digest() == (sha256_file(path), path.stat().st_size)
    got = load_file(str(path))
    assert set(got) == set(mixed) and all(got[k].dtype == v.dtype and torch.equal(got[k], v) for k, v in mixed.items())


def test_remove_uncommits_first(tmp_path):
    d = make_tag(tmp_path, 10)
    ckpt.remove(d)
    assert not d.exists() and ckpt.list_committed(tmp_path) == []
    with pytest.raises(ValueError):
        ckpt.step_of(tmp_path / "latest")


def test_commit_takes_known_digests_and_checks_their_size(tmp_path, monkeypatch):
    monkeypatch.setattr(ckpt.time, "strftime", lambda *a: "2026-01-01T00:00:00Z")
    d = make_tag(tmp_path, 10)
    hashed = ckpt.read_marker(d)
    known = {f["path"]: (f["sha256"], f["bytes"]) for f in hashed["files"]}
    rehashed = []
    monkeypatch.setattr(ckpt, "sha256_file", lambda p: rehashed.append(p.name) or sha256_file(p))
    assert ckpt.commit(d, 10, {"loss": 0.1}, known=known) == hashed and rehashed == []
    # only what the writers did not report is hashed here
    part = {"mp_rank_00_model_states.pt": known["mp_rank_00_model_states.pt"]}
    assert ckpt.commit(d, 10, {"loss": 0.1}, known=part) == hashed
    assert rehashed == ["zero_pp_rank_1_optim_states.pt"] and ckpt.verify(d) is None
    # a reported file whose size on disk differs, or that is gone, is refused: nothing is committed
    ckpt.remove(d)
    d = make_tag(tmp_path, 20, committed=False)
    sha, size = known["mp_rank_00_model_states.pt"]
    with pytest.raises(ValueError, match="bytes on disk, its writer wrote"):
        ckpt.commit(d, 20, known={"mp_rank_00_model_states.pt": (sha, size + 1)})
    with pytest.raises(ValueError, match="missing"):
        ckpt.commit(d, 20, known={"sub/gone.pt": (sha, size)})
    assert ckpt.verify(d) == "no commit marker"


def test_hashing_writer_digest_matches_the_file(tmp_path):
    data = bytes(range(256)) * 9000  # > 2 chunks
    digest = ckpt.write_bytes_hashed(tmp_path / "f.bin", memoryview(data))
    assert digest == (sha256_file(tmp_path / "f.bin"), len(data)) and (tmp_path / "f.bin").read_bytes() == data
    assert ckpt.write_bytes_hashed(tmp_path / "empty", b"") == (sha256_file(tmp_path / "empty"), 0)
