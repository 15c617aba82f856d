"""Hot spares (`train.launch.spares`): a standby world of ranks, built and waiting beside the training ranks, takes
over after a rank failure inside the same run_train call, restoring the newest commit from the memory tier. Run on
the 2-rank ZeRO-2 run of tests/faults.py against an uninterrupted reference run. The takeover runs in CI (two
runs of ~15 s here); the stall, a failing standby and running out of spares are slow-marked:

    LIFECYCLE_SLOW=1 .venv/bin/python -m pytest -m slow tests/train/test_spares.py
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lifecycle.core.procs import group_alive
from lifecycle.tasks.train import memtier
from lifecycle.tasks.train.config import LaunchConfig
from lifecycle.tasks.train.supervise import standby_ready
from tests.faults import kill_rank_with_spare, launch, rank_pids, result, wait_ready

# 300 steps of the tiny model: long enough for the standby to start (~7 s on 2 busy cores) before the run ends
OPTS = {"accelerator": "cpu", "ranks": 2, "precision": "fp32", "max_steps": 300, "launch": {"spares": 1}}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("spares")
    tokdir, workdir = str(tmp / "tokens"), str(tmp / "ref")
    proc = launch(tokdir, workdir, {k: v for k, v in OPTS.items() if k != "launch"})
    proc.communicate()
    assert proc.returncode == 0
    ref = result(workdir)
    assert ref["weights"] is not None
    return tokdir, tmp, ref


def processes_naming(run_dir: Path) -> list[int]:
    """Live processes whose command line names `run_dir` (the ranks: `--config <run_dir>/config.json`)."""
    found = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and str(run_dir).encode() in (d / "cmdline").read_bytes() \
                    and (d / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                found.append(int(d.name))
        except OSError:
            continue
    return found


def run_dir_of(workdir: str) -> Path:
    return next((Path(workdir) / "train").iterdir())


def test_a_standby_world_takes_over_a_killed_rank_from_memory_bitwise_identically(reference):
    tokdir, tmp, ref = reference
    workdir = str(tmp / "killed")
    got = kill_rank_with_spare(tokdir, workdir, OPTS, after_step=15)
    assert got["rc"] == 0  # no failed attempt: the same run_train call finished
    [promotion] = got["promotions"]
    assert promotion["world"] == "spare1" and "rank 1 exited with code -9" in promotion["failure"]
    restore = got["restore"]
    assert restore["tier"] == "memory" and restore["reason"] is None and restore["step"] >= got["killed_after"]
    # seconds, not a relaunch: the standby had its imports, process group and engine before the kill
    assert got["promotion_to_first_step"] is not None and got["promotion_to_first_step"] < 5
    assert result(workdir) == ref  # loss curve and final weights, bit for bit
    run_dir = run_dir_of(workdir)
    log = (run_dir / "train.log").read_text()
    assert "promoted standby world spare1" in log and f"restored step {restore['step']} from memory" in log
    assert "[spare1 standby] ready after" in log
    assert not list(run_dir.glob("heartbeat-spare*")) and not memtier.path_for(run_dir).exists()
    assert not processes_naming(run_dir)  # no rank of either world outlived the run


def test_spares_are_refused_with_a_hostfile(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost slots=2\n")
    with pytest.raises(ValueError, match="spares keeps standby ranks on this host"):
        LaunchConfig(spares=1, hostfile=str(hosts))


def test_another_live_process_arenas_survive_a_prune(tmp_path):
    """A standby rank stages its first arena in the same tier rank directory while the training rank prunes."""
    tier = tmp_path / "tier"
    memtier.rank_dir(tier, 0).mkdir(parents=True)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
        names = [f"arena-{sleeper.pid}-0", f"arena-{int(dead.stdout)}-0", f"arena-{os.getpid()}-3", "step_00000005.idx"]
        for name in names:
            (memtier.rank_dir(tier, 0) / name).write_bytes(b"x")
        keep = memtier.live_arenas(tier, 0, os.getpid())
        assert keep == {f"arena-{sleeper.pid}-0"}  # not a dead process's, not our own dropped one
        memtier.prune_rank(tier, 0, keep)
        assert sorted(p.name for p in memtier.rank_dir(tier, 0).iterdir()) == [f"arena-{sleeper.pid}-0"]
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_group_of_zombies_is_not_alive():
    """A rank's orphaned persist process waits for init to reap it; stopping a world must not wait on that."""
    code = ("import os, subprocess, sys, time\n"
            "os.setpgid(0, 0)\n"
            "child = subprocess.Popen([sys.executable, '-c', 'pass'])\n"
            "time.sleep(0.5)\n"  # the child is a zombie now: nobody waits for it
            "print(os.getpgrp(), flush=True)\n"
            "time.sleep(30)\n")
    leader = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        pgid = int(leader.stdout.readline())
        assert group_alive(pgid)
        os.kill(leader.pid, signal.SIGSTOP)  # a stopped leader is alive
        assert group_alive(pgid)
        os.kill(leader.pid, signal.SIGKILL)
        leader.wait()
        deadline = time.time() + 5
        while group_alive(pgid) and time.time() < deadline:
            time.sleep(0.01)
        assert not group_alive(pgid)  # only its zombie child may be left, waiting for init
    finally:
        leader.kill()
        leader.wait()


def _wait(pred, what: str, timeout: float = 300):
    deadline = time.time() + timeout
    while not pred():
        if time.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _standby_ready(run_dir: Path) -> bool:
    return standby_ready(run_dir, 2, "spare1")


@pytest.mark.slow
def test_a_stalled_rank_is_named_and_its_world_replaced(reference):
    """SIGSTOP, not a crash: the heartbeat watchdog (stall_s 10: a standby starting on 2 cores can hold the
    training ranks for seconds, and 3 s promoted it falsely) names the rank, its world is stopped (resumed to die), and the
    standby takes over; the run still ends bitwise identical."""
    tokdir, tmp, ref = reference
    workdir = str(tmp / "stopped")
    proc = launch(tokdir, workdir, {**OPTS, "launch": {"spares": 1, "stall_s": 10}})
    run_dir = wait_ready(proc, workdir).parent
    _wait(lambda: _standby_ready(run_dir), "the standby")
    os.kill(rank_pids(proc.pid)[0], signal.SIGSTOP)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    [promotion] = [json.loads(line) for line in open(run_dir / "promotions.jsonl")]
    assert "training stalled" in promotion["failure"] and "rank 0" in promotion["failure"]
    assert "stopped" in promotion["failure"]
    assert result(workdir) == ref


@pytest.mark.slow
def test_a_failing_standby_is_dropped_and_the_run_goes_on(reference):
    tokdir, tmp, ref = reference
    workdir = str(tmp / "standby-dies")
    proc = launch(tokdir, workdir, OPTS)
    run_dir = wait_ready(proc, workdir).parent
    _wait(lambda: _standby_ready(run_dir), "the standby")
    os.kill(rank_pids(proc.pid, "spare1")[1], signal.SIGKILL)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    log = (run_dir / "train.log").read_text()
    assert "standby world spare1 failed (rank 1 exited with code -9" in log
    assert "the launch goes on without a standby" in log
    assert not (run_dir / "promotions.jsonl").exists()
    assert result(workdir) == ref


@pytest.mark.slow
def test_failures_past_the_spares_fail_the_attempt_and_the_retry_resumes(reference):
    """spares: 1. The first kill promotes spare1; the second, with no standby left, fails the launch as without
    spares, and the next call (Prefect's retry) resumes from the memory tier."""
    tokdir, tmp, ref = reference
    workdir = str(tmp / "twice")
    opts = OPTS
    proc = launch(tokdir, workdir, opts)
    run_dir = wait_ready(proc, workdir).parent
    _wait(lambda: _standby_ready(run_dir), "the standby")
    os.kill(rank_pids(proc.pid)[1], signal.SIGKILL)
    _wait(lambda: (run_dir / "promotions.jsonl").exists(), "the promotion")
    _wait(lambda: "restored step" in (run_dir / "train.log").read_text(), "the promoted world's restore")
    os.kill(rank_pids(proc.pid, "spare1")[1], signal.SIGKILL)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode != 0
    assert not any(p.is_dir() for p in run_dir.glob("heartbeat-spare2"))  # spares spent: no second standby
    again = launch(tokdir, workdir, opts)
    out, _ = again.communicate(timeout=600)
    assert again.returncode == 0, out
    assert result(workdir) == ref
