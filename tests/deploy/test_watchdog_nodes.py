"""The training watchdog names the node that does not answer (tasks/train/heartbeats.py `unreachable_nodes`), the
diagnosis a stall across machines gets; tests/deploy/test_two_nodes.py pulls a real cable."""

import json
import os
import signal
import socket
import time

from lifecycle.tasks.train.heartbeats import Heartbeats


def test_a_stall_names_the_node_whose_port_does_not_answer(tmp_path):
    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    listening.listen()
    port = listening.getsockname()[1]
    closed = socket.socket()
    closed.bind(("127.0.0.2", port))  # the same port on another loopback address, bound but not listening
    (tmp_path / "hostfile").write_text("127.0.0.1 slots=2\n127.0.0.2 slots=1\n")
    (tmp_path / "config.json").write_text(json.dumps({"train": {"launch": {
        "hostfile": str(tmp_path / "hostfile"), "include": None, "exclude": None, "num_nodes": None}}}))
    hb = Heartbeats(tmp_path, ranks=3, stall_s=1, startup_s=10)
    beats = {r: {"step": 7 + (r < 2), "time": 0.0, "pid": 1, "host": "n"} for r in range(3)}
    try:
        said = hb.unreachable_nodes(beats, port=port, timeout=1)
    finally:
        listening.close()
        closed.close()
    assert said is not None and said.startswith("node 127.0.0.2 (ranks 2-2, last step 7) does not answer on port")
    assert "127.0.0.1" not in said


def test_no_hostfile_no_probe(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"train": {"launch": {"hostfile": None}}}))
    hb = Heartbeats(tmp_path, ranks=1, stall_s=1, startup_s=10)
    assert hb.unreachable_nodes({0: {"step": 1, "time": 0.0, "pid": 1}}) is None


SUPERVISOR = ("import sys, time; from pathlib import Path; from lifecycle.tasks.train.heartbeats import SupervisorBeat; "
              "SupervisorBeat(Path(sys.argv[1]), every=0.2).__enter__(); time.sleep(600)")
RANK = ("import sys, time; from pathlib import Path; from lifecycle.core.procs import watch_parent_run; "
        "watch_parent_run(interval=0.2, beat=Path(sys.argv[1])); print('watching', flush=True); time.sleep(600)")


def test_a_rank_on_another_node_stops_once_the_supervisor_is_killed(tmp_path):
    """A rank DeepSpeed started over ssh inherits no supervisor pid (the trainer gives it the beat's path in its run
    dir instead): it runs while the supervisor beats, and stops its process group once the killed supervisor's beat
    is silent."""
    import subprocess
    import sys

    sup = subprocess.Popen([sys.executable, "-c", SUPERVISOR, str(tmp_path)])
    deadline = time.monotonic() + 120
    while not (tmp_path / "supervisor.beat").exists():  # its first beat comes before a launch starts a rank
        assert sup.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIFECYCLE_SUPERVISOR")}
    env["LIFECYCLE_SUPERVISOR_SILENCE_S"] = "2"
    rank = subprocess.Popen([sys.executable, "-c", RANK, str(tmp_path / "supervisor.beat")], env=env, start_new_session=True, stdout=subprocess.PIPE,
                            text=True)
    try:
        time.sleep(6)  # three times the silence bound: the beat keeps it running
        assert rank.poll() is None, rank.stdout.read()
        sup.kill()
        t0 = time.monotonic()
        rank.wait(timeout=30)
        stopped_s = time.monotonic() - t0
    finally:
        for p in (sup, rank):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL) if p is rank else p.kill()
            p.wait()
    assert rank.returncode == -signal.SIGKILL
    assert "supervisor.beat has not changed for 2 s; stopping the ranks" in rank.stdout.read()
    assert 1 <= stopped_s < 20  # the bound counts from the last beat seen, up to a beat before the kill


def test_a_rank_of_an_earlier_launch_stops_on_the_next_launchs_beat(tmp_path):
    """A rank cut off from its launch (node2's cable pulled, the attempt failed) must not live on the beat that the
    rerun's supervisor writes to the same run dir: it stops as soon as the beat names another launch."""
    import subprocess
    import sys

    first = subprocess.Popen([sys.executable, "-c", SUPERVISOR, str(tmp_path)])
    deadline = time.monotonic() + 120
    while not (tmp_path / "supervisor.beat").exists():
        assert first.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIFECYCLE_SUPERVISOR")}
    env["LIFECYCLE_SUPERVISOR_SILENCE_S"] = "600"  # silence alone would not stop it within the test
    rank = subprocess.Popen([sys.executable, "-c", RANK, str(tmp_path / "supervisor.beat")], env=env,
                            start_new_session=True, stdout=subprocess.PIPE, text=True)
    assert rank.stdout.readline() == "watching\n"
    time.sleep(1)  # its first look at the beat is done: it watches the first launch
    first.kill()
    first.wait()
    second = subprocess.Popen([sys.executable, "-c", SUPERVISOR, str(tmp_path)])
    try:
        rank.wait(timeout=120)
    finally:
        second.kill()
        second.wait()
        if rank.poll() is None:
            os.killpg(rank.pid, signal.SIGKILL)
            rank.wait()
    assert rank.returncode == -signal.SIGKILL
    assert "names another launch" in rank.stdout.read()
