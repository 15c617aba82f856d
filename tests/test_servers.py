"""`lifecycle up/down/status` with the real servers: loopback only, used by `lifecycle run`, stopped exactly."""

import json
import os
import subprocess
import sys

import psutil
import pytest

from lifecycle import servers
from lifecycle.locking import WorkdirBusy, workdir_lock
from tests.conftest import ROOT

CLI = [sys.executable, "-m", "lifecycle.cli"]


def cli(*args, check=True, timeout=300):
    proc = subprocess.run([*CLI, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if check:
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    wd = tmp_path_factory.mktemp("srv")
    ports = [str(servers.free_port()), str(servers.free_port())]
    up = cli("up", "--set", f"workdir={wd}", "--prefect-port", ports[0], "--mlflow-port", ports[1], "--json")
    st = json.loads(up.stdout.strip().splitlines()[-1])
    yield wd, st
    cli("down", "--set", f"workdir={wd}", check=False)


def _group_pids(pid):
    procs = [psutil.Process(pid)] + psutil.Process(pid).children(recursive=True)
    return {p.pid for p in procs}


def test_up_status_and_loopback_only(live):
    wd, st = live
    assert set(st) == {"prefect", "mlflow"} and all(e["healthy"] for e in st.values())
    assert (wd / ".servers" / "prefect.pid").read_text().strip() == str(st["prefect"]["pid"])
    status = json.loads(cli("status", "--set", f"workdir={wd}", "--json").stdout.strip().splitlines()[-1])
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
    out = json.loads(cli(*args).stdout.strip().splitlines()[-1])
    assert out["orchestration"] == "servers" and out["mlflow_tracking_uri"] == st["mlflow"]["url"]
    # the MLflow server (not a SQLite file opened by the run) holds the run
    from mlflow import MlflowClient
    assert MlflowClient(st["mlflow"]["url"]).get_run(out["mlflow_run_id"]).info.status == "FINISHED"
    # the Prefect server recorded the flow run
    import urllib.request
    with urllib.request.urlopen(f"{st['prefect']['url']}/api/flow_runs/{out['prefect_flow_run_id']}") as r:
        assert json.loads(r.read())["state_type"] == "COMPLETED"
    # while another run holds the work dir, a second one refuses with a clear message
    with workdir_lock(wd):
        busy = cli(*args, check=False)
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


def test_serve_runs_on_the_cron_schedule_with_overlaps_cancelled(live, tmp_path):
    import time
    wd, st = live
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": f"s{i}", "text": f"scheduled doc {i} " * 30}) + "\n" for i in range(3)))
    serve = subprocess.Popen([*CLI, "serve", "--cron", "* * * * *", "--name", "every-minute", "--set", f"workdir={wd}",
                              "--set", f"collect.inputs=[\"{src}\"]", "--set", "name=served", "--until", "collect"],
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline, done = time.time() + 240, []
        while time.time() < deadline and not done:
            time.sleep(5)
            # the scheduler also inserts many future runs: ask only for finished ones
            runs = _api(st, "flow_runs/filter", {"limit": 10, "flow_runs": {"state": {"type": {
                "any_": ["COMPLETED", "FAILED", "CRASHED"]}}}})
            done = [r for r in runs if r["deployment_id"]]
        assert done, "no scheduled run finished within 4 minutes"
        run = done[0]
        assert run["state_type"] == "COMPLETED", run["state"]["message"]
        assert run["auto_scheduled"] is True  # started by the server's scheduler, not by hand
        dep = _api(st, f"deployments/{run['deployment_id']}")
        assert dep["name"] == "every-minute" and dep["schedules"][0]["schedule"]["cron"] == "* * * * *"
        limit = dep.get("global_concurrency_limit") or {}
        assert limit.get("limit") == 1, sorted(dep)
        # zombie detection: the automation that marks heartbeat-less runs Crashed is installed
        autos = _api(st, "automations/filter", {})
        zombie = next(a for a in autos if a["name"] == "lifecycle-zombie-runs")
        assert zombie["trigger"]["posture"] == "Proactive" and zombie["actions"][0]["state"] == "CRASHED"
        assert dep["concurrency_options"]["collision_strategy"] == "CANCEL_NEW"
    finally:
        serve.terminate()
        try:
            serve.wait(timeout=30)
        except subprocess.TimeoutExpired:
            serve.kill()


def test_down_stops_exactly_what_up_started(live):
    wd, st = live
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        pids = set().union(*(_group_pids(e["pid"]) for e in st.values()))
        out = json.loads(cli("down", "--set", f"workdir={wd}", "--json").stdout.strip().splitlines()[-1])
        assert sorted(out["stopped"]) == ["mlflow", "prefect"]
        assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)
        assert bystander.poll() is None  # an unrelated process is untouched
        assert not (wd / ".servers" / "prefect.pid").exists()
        again = json.loads(cli("down", "--set", f"workdir={wd}", "--json").stdout.strip().splitlines()[-1])
        assert again["stopped"] == []
    finally:
        bystander.kill()
