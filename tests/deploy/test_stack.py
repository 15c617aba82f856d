"""The team stack, for real (issue 46): deploy/stack.sh starts Debian's Postgres in a folder of its own, the Prefect
server and the MLflow server on it (artifacts in moto's S3 server), a process worker and the deployments of
deploy/prefect.yaml. Two pipelines run through the worker at once, each in its own work dir, and register their
models; a short schedule fires a run; no password lands in MLflow, a log or an artifact; `stop` ends it all."""

import asyncio
import time
from datetime import timedelta

import pytest

from tests.deploy.stack import (prefect, start_runs, tiny_config, tiny_inputs,
                                wait_runs, why_no_stack)

pytestmark = [pytest.mark.slow, pytest.mark.skipif(why_no_stack() is not None, reason=str(why_no_stack()))]



@pytest.fixture(scope="module")
def two_runs(stack):
    """nightly and code-nightly at the same time, each made small and given its own work dir."""
    inputs = tiny_inputs(stack.work / "incoming-tiny")
    params = {dep: {"config": tiny_config(name, stack.work / name, inputs)}
              for dep, name in (("nightly", "team-a"), ("code-nightly", "team-b"))}
    started = time.monotonic()
    runs = prefect(stack, _start_and_wait, params)
    return runs, time.monotonic() - started


async def _start_and_wait(client, params):
    return await wait_runs(client, await start_runs(client, params))


def test_two_pipelines_run_at_once_through_the_worker(stack, two_runs):
    runs, _ = two_runs
    assert [r.state.type.value for r in runs] == ["COMPLETED", "COMPLETED"], (
        [r.state.message for r in runs], stack.logs_tail())
    # at the same time: each started before the other ended
    (a, b) = runs
    assert a.start_time < b.end_time and b.start_time < a.end_time
    for name in ("team-a", "team-b"):  # each in its own work dir, trained to the end
        assert list((stack.work / name).glob("datasets/checkpoint/*/_manifest.json")), name


def test_models_are_in_postgres_backed_mlflow_with_artifacts_in_s3(stack, two_runs):
    import boto3
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=stack.mlflow_url, registry_uri=stack.mlflow_url)
    s3 = boto3.client("s3", endpoint_url=stack.s3_url, region_name="us-east-1", aws_access_key_id="x",
                      aws_secret_access_key="x")
    keys = {o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket="lifecycle-artifacts")
            for o in page.get("Contents", [])}
    for name in ("team-a-gpt", "team-b-gpt"):
        (version,) = client.search_model_versions(f"name='{name}'")
        assert version.status == "READY" and version.source.startswith("mlflow-artifacts:/")
        run_path = version.source.split(":/", 1)[1]  # <experiment>/<run>/artifacts/model
        model_files = {k for k in keys if k.startswith(f"mlflow/{run_path}/")}
        assert any(k.endswith("COMMITTED.json") for k in model_files), sorted(keys)[:20]
    # the tracking store is Postgres: the server's log names no SQLite file and the work dirs hold no mlflow.db
    assert not list(stack.work.glob("*/mlflow.db"))


def test_no_secret_lands_in_mlflow_logs_or_artifacts(stack, two_runs):
    import boto3
    from mlflow import MlflowClient

    secrets = [stack.password, stack.env["AWS_SECRET_ACCESS_KEY"]]
    client = MlflowClient(tracking_uri=stack.mlflow_url)
    exps = [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(exps, max_results=1000)
    assert len(runs) >= 2
    for run in runs:
        text = repr(run.data.params) + repr(run.data.tags)
        assert not any(s in text for s in secrets), run.info.run_id
    s3 = boto3.client("s3", endpoint_url=stack.s3_url, region_name="us-east-1", aws_access_key_id="x",
                      aws_secret_access_key="x")
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket="lifecycle-artifacts"):
        for o in page.get("Contents", []):
            body = s3.get_object(Bucket="lifecycle-artifacts", Key=o["Key"])["Body"].read()
            assert not any(s.encode() in body for s in secrets), o["Key"]  # model cards, configs, charts
    # every log and every file of the work dirs (the secret files and Postgres' own data aside)
    for path in [*stack.dir.joinpath("logs").rglob("*"), *stack.work.rglob("*")]:
        if path.is_file():
            data = path.read_bytes()
            assert not any(s.encode() in data for s in secrets), path
    # nor any server's or the worker's environment
    for pidfile in stack.dir.joinpath("pids").glob("*.pid"):
        environ = open(f"/proc/{pidfile.read_text().strip()}/environ", "rb").read()
        assert not any(s.encode() in environ for s in secrets), pidfile.stem


def test_a_short_schedule_fires_a_run(stack):
    """The data-only deployment, given a 20 s interval schedule with a small config, runs on its own."""
    from prefect.client.schemas.filters import (DeploymentFilter, DeploymentFilterId, FlowRunFilter,
                                                FlowRunFilterState, FlowRunFilterStateType)
    from prefect.client.schemas.objects import StateType
    from prefect.client.schemas.schedules import IntervalSchedule
    from prefect.client.schemas.sorting import FlowRunSort

    inputs = tiny_inputs(stack.work / "incoming-sched", n=60)
    params = {"config": tiny_config("team-sched", stack.work / "sched", inputs), "until": "tokenize"}

    async def schedule_and_wait(client):
        dep = await client.read_deployment_by_name("lifecycle/data-only-hourly")
        (made,) = await client.create_deployment_schedules(
            dep.id, [(IntervalSchedule(interval=timedelta(seconds=20)), True)], max_scheduled_runs=1,
            parameters=params)
        try:
            return await first_scheduled_run(client, dep.id)
        finally:  # one is enough: no more runs every 20 s
            await client.delete_deployment_schedule(dep.id, made.id)

    async def first_scheduled_run(client, deployment_id):
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            # the scheduler keeps runs queued ahead: ask for this deployment's ended ones only, oldest first
            done = await client.read_flow_runs(
                flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(
                    any_=[StateType.COMPLETED, StateType.FAILED, StateType.CRASHED]))),
                deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])),
                sort=FlowRunSort.EXPECTED_START_TIME_ASC)
            done = [r for r in done if r.auto_scheduled]
            if done:
                return done[0]
            await asyncio.sleep(3)
        return None

    run = prefect(stack, schedule_and_wait)
    assert run is not None, stack.logs_tail()
    assert run.state.type.value == "COMPLETED", run.state.message
    assert (stack.work / "sched" / "datasets" / "tokenize").is_dir()


def test_a_password_with_url_and_pgpass_characters_works(stack):
    """The stack's Postgres password holds `:` `\\` `@` `/` `%` `'` `"` and a space (tests/deploy/stack.py): MLflow
    (libpq's pgpass, escaped) and the Prefect server (asyncpg, given it as a setting) both reach their databases."""
    from mlflow import MlflowClient

    assert set(":\\@/%'\" ") <= set(stack.password)
    assert prefect(stack, lambda c: c.read_deployment_by_name("lifecycle/nightly")).name == "nightly"
    assert MlflowClient(tracking_uri=stack.mlflow_url).search_experiments()  # rows from Postgres
    assert "password authentication failed" not in (stack.dir / "postgres/postgres.log").read_text(errors="replace")


def test_stop_ends_every_process(stack):
    pids = {p.stem: int(p.read_text()) for p in stack.dir.joinpath("pids").glob("*.pid")}
    assert set(pids) == {"postgres", "s3", "mlflow", "prefect", "worker"}
    stack.sh("stop")
    time.sleep(1)
    alive = {name for name, pid in pids.items() if _alive(pid)}
    assert not alive, alive
    stack.sh("start")  # the module fixture's `stop` then finds it up again, as after any test


def _alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
