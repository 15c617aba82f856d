"""`lifecycle up/down/status` with the real servers: loopback only, used by `lifecycle run`, stopped exactly."""

import json
import os
import subprocess
import sys

import psutil
import pytest

from lifecycle.core.procs import free_port
from lifecycle.core.locking import WorkdirBusy, workdir_lock
from tests.conftest import ROOT, last_json, lifecycle

@pytest.fixture(scope="module")
def live(tmp_path_factory):
    wd = tmp_path_factory.mktemp("srv")
    ports = [str(free_port()), str(free_port())]
    up = lifecycle("up", "--set", f"workdir={wd}", "--prefect-port", ports[0], "--mlflow-port", ports[1], "--json")
    st = last_json(up.stdout)
    yield wd, st
    lifecycle("down", "--set", f"workdir={wd}", rc=None)


def _group_pids(pid):
    procs = [psutil.Process(pid)] + psutil.Process(pid).children(recursive=True)
    return {p.pid for p in procs}


def test_up_status_and_loopback_only(live):
    wd, st = live
    assert set(st) == {"prefect", "mlflow", "runner"} and all(e["healthy"] for e in st.values())
    assert (wd / ".servers" / "prefect.pid").read_text().strip() == str(st["prefect"]["pid"])
    status = last_json(lifecycle("status", "--set", f"workdir={wd}", "--json").stdout)
    assert all(e["healthy"] for e in status.values())
    pids = set().union(*(_group_pids(e["pid"]) for e in st.values()))
    listening = [c for c in psutil.net_connections(kind="inet") if c.status == "LISTEN" and c.pid in pids]
    assert listening, "the servers listen on no socket"
    assert {c.laddr.ip for c in listening} == {"127.0.0.1"}, listening


def test_run_uses_the_servers_and_refuses_a_concurrent_run(live, tmp_path):
    wd, st = live
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": f"d{i}", "text": f"document number {i} " * 30}) + "\n" for i in range(5)))
    args = ["run", "--json", "--until", "collect", "--set", f"workdir={wd}", "--set", f"collect.inputs=[\"{src}\"]"]
    out = last_json(lifecycle(*args).stdout)
    assert out["orchestration"] == "servers" and out["mlflow_tracking_uri"] == st["mlflow"]["url"]
    assert out["launch"] == "warm"  # forked by `up`'s runner (tests/flows/test_launch.py)
    # the MLflow server (not a SQLite file opened by the run) holds the run
    from mlflow import MlflowClient
    assert MlflowClient(st["mlflow"]["url"]).get_run(out["mlflow_run_id"]).info.status == "FINISHED"
    # the Prefect server recorded the flow run
    import urllib.request
    with urllib.request.urlopen(f"{st['prefect']['url']}/api/flow_runs/{out['prefect_flow_run_id']}") as r:
        assert json.loads(r.read())["state_type"] == "COMPLETED"
    # while another run holds the work dir, a second one refuses with a clear message
    with workdir_lock(wd):
        busy = lifecycle(*args, rc=None)
        assert busy.returncode == 3 and "in use by another lifecycle run" in busy.stderr
        with pytest.raises(WorkdirBusy):
            with workdir_lock(wd):
                pass


def _api(st, path, body=None):
    import urllib.request
    req = urllib.request.Request(f"{st['prefect']['url']}/api/{path}", method="POST" if body is not None else "GET",
                                 data=json.dumps(body).encode() if body is not None else None,
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def _finished_runs(st):
    # the scheduler also inserts many future runs: ask only for finished ones
    runs = _api(st, "flow_runs/filter", {"limit": 20, "flow_runs": {"state": {"type": {
        "any_": ["COMPLETED", "FAILED", "CRASHED"]}}}})
    return [r for r in runs if r["deployment_id"]]


def _wait(what, cond, timeout):
    import time
    deadline = time.time() + timeout
    while time.time() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(2)
    raise AssertionError(f"{what} within {timeout} s")


def test_serve_runs_incrementally_on_the_cron_schedule(live, tmp_path):
    """Two scheduled runs on the real server, a new input file added between them: the second collects only
    the new file and dedup drops its copy of a document the first run kept."""
    import pyarrow.parquet as pq
    from tests.conftest import corpus_records

    wd, st = live
    recs = [{**r, "id": f"sched-{k}"} for k, r in enumerate(corpus_records(400)[300:340])]
    inputs = tmp_path / "in"
    inputs.mkdir()
    first, second = inputs / "a.jsonl", inputs / "b.jsonl"
    first.write_text("".join(json.dumps(r) + "\n" for r in recs[:20]))
    serve = subprocess.Popen([sys.executable, "-m", "lifecycle.cli", "serve", "--cron", "* * * * *", "--name", "every-minute", "--set", f"workdir={wd}",
                              "--set", f"collect.inputs=[\"{inputs}/*.jsonl\"]", "--set", "name=served",
                              "--until", "dedup"],
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ledger = lambda: pq.read_table(wd / "collected.parquet").to_pylist() if (wd / "collected.parquet").exists() else []
    try:
        _wait("no scheduled run collected a.jsonl", lambda: [r for r in ledger() if r["path"] == str(first)], 240)
        # new data arrives: 20 new documents and a copy of one the first run kept
        second.write_text("".join(json.dumps(r) + "\n" for r in [*recs[20:], {**recs[3], "id": "sched-copy"}]))
        _wait("no scheduled run collected b.jsonl", lambda: [r for r in ledger() if r["path"] == str(second)], 240)
        done = _finished_runs(st)
        assert done and all(r["state_type"] == "COMPLETED" for r in done), [r["state"]["message"] for r in done]
        assert all(r["auto_scheduled"] for r in done)  # started by the server's scheduler, not by hand
        dep = _api(st, f"deployments/{done[0]['deployment_id']}")
        assert dep["name"] == "every-minute" and dep["schedules"][0]["schedule"]["cron"] == "* * * * *"
        limit = dep.get("global_concurrency_limit") or {}
        assert limit.get("limit") == 1, sorted(dep)
        assert dep["concurrency_options"]["collision_strategy"] == "CANCEL_NEW"
        # zombie detection: the automation that marks heartbeat-less runs Crashed is installed
        autos = _api(st, "automations/filter", {})
        zombie = next(a for a in autos if a["name"] == "lifecycle-zombie-runs")
        assert zombie["trigger"]["posture"] == "Proactive" and zombie["actions"][0]["state"] == "CRASHED"
    finally:
        serve.terminate()
        try:
            serve.wait(timeout=30)
        except subprocess.TimeoutExpired:
            serve.kill()

    # the second run's collect dataset holds b.jsonl only, all 21 of its records
    collects = [json.loads(m.read_text()) for m in (wd / "datasets" / "collect").glob("*/_manifest.json")]
    by_input = {tuple(i["path"] for i in m["inputs"]): m for m in collects}
    assert (str(first),) in by_input and (str(second),) in by_input, list(by_input)
    assert by_input[(str(second),)]["stats"]["rows_in"] == 21
    # dedup rejected the copy as a duplicate of the document the first run kept
    rejected = [r for m in (wd / "datasets" / "dedup").glob("*/_manifest.json")
                for f in json.loads(m.read_text())["rejected"] for r in pq.read_table(m.parent / f["path"]).to_pylist()]
    copy = [r for r in rejected if r["source_id"] == "sched-copy"]
    assert copy and copy[0]["reason"] == "duplicate" and "earlier run" in copy[0]["detail"], rejected


# ------------------------------------------------------------------------------- the warm runner (lifecycle/launch.py)


def _runs_in_runner_log(wd):
    return [int(l.rsplit(" ", 1)[1]) for l in (wd / ".servers" / "runner.log").read_text().splitlines()
            if l.startswith("runner: run ")]


def _docs(path, n, tag=""):
    path.write_text("".join(json.dumps({"id": f"{tag}d{i}", "text": f"{tag} document number {i} about the tide "
                                        "tables of the northern harbour. " * 12}) + "\n" for i in range(n)))
    return path


@pytest.mark.parametrize("argv", [["run"], ["run", "deploy/configs/demo.yaml", "--set", "workdir=/tmp/x/../y"],
                                  ["run", "--json", "--until", "filter", "--set", "workdir=file:///tmp/z", "-v"],
                                  ["run", "deploy/configs/fineweb.yaml", "--set=workdir=rel/dir"]])
def test_the_launcher_names_the_work_dir_the_config_loader_names(argv):
    from lifecycle.config import load_config
    from lifecycle.flows.startup.client import peek_workdir, run_target

    config, sets = run_target(argv)
    assert str(peek_workdir(argv)) == load_config(config, sets).workdir


def test_a_warm_run_is_the_cold_run_without_the_imports(live, tmp_path):
    wd, _ = live
    src = _docs(tmp_path / "in.jsonl", 5, "warm")
    args = ["run", "--json", "--until", "collect", "--set", f"workdir={wd}", "--set", f"collect.inputs=[\"{src}\"]"]
    before = _runs_in_runner_log(wd)
    warm = last_json(lifecycle(*args).stdout)
    assert warm["launch"] == "warm" and warm["stages"]["collect"] == "computed"
    assert len(_runs_in_runner_log(wd)) == len(before) + 1
    # the same command run cold: the same config and code (the stage's fingerprint), so it reuses what warm committed
    cold = last_json(lifecycle(*args, env={**os.environ, "LIFECYCLE_WARM": "0"}).stdout)
    assert cold["launch"] == "cold" and cold["stages"]["collect"] == "reused"
    assert cold["datasets"] == warm["datasets"]
    # an environment that would import differently: the runner declines, the run goes cold and -v says why
    other = lifecycle(*args, "-v", env={**os.environ, "LIFECYCLE_TEST_MARK": "1"})
    assert last_json(other.stdout)["launch"] == "cold"
    assert "the environment differs from the runner's in LIFECYCLE_TEST_MARK" in other.stderr
    # an error in a warm run is the cold run's error: one line, exit 2
    bad = lifecycle(*args, "--set", "train.lr=fast", rc=2)
    assert "train.lr" in bad.stderr and "Traceback" not in bad.stderr


def test_a_signal_to_the_command_reaches_its_warm_run(live, tmp_path):
    import signal
    import time

    wd, _ = live
    src = _docs(tmp_path / "big.jsonl", 3000, "sig")
    args = ["run", "--json", "--until", "scrub", "--set", f"workdir={wd}", "--set", f"collect.inputs=[\"{src}\"]"]

    def start():
        seen = len(_runs_in_runner_log(wd))
        proc = subprocess.Popen([sys.executable, "-m", "lifecycle.launch", *args], cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 60
        while len(_runs_in_runner_log(wd)) == seen:
            assert time.time() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.1)
        time.sleep(1.5)  # into the flow
        return proc, _runs_in_runner_log(wd)[-1]

    proc, child = start()
    proc.send_signal(signal.SIGTERM)  # forwarded: the run is interrupted as a cold one is
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 143 and "interrupted by SIGTERM" in err, (out, err)
    assert json.loads(out.strip().splitlines()[-1])["status"] == "interrupted"
    proc, child = start()
    proc.kill()  # the command dies: its run sees the socket close and stops as on SIGTERM
    proc.wait()
    deadline = time.time() + 30
    while psutil.pid_exists(child) and psutil.Process(child).status() != psutil.STATUS_ZOMBIE:
        assert time.time() < deadline, f"the run {child} outlived its killed command by 30 s"
        time.sleep(0.2)
    # the work dir is free again, and the run resumes
    done = last_json(lifecycle(*args).stdout)
    assert done["status"] == "completed" and done["launch"] == "warm"


def test_the_runner_restarts_when_the_code_changes(live, tmp_path):
    import time

    wd, st = live
    src = _docs(tmp_path / "in.jsonl", 5, "code")
    args = ["run", "--json", "--until", "collect", "--set", f"workdir={wd}", "--set", f"collect.inputs=[\"{src}\"]"]
    module = ROOT / "lifecycle" / "core" / "paths.py"
    os.utime(module, ns=(module.stat().st_atime_ns, module.stat().st_mtime_ns + 1_000_000_000))
    stale = lifecycle(*args, "-v")
    assert last_json(stale.stdout)["launch"] == "cold" and "the project's code changed" in stale.stderr
    deadline = time.time() + 90  # it replaced itself (exec: the same pid) and imports again
    while not last_json(lifecycle("status", "--set", f"workdir={wd}", "--json").stdout)["runner"]["healthy"]:
        assert time.time() < deadline, (wd / ".servers" / "runner.log").read_text()
        time.sleep(0.5)
    assert psutil.Process(st["runner"]["pid"]).is_running()
    assert last_json(lifecycle(*args).stdout)["launch"] == "warm"



def test_a_second_up_with_other_ports_says_so(live):
    """Issue 44, 5: 8c6205f ignored the ports of a second `up` without a word."""
    wd, st = live
    other = str(free_port())
    again = lifecycle("up", "--set", f"workdir={wd}", "--mlflow-port", other, rc=2)
    mlflow_port = st["mlflow"]["url"].rsplit(":", 1)[1]
    assert f"mlflow runs on port {mlflow_port}, not {other}" in again.stderr, again.stderr
    assert "lifecycle down" in again.stderr
    same = last_json(lifecycle("up", "--set", f"workdir={wd}", "--json").stdout)  # no ports: keeps them
    assert {n: e["pid"] for n, e in same.items()} == {n: e["pid"] for n, e in st.items()}


def test_a_refused_port_rolls_back_what_up_started(tmp_path):
    """Issue 44, 5: on 8c6205f a refusal on the MLflow port orphaned the Prefect server `up` had started (no
    servers.json: `status` and `down` knew nothing of it)."""
    import socket

    wd = tmp_path / "wd"
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        try:
            out = lifecycle("up", "--set", f"workdir={wd}", "--prefect-port", str(free_port()), "--mlflow-port",
                            str(port), "--no-runner", rc=2)
            assert f"mlflow: port {port} on 127.0.0.1 is already in use" in out.stderr, out.stderr
            left = [p for p in psutil.process_iter(["cwd"]) if p.info["cwd"] == str(wd.resolve())]
            assert left == [], f"up left {left} running"
            assert not (wd / ".servers" / "servers.json").exists()
        finally:
            for p in psutil.process_iter(["cwd"]):
                if p.info["cwd"] == str(wd.resolve()):
                    p.kill()


def test_down_stops_exactly_what_up_started(live):
    """Also after the MLflow server's main process is killed (an OOM kill): its worker serves on, and `down` stops
    it (8c6205f said "nothing was running" and left it writing mlflow.db)."""
    wd, st = live
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        pids = set().union(*(_group_pids(e["pid"]) for e in st.values()))
        assert len(_group_pids(st["mlflow"]["pid"])) > 1, "the MLflow server started no worker"
        os.kill(st["mlflow"]["pid"], 9)
        psutil.Process(st["mlflow"]["pid"]).wait(10)
        status = last_json(lifecycle("status", "--set", f"workdir={wd}", "--json").stdout)["mlflow"]
        assert status["running"] and status["leftover_pids"], status
        out = last_json(lifecycle("down", "--set", f"workdir={wd}", "--json").stdout)
        assert sorted(out["stopped"]) == ["mlflow", "prefect", "runner"]
        assert not (wd / ".servers" / "runner.sock").exists()
        assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)
        assert bystander.poll() is None  # an unrelated process is untouched
        assert not (wd / ".servers" / "prefect.pid").exists()
        again = last_json(lifecycle("down", "--set", f"workdir={wd}", "--json").stdout)
        assert again["stopped"] == []
    finally:
        bystander.kill()
