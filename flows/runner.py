"""The one place where plain stage functions become Prefect tasks, and where a registered stage is run.

Prefect caches nothing (`NO_CACHE`): the content-addressed dataset store is the only cache. A stage function
computes its output's fingerprint (parents, config, code version) and returns the committed dataset when one
exists, so a rerun says `reused` without Prefect's help, and a deleted dataset is simply rebuilt.
Prefect gives each stage retries with backoff, except for errors a retry cannot heal; the shards of a sharded
stage are retried the same way by `ShardRunner`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import signal
import threading
import time
import uuid
from typing import Any, Callable

from prefect import task
from prefect.exceptions import TerminationSignal
from prefect.cache_policies import NO_CACHE
from prefect.tasks import exponential_backoff
from pydantic import BaseModel

from lifecycle.config import ConfigError, OrchestrationConfig
from lifecycle.core.dataset import (
    AccountingError, DatasetDamaged, StageStats,
)
from lifecycle.core.procs import Terminated
from lifecycle.core.shards import SHARD_MARKER, StagePlan, commit_plan, run_shard_watched
from lifecycle.tasks.data.collect.stage import InputError
from lifecycle.tasks.data.decontaminate.ngrams import ContaminationError

log = logging.getLogger(__name__)

# Errors that a retry cannot heal: bad config, bad inputs, a broken accounting identity, a contaminated split,
# a parent dataset found damaged while read (the next run moves it aside and rebuilds it).
PERMANENT_ERRORS = (ConfigError, InputError, AccountingError, ContaminationError, DatasetDamaged)


def _retry_unless_permanent(_task, _task_run, state) -> bool:
    try:
        state.result()
    except PERMANENT_ERRORS:
        return False
    except Exception:
        return True
    return True


def _retry_options(orchestration: OrchestrationConfig, retries: int) -> dict:
    """Exponential backoff with jitter; errors a retry cannot heal are not retried."""
    return {"retries": retries,
            "retry_delay_seconds": exponential_backoff(backoff_factor=orchestration.retry_backoff_s),
            "retry_jitter_factor": orchestration.retry_jitter, "retry_condition_fn": _retry_unless_permanent}


def stage_task(
    fn: Callable,
    stage: str,
    orchestration: OrchestrationConfig,
    retries: int,
):
    """Wrap a plain stage function as a Prefect task with retries. Prefect caches nothing: the stage
    function finds its own committed output in the dataset store (the one cache) and returns it."""
    return task(
        fn,
        name=stage,
        cache_policy=NO_CACHE,
        persist_result=False,
        **_retry_options(orchestration, retries),
        timeout_seconds=None if stage == "train" else orchestration.stage_timeout_s,
    )


class _Pool:
    """Local shard workers. `processes`: a ProcessPoolExecutor whose processes fork from a forkserver that imported
    the data stages once (`lifecycle.flows.worker_preload`); a Dask LocalCluster did the same job with a scheduler,
    a nanny and a worker process per worker, 3.6-4.2 s of CPU to start on 2 cores against ~1.1 s here. Otherwise
    (`dask_workers: 0`) one thread of the flow process, one shard after another."""

    def __init__(self, workers: int, processes: bool = True):
        from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor

        self.workers, self.processes = workers, processes
        if processes:
            import multiprocessing as mp

            self._others = {p.pid for p in mp.active_children()}  # processes this pool did not start
            ctx = mp.get_context("forkserver")
            ctx.set_forkserver_preload(["lifecycle.flows.worker_preload"])
            from lifecycle.core.procs import start_time
            from lifecycle.flows.worker_preload import worker_started

            self.executor = ProcessPoolExecutor(workers, mp_context=ctx, initializer=worker_started,
                                                initargs=(os.getpid(), start_time(os.getpid())))
        else:
            self.executor = ThreadPoolExecutor(workers, thread_name_prefix="lifecycle-shard")

    def start(self) -> None:
        """Start every worker now (they are otherwise started as shards arrive) and wait until they answer."""
        for f in [self.executor.submit(os.getpid) for _ in range(self.workers)]:
            f.result()

    def submit(self, fn: Callable, *args, key: str):
        return self.executor.submit(fn, *args)

    def wait_first(self, futures: list, timeout: float | None) -> set:
        from concurrent.futures import FIRST_COMPLETED, wait

        return wait(futures, timeout=timeout, return_when=FIRST_COMPLETED).done

    @staticmethod
    def error_of(future) -> BaseException | None:
        return future.exception()

    def close(self, kill: bool = False) -> None:
        """Stop the workers; `kill`: at once, shards and all (a failed stage: their forked shard processes die with
        them, PR_SET_PDEATHSIG; a thread is left to end with its shard), else after the queued work, which is none
        once `map` has returned."""
        if kill and self.processes:
            for proc in list(self.executor._processes.values()):  # CPython 3.11 has no public call for it
                proc.kill()
        self.executor.shutdown(wait=self.processes or not kill, cancel_futures=True)
        if self.processes:
            reap_workers(spare=self._others)


def reap_workers(timeout: float = 5, spare: set[int] = frozenset()) -> list[int]:
    """Kill the multiprocessing children still alive once the pool is shut down, and wait for them (bounded). A
    worker whose start a signal interrupted is in no table of the executor's: it would wait for work forever,
    and the interpreter's exit (multiprocessing's atexit hook) would wait for it. Returns their pids."""
    import multiprocessing

    left = [p for p in multiprocessing.active_children() if p.pid not in spare]
    for proc in left:
        proc.kill()
    for proc in left:
        proc.join(timeout)
    if left:
        log.warning("killed %d shard worker(s) left behind by the pool: %s", len(left), [p.pid for p in left])
    return [p.pid for p in left]


class _Dask:
    """Shards on the Dask cluster at `orchestration.dask_address` (`dask scheduler` and `dask worker`s)."""

    def __init__(self, address: str):
        from distributed import Client

        # never the default client: the flow process may hold another one (`lifecycle serve`), and `close_soon`
        # closes this one from another thread
        self.client = Client(address, set_as_default=False)

    def start(self) -> None:
        pass

    def submit(self, fn: Callable, *args, key: str):
        return self.client.submit(fn, *args, pure=False, key=key)

    def wait_first(self, futures: list, timeout: float | None) -> set:
        from distributed.client import FIRST_COMPLETED, _wait

        try:  # distributed.wait, on this client (the module's function takes the default client)
            return set(self.client.sync(_wait, futures, return_when=FIRST_COMPLETED, timeout=timeout).done)
        except TimeoutError:
            return set()

    @staticmethod
    def error_of(future) -> BaseException | None:
        return None if future.status == "finished" else future.exception()

    def close(self, kill: bool = False) -> None:
        self.client.close()


class ShardRunner:
    """Runs the shards of the data stages, started on first use and shut down with the flow.

    `dask_workers` local worker processes by default (`_Pool`), the Dask cluster at `dask_address` when one is
    configured, or (`dask_workers: 0`) one shard after another in a thread of the flow process. It is chosen per run from the
    config, so deployments served from `prefect.yaml` get the same behaviour as `lifecycle run`.

    Shards are plain futures of `run_shard_watched`, not Prefect tasks: a Prefect task run costs its worker about
    0.12 s of CPU and the flow process 0.04 s more (task engine, state reports to the server), against 0.004 s
    for a future, and a 24 MB corpus is ~20 shards on 2 cores. Prefect sees each sharded stage as three tasks
    (`<stage>-plan`, `<stage>-shards`, `<stage>-commit`); the shards' retries are done here, as Prefect's were:
    `data_retries` per shard, exponential backoff from `retry_backoff_s` with `retry_jitter`, none for an error a
    retry cannot heal, each retry logged on the flow run.
    """

    def __init__(self, orchestration: OrchestrationConfig, timing: dict[str, float] | None = None):
        self.orch = orchestration
        self._runner: _Pool | _Dask | None = None
        self._starting: threading.Thread | None = None
        self._start_error: BaseException | None = None
        self._closing: threading.Thread | None = None
        self.timing = {} if timing is None else timing  # dask_start/dask_ready/dask_close_start/dask_closed

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
            return _Dask(self.orch.dask_address)
        return _Pool(max(self.orch.dask_workers, 1), processes=self.orch.dask_workers > 0)

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


def plain_task(fn: Callable, name: str):
    """A task that must run every time (it reads or writes run-specific state)."""
    return task(fn, name=name, cache_policy=NO_CACHE, persist_result=False)


# --------------------------------------------------------------------------------------------------
# running a registered stage


class Reporter:
    """Progress of a flow run, for whoever watches it (`lifecycle run`'s console, `lifecycle.console`).
    This one tells no one: served deployments and in-process callers get it. Stage names are strings;
    `stats` are a manifest's `stats` (rows_in, rows_kept, rows_rejected, rejected_by_reason, ...)."""

    def stage_started(self, stage: str) -> None:
        pass

    def shards_done(self, stage: str, done: int, total: int, stats: dict) -> None:
        """`done` of `total` shards are published; `stats` merges theirs."""

    def train_metrics(self, record: dict) -> None:
        """One new metrics.jsonl record of the training ranks (`kind` train, eval or rollback)."""

    def progress(self, stage: str, text: str) -> None:
        """Where a single-task stage is (evaluate: 'part 2/4: generation, 16 prompts')."""

    def stage_done(self, stage: str, outcome: str, stats: dict | None = None, detail: str = "") -> None:
        """`outcome`: computed, resumed or reused; `detail`: a short phrase for what is not in `stats`."""

    def note(self, text: str) -> None:
        """A line worth a reader's attention that belongs to no stage line (a warm start, nothing to do)."""


_reporter: Reporter = Reporter()


def reporter() -> Reporter:
    """The reporter of the flow run in this process."""
    return _reporter


@contextlib.contextmanager
def reporting(rep: Reporter):
    """Report the flow runs started inside this block to `rep`."""
    global _reporter
    previous, _reporter = _reporter, rep
    try:
        yield rep
    finally:
        _reporter = previous


def interrupt_of(exc: BaseException) -> str | None:
    """The signal's name when `exc` is an interrupt (^C, or SIGTERM as raised by the CLI's handler or by Prefect's
    own while a flow runs); None for any other failure."""
    if isinstance(exc, KeyboardInterrupt):
        return "SIGINT"
    if isinstance(exc, Terminated):
        return str(exc)
    if isinstance(exc, TerminationSignal):
        return signal.Signals(exc.signal).name
    return None


_interrupted: list[tuple[Any, str]] = []  # (flow run id, signal) of flow runs an interrupt ended in this process


def note_interrupted(flow_run_id, signame: str) -> None:
    """Remember a flow run that an interrupt is ending; `cancel_interrupted` marks it once Prefect's engine is done."""
    _interrupted.append((flow_run_id, signame))


def cancel_interrupted() -> None:
    """Move the flow runs an interrupt ended to Cancelled. Prefect's engine forces them to Crashed as the exception
    leaves the flow; the caller (`lifecycle run`) calls this after that, while the server still runs."""
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelled

    while _interrupted:
        flow_run_id, signame = _interrupted.pop()
        try:
            with get_client(sync_client=True) as client:
                client.set_flow_run_state(flow_run_id, Cancelled(
                    message=f"interrupted by {signame}; rerun to resume from the last commit"), force=True)
        except Exception as e:  # the run is being interrupted: say so, never mask the interrupt
            log.warning("could not mark flow run %s cancelled: %s", flow_run_id, e)


class RunSummary(BaseModel):
    """What a flow run did: returned by the flow, printed by `lifecycle run`, the last line under `--json`."""

    status: str = "running"
    workdir: str
    mlflow_run_id: str | None = None
    mlflow_tracking_uri: str | None = None
    prefect_flow_run_id: str | None = None
    datasets: dict[str, str] = {}
    """Each stage's committed `_manifest.json`."""
    stages: dict[str, str] = {}
    """computed, resumed (some shards came from an earlier attempt) or reused, per stage."""
    skipped: dict[str, str] = {}
    """Enabled stages that did not run, with the reason (perplexity with no champion registered)."""
    checkpoint: str | None = None
    model: dict[str, str] | None = None
    promotion: dict[str, Any] | None = None
    warm_start: dict[str, Any] | None = None
    metrics: dict[str, Any] = {}
    artifacts: dict[str, str] = {}
    """Where the parent MLflow run's charts and model card are: {funnel, loss_curves, model_card} -> artifact URI."""
    timing: dict[str, float] = {}
    """Where the run's wall time went (bench/run_overhead.py reads it). Epoch seconds: `command_start` (the
    `lifecycle` command's first line), `prefect_start`, `prefect_launched` (the embedded Prefect server found, or
    launched), `imports_done` (Prefect and the flow's modules imported meanwhile), `prefect_ready` (the server
    answers), `flow_call`, then
    `flow_start` (the flow function entered), `tracker_ready` (MLflow run open), `first_stage_start`,
    `last_stage_end`, `flow_end`, and `dask_start`/`dask_ready`/`dask_close_start`/`dask_closed` when the shard
    cluster ran; `stage:<name>`: each stage's duration in seconds, `stage_start:<name>` its start (epoch)."""


def outcome_of(value: Any) -> str:
    if getattr(value, "reused", False) or getattr(value, "launched", True) is False:
        return "reused"
    return "computed"


class StageRunner:
    """Runs registered stages (`lifecycle.tasks.stages`) as Prefect tasks, in the flow's order, up to `until`.

    `runner(STAGE, *parents, **kw)` calls the stage's entry points with (*parents, its config section, work dir,
    **kw): a sharded stage is planned, its missing shards mapped over the shard runner (`ShardRunner`) and
    committed; a single-task stage is one task. It returns the stage's output (a `DatasetRef`, or the train
    stage's `TrainResult`), or None once a stage at or after `until` has run, so the flow reads top to bottom.
    Each stage's outcome and manifest go into `summary`; `on_done(stage, output, outcome, extra, section)` is
    called after each stage (the flow logs it to MLflow there).
    """

    def __init__(self, cfg, summary: RunSummary, until: str | None, on_done: Callable,
                 shards: ShardRunner | None = None):
        self.cfg, self.summary, self.on_done = cfg, summary, on_done
        self.until = until
        self.timing = summary.timing
        self.shards = shards if shards is not None else ShardRunner(cfg.orchestration, self.timing)
        self.reporter = reporter()

    def wants(self, stage) -> bool:
        """Whether `stage` will run (it is not past `until`)."""
        from lifecycle.tasks.stages import NAMES

        return self.until is None or NAMES.index(stage.name) <= NAMES.index(self.until)

    def __call__(self, stage, *parents, config: Any = None, **kw) -> Any:
        if not self.wants(stage):
            return None
        if stage.group != "data":
            self.shards.close_soon()  # the shard workers are not needed past the data stages
        orch = self.cfg.orchestration
        section = config if config is not None else (getattr(self.cfg, stage.name) if stage.configured else None)
        args = (*parents, *([section] if stage.configured else []), self.cfg.workdir)
        retries = orch.train_retries if stage.group == "train" else orch.data_retries
        extra: dict[str, Any] = {}
        outcome = None
        started = time.time()
        self.timing.setdefault("first_stage_start", started)
        self.timing[f"stage_start:{stage.name}"] = started
        self.reporter.stage_started(stage.name)
        if stage.plan:
            name = stage.sharded_name or stage.name
            ref, outcome, extra = self._sharded(stage.name, name, stage.entry("plan"), args, {} if stage.run else kw,
                                                retries)
            if stage.run:
                kw = {**kw, stage.sharded_arg: ref}
        if stage.run:
            value = stage_task(stage.entry("run"), stage.name, orch, retries)(*args, **kw)
            own = outcome_of(value)
            outcome = "resumed" if own == "computed" and outcome == "resumed" else own
        else:
            value = ref
        self.summary.stages[stage.name] = outcome
        if hasattr(value, "manifest_path"):
            self.summary.datasets[stage.name] = str(value.manifest_path)
        self.on_done(stage, value, outcome, extra, section)
        self.timing["last_stage_end"] = time.time()  # the workers' shutdown below is overhead, not the stage's
        self.timing[f"stage:{stage.name}"] = round(self.timing["last_stage_end"] - started, 4)
        if self.until == stage.name:
            self.shards.close_soon()
        return value

    def _sharded(self, stage: str, name: str, plan_fn: Callable, args: tuple, kw: dict, retries: int):
        """plan -> one task per missing shard on the shard runner -> commit. Returns (ref, outcome, metrics).
        `name`: the sharded dataset (dedup's is dedup-signatures); progress is reported for `stage`."""
        plan = plain_task(plan_fn, f"{name}-plan")(*args, **kw)
        if not isinstance(plan, StagePlan):
            return plan, "reused", {}
        reused = len(plan.done_shards())
        plain_task(self.shards.map, f"{name}-shards")(plan, len(plan.shards), retries,
                                                      on_progress=_ShardProgress(plan, stage, self.reporter))
        ref = plain_task(commit_plan, f"{name}-commit")(plan)
        return ref, "resumed" if reused else "computed", {"shards": len(plan.shards), "shards_reused": reused}

    def close(self) -> None:
        self.shards.close()


class _ShardProgress:
    """Reads the stats of newly published shards (their `_shard.json`) and reports the running total."""

    def __init__(self, plan: StagePlan, stage: str, rep: Reporter):
        self.plan, self.stage, self.reporter = plan, stage, rep
        self.seen: set[int] = set()
        self.stats = StageStats()

    def __call__(self) -> None:
        new = [i for i in self.plan.done_shards() if i not in self.seen]
        for i in new:  # a published shard directory is complete (renamed into place after its marker)
            marker = json.loads((self.plan.shard_dir(i) / SHARD_MARKER).read_text())
            self.stats = self.stats + StageStats.from_dict(marker["stats"])
            self.seen.add(i)
        if new:
            self.reporter.shards_done(self.stage, len(self.seen), len(self.plan.shards), self.stats.to_dict())
