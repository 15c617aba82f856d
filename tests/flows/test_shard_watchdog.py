"""The shard watchdog and the shards' retries, on both local shard runners (in the flow process, and a pool of
worker processes; the first shard process there imports pandas, via pyarrow, for a few seconds): a shard
blocked in a call no thread timeout can interrupt is killed after `shard_timeout_s` without progress, it fails
naming the stage and shard, the runner's retry builds it again and the stage completes; with no retry left, the
flow fails with that message. An error a retry cannot heal is not retried."""

import os
import time

import pytest
from prefect import flow
from prefect.testing.utilities import prefect_test_harness

from lifecycle.config import OrchestrationConfig
from lifecycle.core.shards import ShardTimeout, commit_plan
from lifecycle.core.dataset import DatasetDamaged
from lifecycle.flows.shards import ShardRunner
from tests.core.test_watchdog import _plan


@pytest.fixture(scope="module", autouse=True)
def prefect_server(tmp_path_factory):
    os.environ["PREFECT_RESULTS_LOCAL_STORAGE_PATH"] = str(tmp_path_factory.mktemp("results"))
    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.mark.parametrize("workers", [0, 1])
def test_blocked_shard_is_killed_and_retried(tmp_path, workers):
    orch = OrchestrationConfig(dask_workers=workers, shard_timeout_s=3, retry_backoff_s=0.01, retry_jitter=0)
    plan = _plan(tmp_path, [["a"], ["block"]])

    @flow
    def f():
        runner = ShardRunner(orch)
        try:
            return runner.map(plan, len(plan.shards), retries=1)
        finally:
            runner.close()

    t = time.monotonic()
    results = f()
    assert [r["reused"] for r in results] == [False, False]
    assert time.monotonic() - t < 60
    assert commit_plan(plan).read().column("item").to_pylist() == ["a", "block"]


def test_blocked_shard_without_retries_fails_the_flow_clearly(tmp_path):
    orch = OrchestrationConfig(dask_workers=0, shard_timeout_s=3)
    plan = _plan(tmp_path, [["block"]])

    @flow
    def f():
        runner = ShardRunner(orch)
        try:
            return runner.map(plan, 1, retries=0)
        finally:
            runner.close()

    with pytest.raises(ShardTimeout, match="hangs: shard 0 of 1 made no progress for 3 s"):
        f()


def test_a_cluster_started_early_runs_the_shards_then_closes_in_the_background(tmp_path):
    """The flow starts its LocalCluster before it needs it (its workers start while MLflow sets up) and shuts it
    down in the background after the last data stage; `close` waits for that."""
    orch = OrchestrationConfig(dask_workers=1, shard_timeout_s=60)
    plan = _plan(tmp_path, [["a"], ["b"]])
    timing: dict[str, float] = {}

    @flow
    def f():
        runner = ShardRunner(orch, timing)
        runner.start_soon()
        try:
            out = runner.map(plan, len(plan.shards), retries=0)
            runner.close_soon()
            return out
        finally:
            runner.close()
            assert runner._runner is None and runner._closing is None

    assert [r["reused"] for r in f()] == [False, False]
    assert timing["dask_start"] <= timing["dask_ready"] <= timing["dask_close_start"] <= timing["dask_closed"]
    assert commit_plan(plan).read().column("item").to_pylist() == ["a", "b"]


def test_a_cluster_that_fails_to_start_in_the_background_fails_the_first_map(tmp_path):
    runner = ShardRunner(OrchestrationConfig(dask_workers=1))

    def no_cluster():
        raise OSError("no port for the scheduler")

    runner._make = no_cluster
    runner.start_soon()
    with pytest.raises(OSError, match="no port for the scheduler"):
        runner.map(_plan(tmp_path, [["a"]]), 1, retries=0)
    runner.close()  # nothing to close, no error


@pytest.mark.parametrize("workers", [0, 1])
def test_an_error_a_retry_cannot_heal_is_not_retried_and_progress_counts_every_shard(tmp_path, workers):
    """A damaged parent (DatasetDamaged) fails at once, retries or not; the shards that finished are published and
    reported, so the rerun that rebuilds the parent resumes them."""
    orch = OrchestrationConfig(dask_workers=workers, shard_timeout_s=30, retry_backoff_s=5, retry_jitter=0)
    plan = _plan(tmp_path, [["a"], ["raise"]])
    runner, seen = ShardRunner(orch), []
    t = time.monotonic()
    try:
        with pytest.raises(DatasetDamaged, match="sha256 mismatch"):
            runner.map(plan, len(plan.shards), retries=3, on_progress=lambda: seen.append(plan.done_shards()))
    finally:
        runner.close()
    assert time.monotonic() - t < 30  # no 5 s backoff was waited
    assert plan.done_shards() == [0] and (workers == 1 or seen == [[0]])


def test_a_dead_worker_is_replaced_and_its_shard_retried(tmp_path):
    """A worker process killed under its shard (the OOM killer, an operator) breaks the pool: the runner starts a
    new one and retries the shard, whose forked process died with the worker (PR_SET_PDEATHSIG)."""
    orch = OrchestrationConfig(dask_workers=2, shard_timeout_s=30, retry_backoff_s=0.01, retry_jitter=0)
    plan = _plan(tmp_path, [["busy"], ["kill_worker"], ["a"]], busy_s=3)  # "busy" is in the other worker
    runner = ShardRunner(orch)
    try:
        first = runner._wait_started() or runner._open() or runner._runner
        results = runner.map(plan, len(plan.shards), retries=1)
        assert runner._runner is not first  # replaced
    finally:
        runner.close()
    assert [r["rows_kept"] for r in results] == [1, 1, 1]
    assert commit_plan(plan).read().column("item").to_pylist() == ["busy", "kill_worker", "a"]


def test_shards_run_on_a_dask_cluster_at_dask_address(tmp_path):
    """`orchestration.dask_address`: the shards are futures on that cluster (here a LocalCluster started by the
    test, as `dask scheduler` and `dask worker --preload lifecycle.flows.worker_preload` would run it), retried
    there the same way."""
    from distributed import LocalCluster

    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, host="127.0.0.1", dashboard_address=None,
                      preload=["lifecycle.flows.worker_preload"]) as cluster:
        orch = OrchestrationConfig(dask_address=cluster.scheduler_address, shard_timeout_s=3, retry_backoff_s=0.01,
                                   retry_jitter=0)
        plan = _plan(tmp_path, [["a"], ["block"]])
        runner = ShardRunner(orch)
        try:
            assert [r["reused"] for r in runner.map(plan, len(plan.shards), retries=1)] == [False, False]
        finally:
            runner.close()
    assert commit_plan(plan).read().column("item").to_pylist() == ["a", "block"]


def test_the_pool_dies_with_its_flow_process():
    """A SIGKILL of the flow process (`lifecycle run`) leaves no worker, forkserver or resource tracker behind: each
    worker watches the flow's pid (without that, all of them waited on each other for ever; found by bench.chaos)."""
    import signal
    import subprocess
    import sys

    import psutil

    script = ("from lifecycle.flows.pools import LocalPool\nimport time\np = LocalPool(2)\np.start()\n"
              "print(flush=True)\ntime.sleep(600)\n")
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout.readline() == "\n", "the pool did not start"
        pool = psutil.Process(owner.pid).children(recursive=True)
        assert len([p for p in pool if "forkserver" in " ".join(p.cmdline())]) >= 3  # the server and 2 workers
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        _, alive = psutil.wait_procs(pool, timeout=15)
        assert not alive, f"outlived the flow process by 15 s: {[(p.pid, p.cmdline()[-1][:60]) for p in alive]}"
    finally:
        owner.kill()
