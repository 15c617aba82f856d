"""`ShardRunner`: runs the shards of the data stages on a pool (flows/pools.py), with the stage's retries.

Shards are plain futures of `run_shard_watched`, not Prefect tasks: a Prefect task run per shard costs far more
than a future (docs/benchmarks.md, "Issue 25: shards as plain futures on a forkserver pool"). Prefect sees each
sharded stage as three tasks (`<stage>-plan`, `<stage>-shards`, `<stage>-commit`); the shards' retries are done
here, as Prefect's were: `data_retries` per shard, exponential backoff from `retry_backoff_s` with `retry_jitter`,
none for an error a retry cannot heal, each retry logged on the flow run.
"""

from __future__ import annotations

import logging
import random
import threading
import time
import uuid
from typing import Callable

from lifecycle.config import OrchestrationConfig
from lifecycle.core.shards import StagePlan, run_shard_watched
from lifecycle.flows.pools import DaskPool, LocalPool
from lifecycle.flows.retry import PERMANENT_ERRORS

log = logging.getLogger(__name__)


class ShardRunner:
    """Runs the shards of the data stages, started on first use and shut down with the flow.

    `dask_workers` local worker processes by default (`LocalPool`), the Dask cluster at `dask_address` when one is
    configured (`DaskPool`), or (`dask_workers: 0`) one shard after another in a thread of the flow process. It is
    chosen per run from the config, so deployments served from `prefect.yaml` get the same behaviour as
    `lifecycle run`. `timing` (the run's, `RunSummary.timing`) gets dask_start/dask_ready/dask_close_start/dask_closed.
    """

    def __init__(self, orchestration: OrchestrationConfig, timing: dict[str, float] | None = None):
        self.orch = orchestration
        self._runner: LocalPool | DaskPool | None = None
        self._starting: threading.Thread | None = None
        self._start_error: BaseException | None = None
        self._closing: threading.Thread | None = None
        self.timing = {} if timing is None else timing

    def start_soon(self) -> None:
        """Start the local workers in a background thread now, so that they start (an interpreter and the data
        stages' imports) while the flow sets up its MLflow run and plans collect; `map` waits for them. Only local
        workers: a configured cluster is already up, and `dask_workers: 0` runs shards in this process."""
        if self._runner is not None or self._starting is not None or self.orch.dask_address \
                or self.orch.dask_workers == 0:
            return

        def start() -> None:
            try:
                self._open()
            except BaseException as e:  # noqa: BLE001 - raised by the `map` that waits for it
                self._start_error = e

        self._starting = threading.Thread(target=start, name="lifecycle-shards-start", daemon=True)
        self._starting.start()

    def _wait_started(self) -> None:
        if self._starting is not None:
            self._starting.join()
            self._starting = None
            if self._start_error is not None:
                error, self._start_error = self._start_error, None
                raise error

    def _open(self) -> None:
        self.timing.setdefault("dask_start", time.time())
        runner = self._make()
        try:
            runner.start()
        except BaseException:  # a signal or a broken worker mid-start: the workers started so far go, not leak
            runner.close(kill=True)
            raise
        self._runner = runner
        self.timing.setdefault("dask_ready", time.time())

    def _make(self):
        if self.orch.dask_address:
            return DaskPool(self.orch.dask_address)
        return LocalPool(max(self.orch.dask_workers, 1), processes=self.orch.dask_workers > 0)

    def map(self, plan: StagePlan, n: int, retries: int, on_progress: Callable[[], None] | None = None) -> list:
        """Run shards 0..n-1 of `plan` (`run_shard_watched`); `on_progress()` after each one finishes. A failed
        shard is retried up to `retries` times; the first shard that fails for good fails the map (the others
        are stopped: what they published stays, for the retry of the stage or a rerun)."""
        if self._closing is not None:  # a data stage after close_soon: the old workers are gone first
            self.close()
        self._wait_started()
        if self._runner is None:
            self._open()
        return self._futures(plan, n, retries, on_progress or (lambda: None))

    def _futures(self, plan: StagePlan, n: int, retries: int, progress: Callable[[], None]) -> list:
        from concurrent.futures.process import BrokenProcessPool

        token = uuid.uuid4().hex[:8]

        def submit(i: int, attempt: int):
            return self._runner.submit(run_shard_watched, plan, i, self.orch.shard_timeout_s,
                                       self.orch.stage_timeout_s, key=f"{plan.stage}-shard-{i}-{attempt}-{token}")

        pending = {submit(i, 0): i for i in range(n)}
        attempts, results, due = [0] * n, [None] * n, []  # due: (monotonic time, shard) of retries to submit
        try:
            while pending or due:
                now = time.monotonic()
                for when, i in [d for d in due if d[0] <= now]:
                    due.remove((when, i))
                    pending[submit(i, attempts[i])] = i
                if not pending:
                    time.sleep(max(0.0, min(d[0] for d in due) - now))
                    continue
                done = self._runner.wait_first(list(pending), (min(d[0] for d in due) - now) if due else None)
                for fut in done:
                    if fut not in pending:  # a broken pool's, already rescheduled below
                        continue
                    error = self._runner.error_of(fut)
                    if error is None:
                        results[pending.pop(fut)] = fut.result()
                        progress()
                        continue
                    # a worker that died (the OOM killer; not a shard, those are forked off it) breaks the pool:
                    # every shard still in it failed with it and is retried on a new one
                    failed = list(pending.items()) if isinstance(error, BrokenProcessPool) else [(fut, pending[fut])]
                    for f, i in failed:
                        del pending[f]
                        delay = self._retry_delay(plan, i, error, attempts[i], retries)
                        if delay is None:
                            raise error
                        attempts[i] += 1
                        due.append((time.monotonic() + delay, i))
                    if isinstance(error, BrokenProcessPool):
                        self._runner.close(kill=True)
                        self._runner = self._make()
                        self._runner.start()
        except BaseException:
            self._runner.close(kill=True)  # the other shards stop now; `close` finds nothing left to do
            self._runner = None
            raise
        return results

    def _retry_delay(self, plan: StagePlan, index: int, error: BaseException, attempt: int,
                     retries: int) -> float | None:
        """Seconds to wait before retry `attempt + 1` of a failed shard, or None: no retry (none left, or an error
        a retry cannot heal). Backoff: `retry_backoff_s` * 2^attempt, plus up to `retry_jitter` of it at random."""
        if isinstance(error, PERMANENT_ERRORS) or attempt >= retries:
            return None
        delay = self.orch.retry_backoff_s * 2 ** attempt * (1 + self.orch.retry_jitter * random.random())
        _flow_log(f"{plan.stage}: shard {index} of {len(plan.shards)} failed ({type(error).__name__}: {error}); "
                  f"retry {attempt + 1} of {retries} in {delay:.1f} s", logging.WARNING)
        return delay

    def close_soon(self) -> None:
        """Stop the workers in a background thread while the flow goes on to its next stage or its last steps;
        `close` waits for it."""
        if self._closing is None and (self._runner is not None or self._starting is not None):
            self._closing = threading.Thread(target=self._close, name="lifecycle-shards-close", daemon=True)
            self._closing.start()

    def close(self) -> None:
        if self._closing is not None:
            self._closing.join()
            self._closing = None
        self._close()

    def _close(self) -> None:
        try:
            self._wait_started()
        except BaseException as e:  # noqa: BLE001 - workers that failed to start have nothing to close
            log.warning("the shard workers failed to start: %s", e)
        runner, self._runner = self._runner, None
        if runner is not None:
            self.timing["dask_close_start"] = time.time()
            runner.close()
            self.timing["dask_closed"] = time.time()


def _flow_log(message: str, level: int = logging.INFO) -> None:
    """To the Prefect run's log when called inside a flow or task run, else to this module's logger."""
    try:
        from prefect.logging import get_run_logger

        get_run_logger().log(level, message)
    except Exception:  # no run context (tests, library callers)
        log.log(level, message)
