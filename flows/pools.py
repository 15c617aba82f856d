"""Where the shards of a data stage run: local worker processes (`LocalPool`), or a Dask cluster (`DaskPool`).

`ShardRunner` (flows/shards.py) picks one per run and schedules the shards on it; both answer the same calls
(`start`, `submit`, `wait_first`, `error_of`, `close`). This module imports neither Prefect nor the stages: the
CLI calls `reap_workers` at exit. Why a forkserver pool and not a local Dask cluster: docs/benchmarks.md, "Issue 25:
shards as plain futures on a forkserver pool".
"""

from __future__ import annotations

import logging
import os
from typing import Callable

log = logging.getLogger(__name__)


class LocalPool:
    """Local shard workers. `processes`: a ProcessPoolExecutor whose processes fork from a forkserver that imported
    the data stages once (`lifecycle.flows.worker_preload`). Otherwise (`dask_workers: 0`) one thread of the flow
    process, one shard after another."""

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


class DaskPool:
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
