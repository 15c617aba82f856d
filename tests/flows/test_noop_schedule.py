"""Scheduled runs: a tick with no new input commits no dataset, opens no MLflow run and logs one line on its Prefect
flow run; a served deployment reads its YAML when each run starts; the `prefect deployment run` command that
`serve` prints works pasted as printed."""

from __future__ import annotations

import contextlib
import json
import sqlite3
import subprocess
import sys
import textwrap

import pytest

from lifecycle.flows.serve import deployment_parameters, serve_message
from tests.conftest import ROOT, last_json, lifecycle


def _inputs(tmp_path, n=5):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": f"d{i}", "text": f"document number {i} " * 30}) + "\n" for i in range(n)))
    return src


def _mlflow_runs(wd) -> int:
    with contextlib.closing(sqlite3.connect(f"file:{wd}/mlflow.db?mode=ro", uri=True)) as con:
        return con.execute("SELECT count(*) FROM runs").fetchone()[0]


def _flow_run_logs(wd, flow_run_id: str) -> list[str]:
    """The log lines Prefect stored for a flow run (the embedded server's database is in <workdir>/.prefect)."""
    with contextlib.closing(sqlite3.connect(f"file:{wd}/.prefect/prefect.db?mode=ro", uri=True)) as con:
        return [r[0] for r in con.execute("SELECT message FROM log WHERE flow_run_id = ? ORDER BY timestamp",
                                          [flow_run_id])]


def test_a_run_with_no_new_input_commits_nothing_and_opens_no_mlflow_run(tmp_path):
    wd, src = tmp_path / "wd", _inputs(tmp_path)
    args = ["run", "--json", "--until", "collect", "--set", f"workdir={wd}", "--set", f'collect.inputs=["{src}"]',
            "--set", "collect.incremental=true"]
    first = last_json(lifecycle(*args).stdout)
    assert first["status"] == "completed"
    collects = sorted((wd / "datasets" / "collect").iterdir())
    runs = _mlflow_runs(wd)
    # the flow told the audit catalog about its commit
    assert [e["dataset"]["sha256"] for e in json.loads((wd / "catalog" / "index.json").read_text())["datasets"].values()] == \
        [json.loads(open(first["datasets"]["collect"]).read())["sha256"]]

    again = last_json(lifecycle(*args).stdout)
    assert again["status"] == "no_new_inputs" and again["mlflow_run_id"] is None and again["stages"] == {}
    assert sorted((wd / "datasets" / "collect").iterdir()) == collects  # no empty dataset
    assert _mlflow_runs(wd) == runs  # no new parent run (nor child runs)
    lines = _flow_run_logs(wd, again["prefect_flow_run_id"])
    assert len([ln for ln in lines if "no new input files" in ln]) == 1, lines
    assert any("collected by earlier runs" in ln for ln in lines)


# what a served deployment's run does: Prefect calls the flow with the deployment's JSON parameters
SERVED = textwrap.dedent("""
    import json, sys
    from lifecycle.flows.startup.environment import prepare_environment
    params = json.loads(sys.argv[1])
    prepare_environment(sys.argv[2])
    from lifecycle.flows.pipeline import lifecycle_flow
    print(json.dumps(lifecycle_flow(**params)))
""")


def test_a_served_run_reads_the_yaml_when_it_starts(tmp_path):
    wd, src = tmp_path / "wd", _inputs(tmp_path)
    yaml_file = tmp_path / "pipeline.yaml"
    yaml_file.write_text(f"name: served\nworkdir: {wd}\ncollect:\n  inputs: ['{src}']\n  rows_per_shard: 10\n")
    # the parameters as they travel through Prefect's API: JSON
    params = json.loads(json.dumps(deployment_parameters(str(yaml_file), ["collect.shard_bytes=1000000"], "collect")))
    assert params == {"config_file": str(yaml_file), "overrides": ["collect.shard_bytes=1000000"], "until": "collect"}

    def served_run() -> dict:
        proc = subprocess.run([sys.executable, "-c", SERVED, json.dumps(params), str(wd)], cwd=ROOT,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        return last_json(proc.stdout)

    first = served_run()
    yaml_file.write_text(yaml_file.read_text().replace("rows_per_shard: 10", "rows_per_shard: 20"))  # edited while served
    second = served_run()
    configs = [json.loads(open(r["datasets"]["collect"]).read())["config"] for r in (first, second)]
    assert [c["rows_per_shard"] for c in configs] == [10, 20] and {c["shard_bytes"] for c in configs} == {1000000}
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{wd}/mlflow.db")
    tags = [client.get_run(r["mlflow_run_id"]).data.tags for r in (first, second)]
    assert [t["lifecycle.config_file"] for t in tags] == [str(yaml_file)] * 2
    assert tags[0]["lifecycle.config_file_sha256"] != tags[1]["lifecycle.config_file_sha256"]
    assert any("config read at run start" in ln and str(yaml_file) in ln
               for ln in _flow_run_logs(wd, second["prefect_flow_run_id"]))


def test_the_printed_hint_names_the_server_and_the_prefect_next_to_python():
    msg = serve_message("deploy/configs/demo.yaml", "nightly run", "http://127.0.0.1:4321/api")
    cmd = msg.splitlines()[-1].strip()
    assert cmd == (f"PREFECT_API_URL=http://127.0.0.1:4321/api {sys.executable.rsplit('/', 1)[0]}/prefect "
                   "deployment run 'lifecycle/nightly run'")
    assert f"each run reads {ROOT / 'deploy/configs/demo.yaml'} when it starts" in msg


@pytest.mark.slow
def test_the_printed_deployment_run_command_works_as_printed(tmp_path):
    """`lifecycle up`, `lifecycle serve`, then the printed command in a shell without PREFECT_API_URL: the run it
    creates completes on the served deployment."""
    import os
    import time
    import urllib.request

    from lifecycle.core.procs import free_port

    wd, src = tmp_path / "wd", _inputs(tmp_path)
    up = last_json(lifecycle("up", "--set", f"workdir={wd}", "--prefect-port", str(free_port()), "--mlflow-port",
                             str(free_port()), "--json").stdout)
    serve = subprocess.Popen([sys.executable, "-m", "lifecycle.cli", "serve", "--cron", "0 0 1 1 *", "--name", "hinted",
                              "--set", f"workdir={wd}", "--set", f'collect.inputs=["{src}"]', "--until", "collect"],
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        while not any("deployment run" in ln for ln in lines):
            line = serve.stdout.readline()
            assert line, "".join(lines)
            lines.append(line)
        cmd = lines[-1].strip()
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
        out = subprocess.run(["bash", "-c", cmd], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr
        run_id = next(ln.split()[-1] for ln in out.stdout.splitlines() if "UUID" in ln)
        deadline, state = time.time() + 300, None
        while time.time() < deadline and state not in ("COMPLETED", "FAILED", "CRASHED"):
            time.sleep(3)
            with urllib.request.urlopen(f"{up['prefect']['url']}/api/flow_runs/{run_id}") as r:
                state = json.loads(r.read())["state_type"]
        assert state == "COMPLETED"
    finally:
        serve.terminate()
        serve.wait(timeout=60)
        lifecycle("down", "--set", f"workdir={wd}", rc=None)
