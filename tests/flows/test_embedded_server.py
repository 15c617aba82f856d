"""The embedded Prefect server (no `lifecycle up`): started by the first run, reused by the next ones in the same
work dir, replaced when its state is stale, one server when two runs start it at once, stopped by `lifecycle down`
and after its idle timeout. Real servers, real runs.

    .venv/bin/python -m pytest -q tests/flows/test_embedded_server.py   (LIFECYCLE_SLOW=1 for the replacement test)
"""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.conftest import ROOT, last_json, lifecycle

START = ("import json, sys; from lifecycle.flows.startup.environment import embedded_server; "
         "print(json.dumps(embedded_server(sys.argv[1])))")


def _start(wd, env=None) -> subprocess.Popen:
    """`embedded_server(wd)` in a process of its own (a run's first step), which exits right after."""
    return subprocess.Popen([sys.executable, "-c", START, str(wd)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})


def _result(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def _state(wd) -> dict:
    return json.loads((wd / ".servers" / "embedded.json").read_text())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not open(f"/proc/{pid}/stat").read().split(")")[-1].split()[0] == "Z"


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    return not _alive(pid)


def _flow_run_state(url: str, flow_run_id: str) -> str:
    with urllib.request.urlopen(f"{url}/api/flow_runs/{flow_run_id}", timeout=10) as r:
        return json.loads(r.read())["state_type"]


@pytest.fixture
def wd(tmp_path):
    wd = tmp_path / "wd"
    yield wd
    lifecycle("down", "--set", f"workdir={wd}", rc=None)  # whatever a test left running


def test_first_run_starts_the_server_the_second_reuses_it_and_down_stops_it(wd, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": f"d{i}", "text": f"document number {i} " * 30}) + "\n" for i in range(5)))
    args = ["run", "--json", "--until", "collect", "--set", f"workdir={wd}", "--set", f"collect.inputs=[\"{src}\"]"]
    first = last_json(lifecycle(*args).stdout)
    server = _state(wd)
    assert first["orchestration"] == "embedded" and _alive(server["pid"])  # it outlives the run that started it
    t = first["timing"]
    assert t["command_start"] <= t["prefect_ready"] <= t["flow_start"] <= t["first_stage_start"] \
        <= t["last_stage_end"] <= t["flow_end"] and t["stage:collect"] > 0
    second = last_json(lifecycle(*args).stdout)
    assert _state(wd) == server  # same process, same URL
    for run in (first, second):  # both flow runs are on the one server, completed
        assert _flow_run_state(server["url"], run["prefect_flow_run_id"]) == "COMPLETED"
    status = last_json(lifecycle("status", "--set", f"workdir={wd}", "--json").stdout)
    assert status["embedded-prefect"]["healthy"] and status["embedded-prefect"]["pid"] == server["pid"]
    down = last_json(lifecycle("down", "--set", f"workdir={wd}", "--json").stdout)
    assert down["stopped"] == ["embedded-prefect"]
    assert _wait_gone(server["pid"], 5) and not (wd / ".servers" / "embedded.json").exists()


@pytest.mark.slow  # three server starts: over a minute on a loaded 2-core machine
def test_a_dead_server_or_a_recycled_pid_is_replaced(wd):
    first = _result(_start(wd))
    assert first["started"]
    os.kill(first["pid"], signal.SIGKILL)  # died without cleaning up: its state file stays
    assert _wait_gone(first["pid"], 10)
    second = _result(_start(wd))
    assert second["started"] and second["pid"] != first["pid"]
    urllib.request.urlopen(second["health"], timeout=10).close()
    # a pid now used by an unrelated process: not ours (its command line differs), left alone, replaced
    stranger = subprocess.Popen(["sleep", "60"])
    try:
        os.kill(second["pid"], signal.SIGKILL)
        _wait_gone(second["pid"], 10)
        state = _state(wd)
        (wd / ".servers" / "embedded.json").write_text(json.dumps({**state, "pid": stranger.pid}))
        third = _result(_start(wd))
        assert third["started"] and third["pid"] not in (stranger.pid, second["pid"])
        assert stranger.poll() is None  # never signalled
    finally:
        stranger.kill()
        stranger.wait()


def test_two_runs_starting_it_at_once_end_with_one_server(wd):
    a, b = _start(wd), _start(wd)
    ra, rb = _result(a), _result(b)
    assert ra["pid"] == rb["pid"] and ra["url"] == rb["url"] == _state(wd)["url"]
    assert sorted([ra["started"], rb["started"]]) == [False, True]  # one started it, the other found it


def test_it_stops_after_its_idle_timeout_but_not_under_a_run(wd):
    holder = subprocess.Popen([sys.executable, "-c", START + "; sys.stdout.flush(); import time; time.sleep(6)",
                               str(wd)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "LIFECYCLE_EMBEDDED_IDLE_S": "2"})
    pid = json.loads(holder.stdout.readline())["pid"]
    time.sleep(4)
    assert _alive(pid)  # idle for longer than 2 s, but a run (the holder) uses it
    holder.communicate(timeout=30)
    assert _wait_gone(pid, 20), "the idle server did not stop"


def test_it_stops_when_its_work_dir_is_removed(wd):
    """A removed work dir (a temporary one, a user's `rm -rf`) leaves no run that could use or stop its server:
    the server stops on its next idle check instead of serving forever (seen: servers of deleted temporary work
    dirs alive 35 minutes after a 30 s idle timeout, their watcher dead on FileNotFoundError)."""
    import shutil

    pid = _result(_start(wd, {"LIFECYCLE_EMBEDDED_IDLE_S": "3600"}))["pid"]
    assert _alive(pid)
    shutil.rmtree(wd)
    assert _wait_gone(pid, 60), "the server of a removed work dir did not stop"


def test_it_stops_when_its_work_dir_is_made_again(wd):
    """A work dir removed and made again (a rerun from scratch) gets a new server, whose runs hold
    `embedded.users` at the same path: the old server must not take that for its own use and serve an hour for
    nothing. It stops once the work dir's state names another server."""
    import shutil

    old = _result(_start(wd, {"LIFECYCLE_EMBEDDED_IDLE_S": "3600"}))["pid"]
    shutil.rmtree(wd)
    new = _result(_start(wd, {"LIFECYCLE_EMBEDDED_IDLE_S": "3600"}))["pid"]
    assert new != old and _state(wd)["pid"] == new
    assert _wait_gone(old, 60), "the replaced server did not stop"
    assert _alive(new)


def test_a_new_work_dir_starts_from_the_migrated_template(tmp_path):
    """Prefect's migrations take ~10 s of a new work dir's ~14 s server start (issue 25's cold start). The first
    new server on a machine keeps its just-migrated, empty database in the cache; later new work dirs start
    from a copy of it. Off with LIFECYCLE_PREFECT_TEMPLATE=0."""
    import sqlite3
    from importlib.metadata import version

    cache = tmp_path / "cache"
    template = cache / "lifecycle" / f"prefect-{version('prefect')}-empty.db"
    env = {"XDG_CACHE_HOME": str(cache)}
    dirs = [tmp_path / f"wd{i}" for i in range(3)]
    try:
        _result(_start(dirs[0], {**env, "LIFECYCLE_PREFECT_TEMPLATE": "0"}))
        assert not template.exists()
        _result(_start(dirs[1], env))
        with sqlite3.connect(template) as db:
            assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
            assert db.execute("SELECT count(*) FROM alembic_version").fetchone()[0] == 1
            assert db.execute("SELECT count(*) FROM flow_run").fetchone()[0] == 0
            assert db.execute("SELECT count(*) FROM block_type").fetchone()[0] > 0
            db.execute("CREATE TABLE seeded_from_template (x)")  # a mark only a copy of the template can carry
        assert not list(template.parent.glob(".*.tmp"))
        third = _result(_start(dirs[2], env))
        with sqlite3.connect(dirs[2] / ".prefect" / "prefect.db") as db:
            assert db.execute("SELECT count(*) FROM sqlite_master WHERE name = 'seeded_from_template'").fetchone()[0]
        body = json.dumps({}).encode()  # the seeded server serves the API: an empty flow-run query answers
        req = urllib.request.Request(f"{third['url']}/api/flow_runs/filter", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            assert json.loads(r.read()) == []
        with sqlite3.connect(dirs[0] / ".prefect" / "prefect.db") as db:  # the server without a template made its own
            assert not db.execute("SELECT count(*) FROM sqlite_master WHERE name = 'seeded_from_template'").fetchone()[0]
    finally:
        for d in dirs:
            lifecycle("down", "--set", f"workdir={d}", rc=None)
