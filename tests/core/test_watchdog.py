"""The per-shard watchdog (`run_shard_watched`): a shard that stops making progress is killed, whatever it is
blocked in, and named; a shard that keeps making progress is not; a shard's own error or death crosses the
process boundary as itself; the shard is built again on retry."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pyarrow as pa
import pytest

from lifecycle.core.dataset import DatasetDamaged, StageStats
from lifecycle.core.shards import ShardTimeout, commit_plan, heartbeat, plan_stage, run_shard_watched


def hanging_shard(config: dict, items: list[str], writer) -> StageStats:
    """A test stage: writes its items; `block` blocks (forever) until the file `config['release']` exists,
    `busy` works for `config['busy_s']` with a heartbeat every 50 ms, `raise`/`die` fail, `stop` stops (SIGSTOP)."""
    Path(config["pid"]).write_text(str(os.getpid()))
    if items == ["block"] and not Path(config["release"]).exists():
        Path(config["release"]).touch()  # the next attempt gets through (a transient hang)
        while True:
            time.sleep(3600)  # blocking work no thread timeout can interrupt
    if items == ["busy"]:
        end = time.monotonic() + config["busy_s"]
        while time.monotonic() < end:
            time.sleep(0.05)
            heartbeat()
    if items == ["raise"]:
        raise DatasetDamaged("/x/part-00000.parquet", "sha256 mismatch")
    if items == ["die"]:
        os.kill(os.getpid(), signal.SIGKILL)
    if items == ["stop"]:
        os.kill(os.getpid(), signal.SIGSTOP)
    if items == ["kill_worker"] and not Path(config["release"]).exists():  # once: the process that forked us
        Path(config["release"]).touch()
        os.kill(os.getppid(), signal.SIGKILL)
        time.sleep(3600)  # PR_SET_PDEATHSIG ends this one
    writer.write_table(pa.table({"item": items}))
    return StageStats(rows_in=len(items), rows_kept=len(items))


def _plan(tmp_path: Path, shards: list[list[str]], **cfg):
    config = {"pid": str(tmp_path / "pid"), "release": str(tmp_path / "release"), **cfg}
    return plan_stage(tmp_path / "w", "hangs", config, "v1", hanging_shard, shards)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_blocked_shard_is_killed_within_the_bound_then_rebuilt(tmp_path):
    plan = _plan(tmp_path, [["a"], ["block"], ["c"]])
    assert run_shard_watched(plan, 0, timeout_s=2)["rows_kept"] == 1
    t = time.monotonic()
    with pytest.raises(ShardTimeout) as err:
        run_shard_watched(plan, 1, timeout_s=2)
    assert time.monotonic() - t < 6  # 2 s without progress, checked every 0.5 s
    assert "hangs: shard 1 of 3 made no progress for 2 s" in str(err.value)
    assert "orchestration.shard_timeout_s" in str(err.value) and "block" in str(err.value)
    pid = int((tmp_path / "pid").read_text())
    assert pid != os.getpid() and not _alive(pid)  # the blocked process is gone, not leaked
    assert not list(plan.building.glob(".tmp-*"))  # its half-written output too
    assert plan.done_shards() == [0]
    # the retry builds it (the hang was transient), the finished shard is reused, and the stage commits
    assert run_shard_watched(plan, 1, timeout_s=2)["reused"] is False
    assert run_shard_watched(plan, 0, timeout_s=2)["reused"] is True
    run_shard_watched(plan, 2, timeout_s=2)
    ref = commit_plan(plan)
    assert ref.read().column("item").to_pylist() == ["a", "block", "c"]


def test_stopped_shard_process_is_killed(tmp_path):
    plan = _plan(tmp_path, [["stop"]])
    with pytest.raises(ShardTimeout, match="hangs: shard 0 of 1 made no progress for 2 s"):
        run_shard_watched(plan, 0, timeout_s=2)
    assert not _alive(int((tmp_path / "pid").read_text()))


def test_shard_that_keeps_beating_outlives_the_bound(tmp_path):
    plan = _plan(tmp_path, [["busy"]], busy_s=4)
    assert run_shard_watched(plan, 0, timeout_s=2)["rows_kept"] == 1


def test_a_shard_that_keeps_beating_is_still_killed_at_the_stage_timeout(tmp_path):
    plan = _plan(tmp_path, [["busy"]], busy_s=30)
    t = time.monotonic()
    with pytest.raises(ShardTimeout, match=r"hangs: shard 0 of 1 ran for more than 2 s \(orchestration.stage_timeout_s\)"):
        run_shard_watched(plan, 0, timeout_s=20, limit_s=2)
    assert time.monotonic() - t < 8
    assert not _alive(int((tmp_path / "pid").read_text())) and not plan.done_shards()


def test_shard_errors_and_deaths_cross_the_process_as_themselves(tmp_path):
    plan = _plan(tmp_path, [["raise"], ["die"]])
    with pytest.raises(DatasetDamaged) as err:  # a permanent error stays permanent (not retried by the flow)
        run_shard_watched(plan, 0, timeout_s=5)
    assert err.value.problem == "sha256 mismatch" and "in shard process" in "".join(err.value.__notes__)
    with pytest.raises(RuntimeError, match=r"hangs: the process of shard 1 of 2 died \(killed by signal SIGKILL\)"):
        run_shard_watched(plan, 1, timeout_s=5)
    assert not plan.done_shards()


def test_unwatched_shard_runs_in_this_process(tmp_path):
    plan = _plan(tmp_path, [["a"]])
    run_shard_watched(plan, 0, timeout_s=None)
    assert int((tmp_path / "pid").read_text()) == os.getpid()
