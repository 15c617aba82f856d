"""The warm runner beside the embedded Prefect server (no `lifecycle up`): a cold run that used the embedded
server leaves one; the next runs in the work dir go warm and commit what a cold run would; it never keeps the
server from its idle stop, exits with it, and `lifecycle down` stops it. Real servers, real runs.

    .venv/bin/python -m pytest -q tests/flows/test_embedded_runner.py
"""

import fcntl
import json
import os
import time

import pytest

from tests.conftest import last_json, lifecycle
from tests.flows.test_embedded_server import _state, _wait_gone


def _docs(path, n):
    path.write_text("".join(json.dumps({"id": f"d{i}", "text": f"document number {i} about the harbour " * 20}) + "\n"
                            for i in range(n)))
    return path


def _runner(wd) -> dict | None:
    f = wd / ".servers" / "embedded-runner.json"
    return json.loads(f.read_text()) if f.exists() else None


def _wait_ready(wd, timeout=120) -> dict:
    """The runner's entry once it answers on its socket (it imports Prefect, MLflow and the stages first). The
    server is held meanwhile, as a run holds it: on a loaded machine the imports can outlast a short idle timeout,
    and a runner that finds its server gone exits at once."""
    users = os.open(wd / ".servers" / "embedded.users", os.O_RDWR)
    fcntl.flock(users, fcntl.LOCK_SH)
    try:
        deadline = time.monotonic() + timeout
        while True:
            st = last_json(lifecycle("status", "--set", f"workdir={wd}", "--json").stdout)
            if st.get("embedded-runner", {}).get("healthy"):
                return st["embedded-runner"]
            assert time.monotonic() < deadline, (wd / ".servers" / "embedded-runner.log").read_text()
            time.sleep(0.5)
    finally:
        os.close(users)


@pytest.fixture
def wd(tmp_path):
    wd = tmp_path / "wd"
    yield wd
    lifecycle("down", "--set", f"workdir={wd}", rc=None)


def test_a_cold_run_leaves_a_runner_the_next_run_goes_warm_and_down_stops_it(wd, tmp_path):
    env = {**os.environ, "LIFECYCLE_EMBEDDED_RUNNER": "1"}
    src = _docs(tmp_path / "in.jsonl", 6)
    args = ["run", "--json", "--until", "collect", "--set", f"workdir={wd}", "--set", f"collect.inputs=[\"{src}\"]"]
    first = last_json(lifecycle(*args, env=env).stdout)
    assert first["launch"] == "cold" and first["orchestration"] == "embedded"
    runner = _wait_ready(wd)
    server = _state(wd)
    (wd / "datasets").rename(tmp_path / "first-datasets")  # the next run computes again (a new hour's run)
    warm = last_json(lifecycle(*args, env=env).stdout)
    assert warm["launch"] == "warm" and warm["stages"]["collect"] == "computed"
    assert warm["orchestration"] == "embedded" and _state(wd) == server  # the same server, held by the warm run
    # what the warm run committed is what a cold run of the same command reuses (same config, code, fingerprint)
    cold = last_json(lifecycle(*args, env={**env, "LIFECYCLE_WARM": "0"}).stdout)
    assert cold["launch"] == "cold" and cold["stages"]["collect"] == "reused" and cold["datasets"] == warm["datasets"]
    assert _runner(wd)["pid"] == runner["pid"]  # that cold run found the runner and started no second one
    # an environment that would import differently: declined, the run goes cold, -v says why
    other = lifecycle(*args, "-v", env={**env, "LIFECYCLE_TEST_MARK": "1"})
    assert last_json(other.stdout)["launch"] == "cold"
    assert "the environment differs from the runner's in LIFECYCLE_TEST_MARK" in other.stderr
    down = last_json(lifecycle("down", "--set", f"workdir={wd}", "--json").stdout)
    assert down["stopped"] == ["embedded-runner", "embedded-prefect"]
    assert _wait_gone(runner["pid"], 10) and _wait_gone(server["pid"], 10)
    assert _runner(wd) is None and not (wd / ".servers" / "embedded-runner.sock").exists()


def test_the_runner_never_holds_the_server_up_and_exits_with_it(wd, tmp_path):
    """Idle timeout of 3 s: the server stops although the runner is alive (the runner does not count as a user),
    and the runner then exits on its own and removes its state. Off switches: no runner is started."""
    env = {**os.environ, "LIFECYCLE_EMBEDDED_RUNNER": "1", "LIFECYCLE_EMBEDDED_IDLE_S": "3"}
    src = _docs(tmp_path / "in.jsonl", 3)
    args = ["run", "--json", "--until", "collect", "--set", f"workdir={wd}", "--set", f"collect.inputs=[\"{src}\"]"]
    lifecycle(*args, env=env)
    runner, server = _wait_ready(wd), _state(wd)
    assert _wait_gone(server["pid"], 60), "the server did not stop on its idle timeout beside the runner"
    assert _wait_gone(runner["pid"], 15), "the runner outlived its server"
    assert _runner(wd) is None and not (wd / ".servers" / "embedded-runner.sock").exists()
    for off in ({"LIFECYCLE_EMBEDDED_RUNNER": "0"}, {"LIFECYCLE_WARM": "0"}):
        lifecycle(*args, env={**env, **off})
        time.sleep(1)
        assert _runner(wd) is None, off
