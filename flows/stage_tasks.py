"""The one place where plain stage functions become Prefect tasks.

Cache keys come from content, never from the flow-run id: a stage's key is a sha256 over its name, its
code version and its parameters, where a `DatasetRef` counts by its content sha256. Results are persisted
as JSON under the work dir, so a new flow run with the same inputs finds them (`Cached`), and if a
result is ever missing the stage function itself finds its committed dataset (`reused`) without
recomputing. Where results are stored is Prefect's setting `PREFECT_RESULTS_LOCAL_STORAGE_PATH`, which the
CLI points at `<workdir>/.prefect-results`; keys include the work dir, so two work dirs never share a result.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import sys
from pathlib import Path
from typing import Any, Callable

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.task_runners import ThreadPoolTaskRunner
from prefect.tasks import exponential_backoff
from prefect.utilities.annotations import unmapped
from pydantic import BaseModel

from lifecycle.config import ConfigError, OrchestrationConfig
from lifecycle.dataset import AccountingError, DatasetRef, code_version, run_shard, sha256_json
from tasks.collect import InputError
from tasks.evaluate import ContaminationError

# Errors that a retry cannot heal: bad config, bad inputs, a broken accounting identity, a contaminated split.
PERMANENT_ERRORS = (ConfigError, InputError, AccountingError, ContaminationError)


def _identity(value: Any) -> Any:
    if isinstance(value, DatasetRef):
        return {"dataset": value.stage, "sha256": value.sha256}
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, (list, tuple)):
        return [_identity(v) for v in value]
    if isinstance(value, dict):
        return {k: _identity(v) for k, v in value.items()}
    return value


def content_cache_key(stage: str, code: str) -> Callable:
    def key(_ctx, parameters: dict[str, Any]) -> str:
        return f"{stage}-{sha256_json({'code': code, 'params': _identity(parameters)})}"

    return key


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


def stage_modules(*roots) -> list:
    """The stage's modules and every `tasks.*` module they import from (e.g. dedup -> minhash), so that an
    edit to any of them changes the cache key, as it changes the stage's own dataset fingerprint."""
    seen: dict[str, Any] = {}
    for root in roots:
        seen[root.__name__] = root
        for value in vars(root).values():
            mod = value if inspect.ismodule(value) else sys.modules.get(getattr(value, "__module__", None) or "")
            if mod is not None and mod.__name__.startswith("tasks.") and getattr(mod, "__file__", None):
                seen.setdefault(mod.__name__, mod)
    return [seen[name] for name in sorted(seen)]


def stage_task(
    fn: Callable,
    stage: str,
    orchestration: OrchestrationConfig,
    retries: int,
    extra_modules: tuple = (),
):
    """Wrap a plain stage function as a Prefect task with content-keyed caching and retries."""
    code = code_version(*stage_modules(sys.modules[fn.__module__], *extra_modules))
    return task(
        fn,
        name=stage,
        cache_key_fn=content_cache_key(stage, code),
        persist_result=True,
        result_serializer="json",
        **_retry_options(orchestration, retries),
        timeout_seconds=None if stage == "train" else orchestration.stage_timeout_s,
    )


def shard_task(stage: str, orchestration: OrchestrationConfig, retries: int):
    """One shard of a sharded stage (`lifecycle.dataset.run_shard`). Not cached by Prefect: the shard's
    published directory is its result, so a retry or a rerun after a crash skips finished shards."""
    return task(
        run_shard,
        name=f"{stage}-shard",
        task_run_name=f"{stage}-shard-{{index}}",
        cache_policy=NO_CACHE,
        persist_result=False,
        **_retry_options(orchestration, retries),
        timeout_seconds=orchestration.stage_timeout_s,
    )


class ShardRunner:
    """The task runner that shards are mapped over, started on first use and shut down with the flow.

    A Dask LocalCluster of `dask_workers` processes by default, the cluster at `dask_address` when one is
    configured, or (`dask_workers: 0`) one thread in the flow process. It is chosen per run from the config,
    so deployments served from `prefect.yaml` get the same behaviour as `lifecycle run`.
    """

    def __init__(self, orchestration: OrchestrationConfig):
        self.orch = orchestration
        self._stack = contextlib.ExitStack()
        self._runner = None

    def _make(self):
        if self.orch.dask_address:
            from prefect_dask import DaskTaskRunner

            return DaskTaskRunner(address=self.orch.dask_address)
        if self.orch.dask_workers == 0:
            return ThreadPoolTaskRunner(max_workers=1)
        from prefect_dask import DaskTaskRunner

        return DaskTaskRunner(cluster_class="distributed.LocalCluster", cluster_kwargs={
            "n_workers": self.orch.dask_workers, "threads_per_worker": 1, "processes": True,
            "host": "127.0.0.1", "dashboard_address": None, "silence_logs": logging.WARNING})

    def map(self, task_, plan, n: int) -> list:
        if self._runner is None:
            self._runner = self._stack.enter_context(self._make())
        futures = self._runner.map(task_, {"plan": unmapped(plan), "index": list(range(n))})
        return futures.result()  # raises the first shard failure (after that shard's retries)

    def close(self) -> None:
        self._stack.close()
        self._runner = None


def plain_task(fn: Callable, name: str):
    """A task that must run every time (it reads or writes run-specific state)."""
    return task(fn, name=name, cache_policy=NO_CACHE, persist_result=False)
