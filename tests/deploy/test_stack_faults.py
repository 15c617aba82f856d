"""Faults of the team stack (issue 46 §3): Postgres restarts under a running flow; the object store is down when the
run registers its model. Each run goes through the worker, as a scheduled one would, and is judged by its final
Prefect state: never left Running, completed, or failed with a message naming what failed, and a rerun completes."""

import time

import pytest

from tests.deploy.stack import (prefect, start_runs, tiny_config, tiny_inputs,
                                wait_runs, why_no_stack)

pytestmark = [pytest.mark.slow, pytest.mark.skipif(why_no_stack() is not None, reason=str(why_no_stack()))]



def start(stack, name: str) -> object:
    inputs = tiny_inputs(stack.work / f"in-{name}")
    return prefect(stack, lambda c: start_runs(c, {"nightly": {"config": tiny_config(name, stack.work / name,
                                                                                        inputs)}}))[0]


def wait_for(path_glob, stack, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not list(stack.work.glob(path_glob)):
        assert time.monotonic() < deadline, f"{path_glob} never appeared\n{stack.logs_tail()}"
        time.sleep(0.5)


def final(stack, run_id, timeout: float = 900):
    (run,) = prefect(stack, lambda c: wait_runs(c, [run_id], timeout))
    return run


def test_postgres_restart_mid_run(stack):
    run_id = start(stack, "pg")
    wait_for("pg/train/*/heartbeat/rank0", stack)  # the data stages are done, training is on
    t0 = time.monotonic()
    stack.sh("stop", "postgres")
    time.sleep(5)
    stack.sh("start", "postgres")
    outage_s = time.monotonic() - t0
    run = final(stack, run_id)
    assert run.state.is_final(), f"left {run.state.type.value}\n{stack.logs_tail()}"
    if run.state.type.value != "COMPLETED":  # a failure must say what failed; the rerun then completes
        assert run.state.message, run
        rerun = final(stack, start(stack, "pg"))
        assert rerun.state.type.value == "COMPLETED", rerun.state.message
    print(f"postgres down {outage_s:.0f} s: the run ended {run.state.type.value} ({run.state.message})")


def test_object_store_down_at_register(stack):
    from mlflow import MlflowClient

    run_id = start(stack, "s3")
    # trained: what is left logs artifacts (evaluate's examples, the charts, the model) and registers
    wait_for("s3/train/*/checkpoints/step_00000016/COMMITTED.json", stack, timeout=900)
    stack.sh("stop", "s3")
    t0 = time.monotonic()
    run = final(stack, run_id)
    detected_s = time.monotonic() - t0
    client = MlflowClient(tracking_uri=stack.mlflow_url, registry_uri=stack.mlflow_url)
    try:
        assert run.state.type.value == "FAILED", (run.state.type.value, stack.logs_tail())
        assert not client.search_model_versions("name='s3-gpt'"), "a model version was registered without its files"
    finally:
        stack.sh("start", "s3")
    t1 = time.monotonic()
    rerun = final(stack, start(stack, "s3"))
    assert rerun.state.type.value == "COMPLETED", (rerun.state.message, stack.logs_tail())
    (version,) = client.search_model_versions("name='s3-gpt'")
    assert version.status == "READY"
    print(f"object store down: the run failed {detected_s:.0f} s after ({run.state.message!r}); "
          f"the rerun completed in {time.monotonic() - t1:.0f} s")
