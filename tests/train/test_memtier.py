"""Recovery from the in-memory checkpoint tier and `checkpoint.every: auto`, on the 2-rank ZeRO-2 run of
tests/faults.py, against one uninterrupted reference run (fixed interval 5, tier on). Each run is about a
minute on 2 shared cores, so these are slow-marked:

    LIFECYCLE_SLOW=1 .venv/bin/python -m pytest -m slow tests/train/test_memtier.py

The tier's own checks (restore equals the disk copy, a flipped byte or an older tier falls back to disk, dead
runs' tiers released) run in seconds in tests/train/test_checkpointer.py.
"""

import os
import re
from pathlib import Path

import pytest

from lifecycle.tasks.train import memtier
from tests.faults import kill_rank_and_relaunch, launch, records, result

OPTS = {"accelerator": "cpu", "ranks": 2, "precision": "fp32"}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("memtier")
    tokdir, workdir = str(tmp / "tokens"), str(tmp / "ref")
    proc = launch(tokdir, workdir, OPTS)
    proc.communicate()
    assert proc.returncode == 0
    ref = result(workdir)
    assert ref["weights"] is not None
    return tokdir, tmp, ref


def tier_of(workdir: str) -> Path:
    return memtier.path_for(next((Path(workdir) / "train").iterdir()))


@pytest.mark.slow
def test_a_killed_rank_is_relaunched_from_memory_bitwise_identically(reference):
    tokdir, tmp, ref = reference
    workdir = str(tmp / "killed")
    got = kill_rank_and_relaunch(tokdir, workdir, OPTS, after_step=15)
    assert got["failed_rc"] != 0 and got["rc"] == 0  # the rank's death failed the attempt; the retry completed
    restore = got["restore"]
    assert restore["tier"] == "memory" and restore["reason"] is None and restore["step"] >= got["killed_after"]
    log = next(Path(workdir).glob("train/*/train.log")).read_text()
    assert f"restored step {restore['step']} from memory" in log
    assert result(workdir) == ref  # loss curve and final weights, bit for bit
    assert not tier_of(workdir).exists()  # the successful run gave its memory back


@pytest.mark.slow
def test_memory_tier_off_restores_from_disk_bitwise_identically(reference):
    tokdir, tmp, ref = reference
    workdir = str(tmp / "disk")
    opts = {**OPTS, "checkpoint": {"memory_tier": False}}
    got = kill_rank_and_relaunch(tokdir, workdir, opts, after_step=15)
    assert got["rc"] == 0 and got["restore"]["tier"] == "disk" and got["restore"]["reason"] == "memory tier off"
    assert result(workdir) == ref
    assert not tier_of(workdir).exists()


@pytest.mark.slow
def test_auto_interval_is_chosen_logged_and_leaves_the_trajectory_alone(reference):
    tokdir, tmp, ref = reference
    workdir = str(tmp / "auto")
    proc = launch(tokdir, workdir, {**OPTS, "checkpoint": {"every": "auto", "auto_overhead": 0.2}})
    proc.communicate()
    assert proc.returncode == 0
    chosen = records(workdir, "checkpoint_interval")
    assert chosen and chosen[0]["step"] == 5  # the probe save, 5 steps into the launch
    for r in chosen:
        assert r["interval"] >= 1 and r["stall"] > 0 and r["step_time"] > 0 and r["overhead"] == 0.2
    first = chosen[0]  # the rule (later ones take the median stall): saving costs at most the share of training
    assert first["stall"] / (first["interval"] * first["step_time"]) <= 0.2 + 1e-9
    assert first["interval"] == 1 or first["stall"] / ((first["interval"] - 1) * first["step_time"]) > 0.2
    log = next(Path(workdir).glob("train/*/train.log")).read_text()
    assert f"checkpoint interval (auto): {chosen[0]['interval']} steps" in log
    # the saves after the probe follow the chosen intervals; max_steps always commits
    saves = [int(s) for s in re.findall(r"save stall [\d.]+s at step (\d+)", log)]
    expected, step = [5], 5
    for r in chosen:
        step = r["step"] + r["interval"]
        if step < 40:
            expected.append(step)
    assert saves == sorted(set(expected + [40]))
    assert result(workdir)["weights"] == ref["weights"] and result(workdir)["losses"] == ref["losses"]
    assert os.path.exists(next(Path(workdir).glob("train/*/checkpoints/step_00000040/COMMITTED.json")))


def test_read_checked_reads_once_and_checks_the_crc_across_pieces(tmp_path, monkeypatch):
    import zlib

    import numpy as np

    monkeypatch.setattr(memtier, "PIECE", 1000)  # several pieces per read, one short last piece
    data = np.random.default_rng(0).integers(0, 256, 10_500, dtype=np.uint8).tobytes()
    path = tmp_path / "arena"
    path.write_bytes(b"H" * 64 + data)
    want = f"{zlib.crc32(data):08x}"
    assert memtier.checksum(b"H" * 64 + data, 64, 64 + len(data)) == want
    fd = os.open(path, os.O_RDONLY)
    try:
        dest = bytearray(len(data))
        assert memtier.read_checked(fd, dest, 64, want) and bytes(dest) == data
        assert not memtier.read_checked(fd, bytearray(len(data)), 63, want)  # other bytes
        assert not memtier.read_checked(fd, bytearray(len(data) + 1), 64, want)  # past the end of the arena
    finally:
        os.close(fd)
