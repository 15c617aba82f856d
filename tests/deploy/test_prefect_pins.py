"""Prefect 3.8.8's client against its server under the FastAPI that constraints.txt pins: the client sends
`"limit": null` (and `"offset"`, `"sort"`) when a caller gives none, and FastAPI 0.151-0.154 validate that null
against the field's `int` and answer 422, where 0.150 and earlier take the field's default. `prefect deploy --all`
stopped after its first deployment on that 422, and `prefect deployment ls` and `prefect flow-run ls` failed."""

import asyncio
import uuid


def test_client_calls_without_limit_or_sort_are_answered(tmp_path, monkeypatch):
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path))
    monkeypatch.setenv("PREFECT_SERVER_DATABASE_CONNECTION_URL", f"sqlite+aiosqlite:///{tmp_path}/prefect.db")
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    from prefect.client.orchestration import PrefectClient
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.server.api.server import create_app

    # a pool of its own: in a test process where Prefect's settings were read before, the server keeps the
    # database it was given then, which other tests' pools and runs share
    pool = f"pins-{uuid.uuid4().hex[:12]}"

    async def calls():
        async with PrefectClient(api=create_app(ephemeral=True)) as client:
            await client.create_work_pool(WorkPoolCreate(name=pool, type="process"))
            # what `prefect deploy` calls after each deployment, `deployment ls` and `flow-run ls`: no limit given
            return (await client.read_workers_for_work_pool(pool), await client.read_deployments(),
                    await client.read_flow_runs())

    workers, deployments, runs = asyncio.run(calls())  # a 422 raises here
    assert workers == [] and isinstance(deployments, list) and isinstance(runs, list)
