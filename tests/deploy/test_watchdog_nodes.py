"""The training watchdog names the node that does not answer (tasks/train/heartbeats.py `unreachable_nodes`), the
diagnosis a stall across machines gets; tests/deploy/test_two_nodes.py pulls a real cable."""

import json
import socket

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
