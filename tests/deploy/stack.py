"""deploy/stack.sh driven from Python: a stack in a folder of its own on free ports, tiny pipeline configs, and the
Prefect calls that run a deployment and wait for its flow runs. Used by tests/deploy/ and bench/team_stack.py."""

from __future__ import annotations

import asyncio
import glob
import json
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from tests.conftest import ROOT, corpus_records

STACK_SH = ROOT / "deploy" / "stack.sh"
# the e2e test's small run (tests/flows/test_flow_e2e.py), kept as one list there
from tests.flows.test_flow_e2e import TINY  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def why_no_stack() -> str | None:
    """Why deploy/stack.sh cannot run here (None: it can)."""
    if not glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"):
        return "Debian's postgresql is not installed (deploy/system-packages.sh)"
    if os.geteuid() == 0:
        try:
            import pwd

            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root and there is no `postgres` user for Postgres to run as"
    return None


class Stack:
    """One deploy/stack.sh stack: its folder (reachable by the `postgres` user), ports, password and environment."""

    def __init__(self):
        self.dir = Path(tempfile.mkdtemp(prefix="lifecycle-stack-"))
        self.dir.chmod(0o711)  # Postgres runs as another user when we are root
        # every character a pgpass file or a URL must escape (test_stack.py checks both servers reach Postgres)
        self.password = "pw:\\@/%'\" " + secrets.token_hex(12)
        self.ports = {k: free_port() for k in ("POSTGRES_PORT", "PREFECT_PORT", "MLFLOW_PORT", "S3_PORT")}
        self.env = {**os.environ, "LIFECYCLE_STACK_DIR": str(self.dir), "LIFECYCLE_ENV_FILE": "/dev/null",
                    "POSTGRES_PASSWORD": self.password, "AWS_ACCESS_KEY_ID": "lifecycle",
                    "AWS_SECRET_ACCESS_KEY": "s3-" + secrets.token_hex(12),
                    # the scheduler looks for due schedules every 5 s (60 s by default), the worker for runs every 3 s
                    "PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "5", "PREFECT_WORKER_QUERY_SECONDS": "3",
                    **{k: str(v) for k, v in self.ports.items()}}
        self.work = self.dir / "work"
        self.prefect_url = f"http://127.0.0.1:{self.ports['PREFECT_PORT']}/api"
        self.mlflow_url = f"http://127.0.0.1:{self.ports['MLFLOW_PORT']}"
        self.s3_url = f"http://127.0.0.1:{self.ports['S3_PORT']}"

    def sh(self, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run(["bash", str(STACK_SH), *args], env=self.env, capture_output=True, text=True,
                              timeout=timeout)
        if check:
            assert proc.returncode == 0, f"stack.sh {' '.join(args)}: exit {proc.returncode}\n{proc.stdout}\n" \
                                         f"{proc.stderr}\n{self.logs_tail()}"
        return proc

    def logs_tail(self, n: int = 3000) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-n:]}"
                         for p in sorted((self.dir / "logs").glob("*.log")))

    def client_env(self) -> dict:
        """What a client of the stack gets (`deploy/stack.sh env`): no secret."""
        return {"PREFECT_API_URL": self.prefect_url, "MLFLOW_TRACKING_URI": self.mlflow_url}

    def close(self) -> None:
        self.sh("stop", check=False, timeout=180)
        shutil.rmtree(self.dir, ignore_errors=True)


def tiny_inputs(folder: Path, n: int = 120) -> str:
    """A JSONL file of the bundled corpus's first `n` records in `folder`; its path."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "docs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in corpus_records(n)))
    return str(path)


def tiny_config(name: str, workdir: Path, inputs: str, extra: tuple[str, ...] = ()) -> dict:
    """deploy/configs/demo.yaml made small (the e2e test's overrides), as a deployment's `config` parameter."""
    from lifecycle.config import load_config

    cfg = load_config(ROOT / "deploy/configs/demo.yaml",
                      [*TINY, f"workdir={workdir}", f"collect.inputs={json.dumps([inputs])}", f"name={name}",
                       f"tracking.model_name={name}-gpt", *extra])
    return cfg.model_dump(mode="json")


def prefect(stack: Stack, coro_fn, *args):
    """Run `coro_fn(client, *args)` with a Prefect client of the stack's server."""
    from prefect.client.orchestration import PrefectClient

    async def go():
        async with PrefectClient(stack.prefect_url) as client:
            return await coro_fn(client, *args)

    return asyncio.run(go())


async def start_runs(client, runs: dict[str, dict]) -> list:
    """{deployment name: parameters} -> the ids of the flow runs created (the worker picks them up)."""
    ids = []
    for name, params in runs.items():
        dep = await client.read_deployment_by_name(f"lifecycle/{name}")
        ids.append((await client.create_flow_run_from_deployment(dep.id, parameters=params)).id)
    return ids


async def wait_runs(client, ids: list, timeout: float = 1200) -> list:
    """The flow runs once all are final (Completed, Failed, Crashed, Cancelled)."""
    deadline = time.monotonic() + timeout
    while True:
        runs = [await client.read_flow_run(i) for i in ids]
        if all(r.state.is_final() for r in runs) or time.monotonic() > deadline:
            return runs
        await asyncio.sleep(3)


def run_outputs(stack: Stack, workdir: Path, model_name: str) -> dict:
    """bench.chaos.outputs of a completed run through the worker, which returns its summary to no one: the summary
    rebuilt from what the run left, its work dir's `latest/` links (each stage's dataset, the final checkpoint) and
    the metrics on the MLflow run of its registered model version."""
    from mlflow import MlflowClient

    from bench.chaos import outputs

    latest = workdir / "latest"
    client = MlflowClient(tracking_uri=stack.mlflow_url, registry_uri=stack.mlflow_url)
    (version,) = client.search_model_versions(f"name='{model_name}'")
    return outputs({"status": "completed", "checkpoint": str(latest / "train"),
                    "datasets": {p.name: str(p / "_manifest.json") for p in latest.iterdir() if p.name != "train"},
                    "metrics": client.get_run(version.run_id).data.metrics})


async def left_running(client) -> list[str]:
    """Flow runs and task runs the server still holds as Running: '<kind> <name> (<id>)'."""
    from prefect.client.schemas.filters import (FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType,
                                                TaskRunFilter, TaskRunFilterState, TaskRunFilterStateType)
    from prefect.client.schemas.objects import StateType

    flows = await client.read_flow_runs(flow_run_filter=FlowRunFilter(
        state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.RUNNING]))))
    tasks = await client.read_task_runs(task_run_filter=TaskRunFilter(
        state=TaskRunFilterState(type=TaskRunFilterStateType(any_=[StateType.RUNNING]))))
    return [f"flow run {r.name} ({r.id})" for r in flows] + [f"task run {r.name} ({r.id})" for r in tasks]


async def pause_yaml_schedules(client) -> None:
    """Deactivate the schedules deploy/prefect.yaml gave (nightly, hourly): a test runs only what it starts."""
    for name in ("nightly", "code-nightly", "data-only-hourly"):
        dep = await client.read_deployment_by_name(f"lifecycle/{name}")
        for s in dep.schedules:
            await client.update_deployment_schedule(dep.id, s.id, active=False)
