"""`lifecycle up/down/status` with the real servers: loopback only, used by `lifecycle run`, stopped exactly."""

import json
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
    assert set(st) == {"prefect", "mlflow"} and all(e["healthy"] for e in st.values())
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


def test_down_stops_exactly_what_up_started(live):
    wd, st = live
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        pids = set().union(*(_group_pids(e["pid"]) for e in st.values()))
        out = last_json(lifecycle("down", "--set", f"workdir={wd}", "--json").stdout)
        assert sorted(out["stopped"]) == ["mlflow", "prefect"]
        assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)
        assert bystander.poll() is None  # an unrelated process is untouched
        assert not (wd / ".servers" / "prefect.pid").exists()
        again = last_json(lifecycle("down", "--set", f"workdir={wd}", "--json").stdout)
        assert again["stopped"] == []
    finally:
        bystander.kill()
