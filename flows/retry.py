"""Where a plain stage function becomes a Prefect task: retries with backoff, no Prefect cache.

Prefect caches nothing (`NO_CACHE`): the content-addressed dataset store is the only cache. A stage function
computes its output's fingerprint (parents, config, code version) and returns the committed dataset when one
exists, so a rerun says `reused` without Prefect's help, and a deleted dataset is simply rebuilt. Errors a retry
cannot heal (`PERMANENT_ERRORS`) are not retried, here nor by the shard runner (`flows/shards.py`).
"""

from __future__ import annotations

from typing import Callable

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.tasks import exponential_backoff

from lifecycle.config import ConfigError, OrchestrationConfig
from lifecycle.core.dataset import AccountingError, DatasetDamaged
from lifecycle.tasks.data.collect.stage import InputError
from lifecycle.tasks.data.decontaminate.ngrams import ContaminationError

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
        name=stage,
        cache_policy=NO_CACHE,
        persist_result=False,
        **_retry_options(orchestration, retries),
        timeout_seconds=None if stage == "train" else orchestration.stage_timeout_s,
    )(fn)


def plain_task(fn: Callable, name: str):
    """A task that must run every time (it reads or writes run-specific state)."""
    return task(name=name, cache_policy=NO_CACHE, persist_result=False)(fn)
