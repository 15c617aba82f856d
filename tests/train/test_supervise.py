"""No training wait is unbounded (lifecycle.tasks.train.supervise, heartbeats, launcher; lifecycle.core.procs): a
stale JIT build lock is removed, a shared-memory buffer is released only by the run that owns it, the ranks die
with their supervisor, and a rank that stops stepping fails the launch naming it. Fast unit tests first, then
real 2-rank DeepSpeed launches (20-60 s each on 2 cores) in a private TORCH_EXTENSIONS_DIR."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from lifecycle.core.procs import start_time
from lifecycle.tasks.train import heartbeats
from lifecycle.tasks.train import launcher
from lifecycle.tasks.train import supervise as sv
from lifecycle.tasks.train.launch import run_train
from tests.faults import ROOT, descendants_of_supervisor
from tests.train.test_train import CFG, tokens, with_  # noqa: F401  (tokens: the module-scoped fixture)


def _buffers(*ports: int, addr: str = "127.0.0.1") -> list[Path]:
    paths = [sv.SHM_DIR / f"{sv.SHM_PREFIX}_{os.getuid()}_{addr}_{port}_{rank}" for port in ports for rank in (0, 1)]
    for p in paths:
        p.write_bytes(b"\0" * 4096)
    return paths


def _sleeper(**kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], **kw)


def _dead_process() -> tuple[int, int]:
    """(pid, start time) of a process that has exited."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    started = start_time(p.pid)
    p.wait()
    return p.pid, started


# --------------------------------------------------------------------------------------------------
# fast


def test_release_shm_releases_exactly_one_ports_buffers():
    mine, other = _buffers(61001), _buffers(61002)
    foreign = sv.SHM_DIR / f"{sv.SHM_PREFIX}_{os.getuid()}_127.0.0.1_610010_0"  # a port that only starts alike
    foreign.write_bytes(b"\0")
    try:
        assert sorted(sv.release_shm(61001)) == sorted(p.name for p in mine)
        assert not any(p.exists() for p in mine) and all(p.exists() for p in other) and foreign.exists()
    finally:
        for p in (*mine, *other, foreign):
            p.unlink(missing_ok=True)


def test_ownership_releases_a_dead_supervisors_buffers_never_a_live_ones(tmp_path):
    """Supervisor A died on port 61011 (its buffers go); B lives on 61012 (its buffers stay, though nothing maps
    them yet); C died on 61012 before B reused the port (B's buffers stay)."""
    sup = tmp_path / "supervisors"
    sup.mkdir()
    live = _sleeper()
    dead_a, dead_c = _dead_process(), _dead_process()
    records = {"a": (*dead_a, 61011), "b": (live.pid, start_time(live.pid), 61012), "c": (*dead_c, 61012)}
    import json

    for name, (pid, started, port) in records.items():
        (sup / f"{pid}.json").write_text(json.dumps({"pid": pid, "start": started, "port": port}))
    (sup / "99999999.json").write_text('{"pid": 9')  # torn by a kill mid-write
    a, b, own = _buffers(61011), _buffers(61012), _buffers(61013)
    try:
        owner = sv.Ownership(61013, tmp_path)
        released = owner.claim()
        assert sorted(released) == sorted(p.name for p in a) and not any(p.exists() for p in a)
        assert all(p.exists() for p in b + own)
        assert sorted(p.name for p in sup.glob("*.json")) == sorted([f"{live.pid}.json", f"{os.getpid()}-61013.json"])
        # a recycled pid is not the supervisor that wrote the record: the start time differs
        (sup / f"{live.pid}.json").write_text(json.dumps({"pid": live.pid, "start": start_time(live.pid) - 1, "port": 61012}))
        assert sorted(sv.Ownership(61013, tmp_path).claim()) == sorted(p.name for p in b)
        assert sorted(owner.release()) == sorted(p.name for p in own) and not owner.path.exists()
    finally:
        live.kill()
        live.wait()
        for p in (*a, *b, *own):
            p.unlink(missing_ok=True)


def _named(name: str, tmp_path: Path, **kw) -> subprocess.Popen:
    """A process whose program file is called `name` (a copy of sleep), sleeping 60 s."""
    exe = tmp_path / "bin" / name
    exe.parent.mkdir(exist_ok=True)
    shutil.copy(shutil.which("sleep"), exe)
    return subprocess.Popen([str(exe), "60"], **kw)


def test_a_stale_build_lock_is_removed_and_a_live_builds_lock_is_kept(tmp_path, caplog):
    build = tmp_path / sv.SHM_OP
    build.mkdir()
    (build / "lock").touch()
    for name in ("ninja", "x86_64-linux-gnu-g++-12", "cc1plus"):  # ninja and the compilers run inside the build dir
        builder = _named(name, tmp_path, cwd=build)
        try:
            assert sv.clear_stale_build_locks(tmp_path, settle_s=0.1) == [] and (build / "lock").exists(), name
            assert "a compiler or ninja works there" in sv.build_lock_note(tmp_path)
        finally:
            builder.kill()
            builder.wait()
    with caplog.at_level(logging.WARNING):
        assert sv.clear_stale_build_locks(tmp_path, settle_s=0.1) == [build / "lock"]
    assert not (build / "lock").exists() and str(build / "lock") in caplog.text
    tagged = tmp_path / "py311_cpu" / sv.SHM_OP  # torch's default root has a <py>_<accelerator> level
    tagged.mkdir(parents=True)
    (tagged / "lock").touch()
    assert sv.clear_stale_build_locks(tmp_path, settle_s=0.1) == [tagged / "lock"]
    assert sv.build_lock_note(tmp_path) == ""


def test_a_shell_parked_in_the_build_folder_does_not_keep_a_stale_lock(tmp_path):
    """Issue 44, 4: on 8c6205f any process with its cwd (or an argument) in the build folder kept the lock live, and
    the ranks waited on it for 2 x 900 s; only a compiler or ninja does now."""
    build = tmp_path / sv.SHM_OP
    build.mkdir()
    (build / "lock").touch()
    shells = [_named("bash", tmp_path, cwd=build), _sleeper(cwd=build), _named("less", tmp_path, cwd=tmp_path)]
    try:
        note = sv.build_lock_note(tmp_path)
        assert note == (f"; torch's JIT build lock exists, and every rank waits while it does: {build / 'lock'} (no "
                        "compiler or ninja works there: stale, remove it)")
        assert sv.clear_stale_build_locks(tmp_path, settle_s=0.1) == [build / "lock"]
    finally:
        for p in shells:
            p.kill()
            p.wait()


def test_the_prebuild_timeout_names_the_lock(tmp_path, monkeypatch):
    """A build that waits past its bound on a lock says which lock (8c6205f named only the extensions folder)."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    build = tmp_path / sv.SHM_OP
    build.mkdir()
    (build / "lock").touch()
    compiler = _named("ninja", tmp_path, cwd=build)  # a live build holds it: kept, and the op build waits
    try:
        with pytest.raises(RuntimeError) as err:
            sv.prebuild_shm_op("cpu", {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}, timeout_s=3)
    finally:
        compiler.kill()
        compiler.wait()
    assert str(err.value) == (f"building DeepSpeed's CPU shm op did not finish in 3 s under {tmp_path}; torch's JIT "
                              f"build lock exists, and every rank waits while it does: {build / 'lock'} (a compiler "
                              "or ninja works there)")


def test_heartbeats_bound_start_up_and_steps_and_name_the_stopped_rank(tmp_path):
    beats = heartbeats.Heartbeats(tmp_path, ranks=2, stall_s=5, startup_s=100)
    t0 = beats.started
    for r in range(2):  # alive (`start_alive_beat`) but no step yet: start-up's own bound
        heartbeats.alive_path(tmp_path, r).write_text(f'{{"time": {t0 + 98}, "pid": {os.getpid()}}}')
    assert beats.check(t0 + 99) is None  # still starting, no heartbeat yet
    assert "rank(s) 0, 1 sent no heartbeat 101 s after the launch (train.launch.startup_s=100)" in beats.check(t0 + 101)
    stopped, running = _sleeper(), _sleeper()
    try:
        os.kill(stopped.pid, signal.SIGSTOP)
        while heartbeats._state(stopped.pid) != "stopped":  # the signal is delivered asynchronously
            time.sleep(0.01)
        for rank, pid in ((0, running.pid), (1, stopped.pid)):
            for step in range(1, 4):
                heartbeats.write_heartbeat(tmp_path, rank, step, step_time=1.0, pid=pid)
        now = time.time()
        assert beats.check(now + 9) is None  # 10 x the median step time (1 s) is above stall_s
        assert beats.stall_bound() == 10
        msg = beats.check(now + 11)
        assert msg.startswith("training stalled: no step for more than 10 s: rank 1 (pid %d, stopped) last step 3"
                              % stopped.pid), msg
        assert f"rank 0 (pid {running.pid}, running) last step 3" in msg
    finally:
        for p in (stopped, running):
            p.kill()
            p.wait()
    assert heartbeats.Heartbeats(tmp_path, ranks=2, stall_s=5, startup_s=100).read() == {}  # a new launch starts clean


def test_a_rank_silent_in_start_up_is_named_after_stall_s_not_startup_s(tmp_path):
    """Before the first step there is no step heartbeat; the rank's liveness beat (a thread from its first lines)
    shows it alive. A SIGSTOPped rank's beat goes quiet, and the launch stalls after stall_s (chaos round 12 on
    1cd513d: a rank stopped during start-up held the run for the whole startup_s, 900 s)."""
    beats = heartbeats.Heartbeats(tmp_path, ranks=2, stall_s=6, startup_s=100)
    t0 = beats.started
    assert beats.check(t0 + 5) is None
    msg = beats.check(t0 + 7)  # no rank has said anything since the launch
    assert msg == ("training stalled in start-up, before the first step: rank 0 gave no sign of life 7 s after the "
                   "launch; rank 1 gave no sign of life 7 s after the launch (train.launch.stall_s=6)"), msg
    cmd = [sys.executable, "-c", "import sys, time; from lifecycle.tasks.train.heartbeats import rank_alive_beat; "
           "rank_alive_beat(sys.argv); time.sleep(60)", "--config", str(tmp_path / "config.json")]
    ranks = [subprocess.Popen(cmd, env={**os.environ, "RANK": str(r)}) for r in range(2)]
    try:
        while not all(heartbeats.alive_path(tmp_path, r).exists() for r in range(2)):
            time.sleep(0.05)
        time.sleep(0.2)
        assert beats.check() is None  # both alive, no step yet
        os.kill(ranks[1].pid, signal.SIGSTOP)
        stopped_at = time.time()
        while (msg := beats.check()) is None:
            assert time.time() - stopped_at < 6 + heartbeats.ALIVE_EVERY_S + 5, "the stopped rank was not named"
            time.sleep(0.2)
        assert msg.startswith(f"training stalled in start-up, before the first step: rank 1 (pid {ranks[1].pid}, "
                              "stopped) silent for "), msg
        assert "rank 0" not in msg  # it is alive: its beat goes on
        heartbeats.write_heartbeat(tmp_path, 0, 1, step_time=0.5)
        heartbeats.write_heartbeat(tmp_path, 1, 1, step_time=0.5)
        assert beats.check() is None  # past the first step the step heartbeats judge (bound: stall_s)
    finally:
        for p in ranks:
            p.kill()
            p.wait()


RANKENV = """import json, os, sys
from pathlib import Path
Path(sys.argv[1], "env" + os.environ["RANK"] + ".json").write_text(json.dumps({**os.environ, "argv": sys.argv[1:]}))
"""


def test_local_ranks_get_exactly_the_environment_and_arguments_of_deepspeeds_launcher(tmp_path):
    """`--module --no_local_rank` through deepspeed/launcher/launch.py (what run_train started before) and
    `Launch.start_local` (what it starts now) give each rank the same environment and the same arguments."""
    import base64
    import json

    (tmp_path / "rankenv.py").write_text(RANKENV)
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    world = base64.urlsafe_b64encode(json.dumps({"localhost": [0, 1]}).encode()).decode()
    theirs, ours = tmp_path / "deepspeed", tmp_path / "ours"
    theirs.mkdir(), ours.mkdir()
    subprocess.run([sys.executable, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={world}",
                    "--master_addr=127.0.0.1", "--master_port=29517", "--module", "--no_local_rank", "rankenv",
                    str(theirs)], env=env, check=True, capture_output=True, timeout=300)
    with open(tmp_path / "log", "ab") as log:
        launch = launcher.Launch.start_local([sys.executable, "-u", "-m", "rankenv", str(ours)],
                                       launcher.local_rank_envs(env, 2, 29517), tmp_path, log)
        while not launch.poll():
            time.sleep(0.05)
    for rank in (0, 1):
        # MLflow's telemetry thread sets _MLFLOW_TELEMETRY_SESSION_ID in this process's environment at a moment of
        # its own, once any test in the worker imported mlflow: between the two launches or not (not the ranks' contract)
        a, b = ({k: v for k, v in json.loads((d / f"env{rank}.json").read_text()).items()
                 if not k.startswith("_MLFLOW_TELEMETRY")} for d in (theirs, ours))
        a["argv"][0] = b["argv"][0] = "<out dir>"
        assert a == b, {k: (a.get(k), b.get(k)) for k in a.keys() | b.keys() if a.get(k) != b.get(k)}
        assert b["RANK"] == b["LOCAL_RANK"] == str(rank) and b["WORLD_SIZE"] == "2" and b["MASTER_PORT"] == "29517"


def _gone(pid: int) -> bool:
    return heartbeats._state(pid) == "gone"


def test_a_failed_rank_stops_the_others_and_fails_the_launch_naming_it(tmp_path):
    """What DeepSpeed's launcher did when a rank exited non-zero, the supervisor does now: stop the other ranks
    (SIGTERM to the ranks' process group) and fail, naming the rank and its exit code."""
    code = ("import os, sys, time; r = int(os.environ['RANK']); print('rank', r, 'up', flush=True); "
            "time.sleep(0.5 if r == 1 else 120); sys.exit(3)")
    with open(tmp_path / "train.log", "ab") as log:
        launch = launcher.Launch.start_local([sys.executable, "-c", code], launcher.local_rank_envs(os.environ, 3, 1),
                                       tmp_path, log)
        pids = [p.pid for _, p in launch.procs]
        assert [os.getpgid(p) for p in pids] == [pids[0]] * 3 and pids[0] != os.getpgrp()  # one group of theirs
        t0 = time.monotonic()
        with pytest.raises(launcher.RankFailed, match=r"^rank 1 exited with code 3; stopped rank 0, rank 2$"):
            while not launch.poll():
                time.sleep(0.05)
        assert time.monotonic() - t0 < 10
    assert all(_gone(p) for p in pids)  # stopped and reaped: no zombie either
    text = (tmp_path / "train.log").read_text()
    assert "rank 1 up" in text and f"[supervisor] rank 1 (pid {pids[1]}) exited with code 3" in text


def test_stopping_a_launch_stops_every_rank_even_one_that_ignores_sigterm(tmp_path):
    """The supervisor's ^C or SIGTERM stops the ranks (`Launch.stop`, as DeepSpeed's launcher forwarded them):
    SIGTERM to the group, SIGKILL after the grace period for a rank that ignores it."""
    code = ("import os, signal, time; r = int(os.environ['RANK']); "
            "signal.signal(signal.SIGTERM, signal.SIG_IGN) if r == 1 else None; print('up', flush=True); time.sleep(120)")
    with open(tmp_path / "train.log", "ab") as log:
        launch = launcher.Launch.start_local([sys.executable, "-c", code], launcher.local_rank_envs(os.environ, 2, 1),
                                       tmp_path, log)
        while (tmp_path / "train.log").read_text().count("up") < 2:
            time.sleep(0.05)
        t0 = time.monotonic()
        launch.stop(term_timeout=2, kill_timeout=5)
        took = time.monotonic() - t0
    assert all(_gone(p.pid) for _, p in launch.procs) and 2 <= took < 7, took  # rank 1 needed the SIGKILL


# --------------------------------------------------------------------------------------------------
# real launches


@pytest.fixture(scope="module")
def extensions(tmp_path_factory):
    """A private TORCH_EXTENSIONS_DIR, seeded with this environment's built op if there is one (else the first
    launch builds it, once, in the supervisor)."""
    private = tmp_path_factory.mktemp("torch_extensions")
    for built in sv.build_dirs():
        if (built / f"{sv.SHM_OP}.so").exists() and not (built / "lock").exists():
            shutil.copytree(built, private / sv.SHM_OP, dirs_exist_ok=True)
            break
    old = os.environ.get("TORCH_EXTENSIONS_DIR")
    os.environ["TORCH_EXTENSIONS_DIR"] = str(private)
    yield private
    if old is None:
        del os.environ["TORCH_EXTENSIONS_DIR"]
    else:
        os.environ["TORCH_EXTENSIONS_DIR"] = old


SHORT = with_(CFG, max_steps=6, **{"checkpoint.every": 3, "logging.every": 1, "logging.eval_every": 0,
                                   "launch.timeout_s": 600})  # a bound, not a speed goal: a loaded CI machine took 128 s


def _no_ranks_left(pid: int, within: float) -> float:
    """Seconds until no process carries LIFECYCLE_SUPERVISOR_PID=pid (fails after `within`)."""
    t0 = time.monotonic()
    while (left := descendants_of_supervisor(pid)) and time.monotonic() - t0 < within:
        time.sleep(0.2)
    assert not left, f"processes of supervisor {pid} still running after {within} s: {left}"
    return time.monotonic() - t0


def test_a_planted_stale_build_lock_does_not_stop_a_run(tokens, tmp_path, extensions, caplog):  # noqa: F811
    """Without the clean-up the ranks wait on the lock until train.launch.timeout_s fails the run."""
    sv.prebuild_shm_op("cpu", dict(os.environ, DS_ACCELERATOR="cpu"))  # as if an earlier run had built it...
    lock = extensions / sv.SHM_OP / "lock"
    lock.touch()  # ...and a later one was killed while it held the build lock
    with caplog.at_level(logging.WARNING):
        r = run_train(tokens, SHORT, str(tmp_path))
    assert r.launched and r.steps == 6
    assert f"removed a stale JIT build lock {lock}" in caplog.text and not lock.exists()
    assert not list(Path(r.run_dir, "heartbeat").glob("*.tmp"))
    assert sv.shm_buffers(_port_of(r.log_path)) == []  # its buffers released with it


def _port_of(log_path: str) -> int:
    import re

    return int(re.findall(r"(?:--master_port[= ]|MASTER_PORT=)(\d+)", Path(log_path).read_text())[-1])


def test_ranks_die_with_a_sigkilled_supervisor_and_the_next_run_releases_its_buffers(tokens, tmp_path, extensions):  # noqa: F811
    code = ("from lifecycle.core.dataset import DatasetRef; from lifecycle.tasks.train.launch import run_train; "
            "from tests.train.test_supervise import SHORT; "
            f"run_train(DatasetRef.model_validate_json({tokens.model_dump_json()!r}), SHORT, {str(tmp_path)!r})")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 600
        while not list(tmp_path.glob("train/*/heartbeat/rank1")) and time.monotonic() < deadline:
            assert proc.poll() is None, "run_train ended before its ranks started"
            time.sleep(0.2)
        ranks = descendants_of_supervisor(proc.pid)
        assert len(ranks) >= 2  # the 2 ranks (and their persist processes), no launcher
        port = _port_of(next(tmp_path.glob("train/*/train.log")))
        assert sv.shm_buffers(port)  # DeepSpeed made them; the killed supervisor cannot release them
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        _no_ranks_left(proc.pid, within=10)
        nxt = sv.Ownership(port + 1)  # the next run's supervisor
        nxt.claim()
        assert sv.shm_buffers(port) == []
        nxt.release()
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in descendants_of_supervisor(proc.pid):
            os.kill(pid, signal.SIGKILL)


def test_a_killed_rank_stops_the_other_and_fails_the_launch_with_the_log_tail(tokens, tmp_path, extensions):  # noqa: F811
    cfg = with_(SHORT, max_steps=400, **{"checkpoint.every": 100})
    with ThreadPoolExecutor(1) as pool:
        run = pool.submit(run_train, tokens, cfg, str(tmp_path))
        deadline = time.monotonic() + 300
        while not (beats := list(tmp_path.glob("train/*/heartbeat/rank1"))) and time.monotonic() < deadline:
            assert not run.done(), run.exception()
            time.sleep(0.2)
        import json

        pids = {r: json.loads((beats[0].parent / f"rank{r}").read_text())["pid"] for r in (0, 1)}
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(RuntimeError, match=r"(?s)rank 1 exited with code -9; stopped rank 0\. Last lines of "
                                               r".*train\.log:\n.*\[supervisor\] rank 1 \(pid \d+\) exited with code -9"):
            run.result(timeout=60)
    assert _gone(pids[0])
    _no_ranks_left(os.getpid(), within=5)


@pytest.mark.slow  # two launches, 1-2 min on 2 cores
def test_a_stopped_rank_fails_the_launch_naming_it_then_the_rerun_completes(tokens, tmp_path, extensions):  # noqa: F811
    # synchronous saves: a nice-19 persist process starved by a loaded machine would be a stall of its own
    cfg = with_(SHORT, max_steps=60, **{"checkpoint.every": 5, "checkpoint.async_save": False, "launch.stall_s": 20})
    with ThreadPoolExecutor(1) as pool:
        run = pool.submit(run_train, tokens, cfg, str(tmp_path))
        hb = None
        deadline = time.monotonic() + 180
        while hb is None and time.monotonic() < deadline and not run.done():
            hb = next(iter(tmp_path.glob("train/*/checkpoints/step_00000005/COMMITTED.json")), None)
            time.sleep(0.2)
        assert hb is not None, "no commit at step 5"
        import json

        rank1 = json.loads((hb.parents[2] / "heartbeat" / "rank1").read_text())["pid"]
        os.kill(rank1, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=rf"training stalled: no step for more than \d+ s: rank 1 \(pid {rank1}, "
                                               rf"stopped\) last step \d+ .*ranks killed"):
            run.result(timeout=120)
        took = time.monotonic() - t0
    assert took < 20 + 25 + 5, took  # the bound, stopping the group (SIGTERM, then SIGKILL after 15 s), the poll
    _no_ranks_left(os.getpid(), within=5)
    r = run_train(tokens, cfg, str(tmp_path))  # what the stage's retry does: resume from the last commit
    assert r.launched and r.steps == 60 and r.resumed_from is not None and r.resumed_from >= 5


def test_a_tests_leftover_deepspeed_buffers_are_released_and_live_ones_kept(tmp_path):
    """tests/conftest.py's autouse cleanup: new buffers of no live launch go; a mapped one (a live rank's) stays,
    and so does an unmapped one whose launch's store still listens on the port in its name (a rank of another
    xdist worker's run between creating its file and mapping it: its peer spins until the file exists)."""
    import mmap
    import socket

    from tests.conftest import deepspeed_shm, release_new_deepspeed_shm

    before = deepspeed_shm()
    with socket.socket() as store:
        store.bind(("127.0.0.1", 0))
        store.listen()
        port = store.getsockname()[1]
        names = [f"deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_1_{i}" for i in (0, 1)]
        names.append(f"deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}_0")
        for n in names:
            (Path("/dev/shm") / n).write_bytes(b"\0" * 4096)
        with open(Path("/dev/shm") / names[1], "r+b") as f, mmap.mmap(f.fileno(), 4096):
            assert release_new_deepspeed_shm(before) == [names[0]]
            assert (Path("/dev/shm") / names[1]).exists() and not (Path("/dev/shm") / names[0]).exists()
        assert release_new_deepspeed_shm(before) == [names[1]]
        assert (Path("/dev/shm") / names[2]).exists()
    assert release_new_deepspeed_shm(before) == [names[2]]


def test_the_metrics_tail_follows_rank_0_rewriting_the_file(tmp_path):
    """On a relaunch rank 0 drops the records past the resume step by writing a new metrics.jsonl and renaming it
    over the old one. The supervisor's tail may have read further into the old file than the new one's length at
    that moment, or less: either way it must start over on the new file (a seek into the middle of a line raised
    JSONDecodeError and failed the rerun of tests/flows/test_interrupt.py), and pass on each record once."""
    import json

    from lifecycle.tasks.train.launch import _MetricsTail

    path = tmp_path / "metrics.jsonl"
    line = lambda step, loss: json.dumps({"kind": "train", "step": step, "loss": loss}) + "\n"  # noqa: E731
    path.write_text("".join(line(s, 1.0) for s in (1, 2, 3)))
    got = []
    tail = _MetricsTail(path, 0, got.append)
    tail.poll()
    new = tmp_path / "metrics.jsonl.tmp"  # the resumed run keeps step 1, then writes longer records
    new.write_text(line(1, 1.0) + json.dumps({"kind": "restore", "step": 1, "tier": "memory" * 20}) + "\n")
    os.replace(new, path)
    with open(path, "a") as f:
        f.write(line(2, 0.5))
    tail.poll()
    assert [(r["kind"], r["step"]) for r in got] == [("train", 1), ("train", 2), ("train", 3), ("restore", 1)]


def test_after_the_last_step_the_commit_and_teardown_get_start_ups_bound(tmp_path):
    """Every rank at max_steps: the final commit and the teardown are no step, and under load they outlast a short
    stall bound (issue 46 saw a false stall after step 20 at stall_s=10); start-up's bound applies there."""
    beats = heartbeats.Heartbeats(tmp_path, ranks=2, stall_s=5, startup_s=100, last_step=20)
    for rank in range(2):
        heartbeats.write_heartbeat(tmp_path, rank, 19, step_time=0.1, pid=os.getpid())
    now = time.time()
    assert beats.check(now + 6) is not None  # a step in the middle of the run: the stall bound
    for rank in range(2):
        heartbeats.write_heartbeat(tmp_path, rank, 20, step_time=0.1, pid=os.getpid())
    now = time.time()
    assert beats.check(now + 50) is None
    assert beats.check(now + 101).startswith("training stalled: no step for more than 100 s")
