"""Faults of the team stack (issue 46 §3): Postgres restarts under a running flow; the object store is down when the
run registers its model. Each run goes through the worker, as a scheduled one would, and is judged by its final
Prefect state: never left Running, completed, or failed with a message naming what failed, and a rerun completes.
What the run (or its rerun) produced is then compared with an undisturbed run of the same config on the same stack,
by bench/chaos.py's measure of identical: each dataset's sha256 and row counts, the model package's files, the
final weights and the run's metrics."""

import os
import time

import pytest

from bench.chaos import compare
from tests.deploy.stack import (left_running, prefect, run_outputs, start_runs, tiny_config, tiny_inputs,
                                wait_runs, why_no_stack)

pytestmark = [pytest.mark.slow, pytest.mark.skipif(why_no_stack() is not None, reason=str(why_no_stack()))]


def start(stack, name: str) -> object:
    inputs = tiny_inputs(stack.work / "in-faults")  # one file for every run: a row's source names its path
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


def differences(stack, name: str, undisturbed: dict) -> dict:
    got = run_outputs(stack, stack.work / name, f"{name}-gpt")
    return {k: (got.get(k), undisturbed[k]) for k in compare(got, undisturbed)}


def load() -> str:
    return "load average " + " ".join(f"{x:.1f}" for x in os.getloadavg())


@pytest.fixture(scope="module")
def undisturbed(stack):
    """The same config through the worker with nothing disturbed: what a disturbed run must reproduce."""
    run = final(stack, start(stack, "ref"))
    assert run.state.type.value == "COMPLETED", (run.state.message, stack.logs_tail())
    return run_outputs(stack, stack.work / "ref", "ref-gpt")


def test_postgres_restart_mid_run(stack, undisturbed):
    run_id = start(stack, "pg")
    wait_for("pg/train/*/heartbeat/rank0", stack)  # the data stages are done, training is on
    t0 = time.monotonic()
    stack.sh("stop", "postgres")
    time.sleep(5)
    stack.sh("start", "postgres")
    back, outage_s = time.monotonic(), time.monotonic() - t0
    run = final(stack, run_id)
    ended_s, rerun_s = time.monotonic() - back, None
    assert run.state.is_final(), f"left {run.state.type.value}\n{stack.logs_tail()}"
    if run.state.type.value != "COMPLETED":  # a failure must say what failed; the rerun then completes
        assert run.state.message, run
        t1 = time.monotonic()
        rerun = final(stack, start(stack, "pg"))
        assert rerun.state.type.value == "COMPLETED", rerun.state.message
        rerun_s = time.monotonic() - t1
    assert not prefect(stack, left_running), "left Running after the restart"
    assert not (diff := differences(stack, "pg", undisturbed)), f"outputs differ from the undisturbed run's: {diff}"
    print(f"postgres down {outage_s:.0f} s: the run ended {run.state.type.value} {ended_s:.0f} s after Postgres was "
          f"back ({run.state.message}); rerun: {'not needed' if rerun_s is None else f'{rerun_s:.0f} s'}; "
          f"outputs identical to the undisturbed run's ({len(undisturbed)} compared); {load()}")


def test_object_store_down_at_register(stack, undisturbed):
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
    rerun_s = time.monotonic() - t1
    (version,) = client.search_model_versions("name='s3-gpt'")
    assert version.status == "READY"
    assert not prefect(stack, left_running), "left Running after the outage"
    assert not (diff := differences(stack, "s3", undisturbed)), f"outputs differ from the undisturbed run's: {diff}"
    print(f"object store down: the run failed {detected_s:.0f} s after ({run.state.message!r}); the rerun completed "
          f"in {rerun_s:.0f} s, registered once, outputs identical to the undisturbed run's "
          f"({len(undisturbed)} compared); {load()}")
